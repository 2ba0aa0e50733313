"""RandomErasing in the DALI graph against timm's ``RandomErasing``.

The loader draws a batch's boxes on a ``random.Random`` seeded by
``batch_seed(seed, rank, epoch, batch, ERASE_STREAM)`` with the calls timm makes
on Python's ``random`` module. So, seeding ``random`` the same way, ``"const"``
mode must equal timm's output exactly; ``"rand"`` and ``"pixel"`` fill the very
same boxes with normal values that cannot be timm's (timm draws them with torch),
so their fill is checked by its distribution.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from recipe_helpers import CLASSES, epoch_batches, timm_module, write_photo_dataset

from dali_pipes import ClassificationTrain, Mix, RandomErasing
from dali_pipes.pipelines.batch_inputs import ERASE_STREAM, MIX_STREAM, batch_seed

SIZE = 48
SEED = 3


@pytest.fixture(scope="module")
def photos_dataset(tmp_path_factory, imagenet_mini):
    from conftest import write_dataset

    return write_photo_dataset(write_dataset.__wrapped__(), tmp_path_factory.mktemp("erase") / "ds", imagenet_mini)


@pytest.fixture(scope="module")
def plain_batches(photos_dataset):
    """``(epoch, layout)`` -> that epoch's batches without erasing, read once for all the tests of the module."""
    read: dict[tuple[int, str], list[dict]] = {}

    def batches(epoch: int, layout: str = "NCHW") -> list[dict]:
        if (epoch, layout) not in read:
            read[epoch, layout] = epoch_batches(photos_dataset, ClassificationTrain(size=SIZE, layout=layout), epoch)
        return read[epoch, layout]

    return batches


def timm_erasing(erasing: RandomErasing, mode: str):
    return timm_module("random_erasing").RandomErasing(
        probability=erasing.prob,
        min_area=erasing.min_area,
        max_area=erasing.max_area,
        min_aspect=erasing.min_aspect,
        max_aspect=erasing.max_aspect,
        mode=mode,
        min_count=erasing.min_count,
        max_count=erasing.max_count,
        device="cpu",
    )


def timm_erased(batches: list[dict], erasing: RandomErasing, epoch: int, mode: str) -> list[torch.Tensor]:
    out = []
    for number, batch in enumerate(batches):
        random.seed(batch_seed(SEED, 0, epoch, number, ERASE_STREAM))
        out.append(timm_erasing(erasing, mode)(batch["image"].clone()))
    return out


def erased_masks(batches: list[dict], erasing: RandomErasing, epoch: int) -> list[torch.Tensor]:
    """Where timm erases (its boxes on an image of ones, in ``"const"`` mode, same draws)."""
    ones = [{"image": torch.ones_like(b["image"])} for b in batches]
    return [image == 0 for image in timm_erased(ones, erasing, epoch, "const")]


ERASINGS = [
    RandomErasing(prob=1.0),
    RandomErasing(prob=0.5, min_area=0.1, max_area=0.4, min_aspect=0.5, max_count=3),
    RandomErasing(prob=0.9, min_count=2, max_count=2, max_aspect=2.0),
]


@pytest.mark.parametrize("erasing", ERASINGS, ids=range(len(ERASINGS)))
def test_const_erasing_equals_timms_given_the_same_draws(photos_dataset, plain_batches, erasing):
    erased_any = False
    for epoch in (0, 1):
        plain = plain_batches(epoch)
        ours = epoch_batches(photos_dataset, ClassificationTrain(size=SIZE, erasing=erasing), epoch)
        for mine, theirs, before in zip(ours, timm_erased(plain, erasing, epoch, "const"), plain):
            assert torch.equal(mine["image"], theirs)
            erased_any |= not torch.equal(mine["image"], before["image"])
    assert erased_any


def nchw(batches: list[dict], layout: str) -> list[dict]:
    if layout == "NCHW":
        return batches
    return [{**b, "image": b["image"].permute(0, 3, 1, 2).contiguous()} for b in batches]


@pytest.mark.parametrize("mode, layout", [("rand", "NCHW"), ("pixel", "NCHW"), ("rand", "NHWC"), ("pixel", "NHWC")])
def test_random_fills_cover_timms_boxes_with_standard_normal_values(photos_dataset, plain_batches, mode, layout):
    erasing = RandomErasing(prob=1.0, mode=mode, min_area=0.1, max_count=2)
    fills = []
    for epoch in range(3):
        plain = nchw(plain_batches(epoch, layout), layout)
        spec = ClassificationTrain(size=SIZE, erasing=erasing, layout=layout)
        ours = nchw(epoch_batches(photos_dataset, spec, epoch), layout)
        for mine, before, mask in zip(ours, plain, erased_masks(plain, erasing, epoch)):
            assert mask.any()
            assert torch.equal(mine["image"][~mask], before["image"][~mask])  # outside timm's boxes: untouched
            fill = mine["image"][mask]
            assert not torch.equal(fill, before["image"][mask])
            if mode == "rand":
                # One colour per box and channel: few distinct values, each filling a whole box.
                for row in range(len(mask)):
                    for channel in range(3):
                        values = mine["image"][row, channel][mask[row, channel]].unique()
                        assert 1 <= len(values) <= erasing.max_count
                        fills.extend(values.tolist())
            else:
                fills.extend(fill.tolist())
    fills = np.array(fills)
    assert abs(fills.mean()) < (0.5 if mode == "rand" else 0.05)
    assert (0.5 if mode == "rand" else 0.95) < fills.std() < (1.5 if mode == "rand" else 1.05)


def test_erasing_then_mixing_is_timms_order(photos_dataset, plain_batches):
    erasing = RandomErasing(prob=1.0)
    mix = Mix(mixup_alpha=1.0, cutmix_alpha=1.0, mode="elem")
    plain = plain_batches(0)
    ours = epoch_batches(photos_dataset, ClassificationTrain(size=SIZE, erasing=erasing, mix=mix), 0)
    mixup = timm_module("mixup").Mixup(mixup_alpha=1.0, cutmix_alpha=1.0, mode="elem", num_classes=len(CLASSES))
    for number, (mine, erased, before) in enumerate(zip(ours, timm_erased(plain, erasing, 0, "const"), plain)):
        np.random.seed(batch_seed(SEED, 0, 0, number, MIX_STREAM))
        images, targets = mixup(erased, before["label"])
        torch.testing.assert_close(mine["image"], images, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(mine["label"], targets)


def test_float16_output_stays_float16(photos_dataset):
    spec = ClassificationTrain(size=SIZE, dtype="float16", erasing=RandomErasing(mode="pixel"), mix=Mix())
    batch = epoch_batches(photos_dataset, spec, 0)[0]
    assert batch["image"].dtype == torch.float16 and batch["label"].dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prob=1.5), "RandomErasing.prob"),
        (dict(min_area=0.5, max_area=0.2), "min_area"),
        (dict(mode="noise"), "RandomErasing.mode"),
        (dict(min_count=2, max_count=1), "max_count"),
        (dict(max_count=0), "max_count"),
        (dict(min_aspect=0), "min_aspect"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RandomErasing(**kwargs)


def test_draws_follow_timms_calls_exactly():
    # Same seed, same calls: the boxes timm's _erase would draw for a 30x40 image, row after row.
    erasing = RandomErasing(prob=0.7, max_count=3)
    ours = erasing.draw(random.Random(5), np.random.default_rng(0), rows=6, size=(30, 40)).boxes
    reference = timm_erasing(erasing, "const")
    random.seed(5)
    image = torch.ones(6, 1, 30, 40)
    reference(image)
    for row in range(6):
        mask = torch.zeros(30, 40, dtype=torch.bool)
        for top, left, h, w in ours[row].astype(int).tolist():
            mask[top : top + h, left : left + w] = True
        assert torch.equal(mask, image[row, 0] == 0)
