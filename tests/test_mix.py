"""MixUp/CutMix in the DALI graph against timm's ``Mixup``, on the same batches and the same random draws.

The loader draws a batch's mix on a ``numpy.random.RandomState`` seeded by
``batch_seed(seed, rank, epoch, batch, MIX_STREAM)``, with the calls timm makes
on numpy's global state; seeding that global state the same way and calling
timm's ``Mixup`` on the unmixed batch (the same spec without ``mix``, same seed)
must give the loader's mixed images and soft targets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from recipe_helpers import CLASSES, epoch_batches, timm_module, write_photo_dataset

from dali_pipes import BatchFormat, ClassificationTrain, DALILoader, Mix, RunOptions
from dali_pipes.pipelines.batch_inputs import MIX_STREAM, BatchInputs, batch_seed

SIZE = 40
SEED = 3
IN_PROCESS = RunOptions(device="cpu", py_num_workers=0)  # the CPU, no reader process


@pytest.fixture(scope="module")
def photos_dataset(tmp_path_factory, imagenet_mini):
    from conftest import write_dataset  # the fixture's function, outside a test

    return write_photo_dataset(write_dataset.__wrapped__(), tmp_path_factory.mktemp("mix") / "ds", imagenet_mini)


def timm_mixed(batches: list[dict], mix: Mix, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    mixup = timm_module("mixup")
    timm_mix = mixup.Mixup(
        mixup_alpha=mix.mixup_alpha,
        cutmix_alpha=mix.cutmix_alpha,
        prob=mix.prob,
        switch_prob=mix.switch_prob,
        mode=mix.mode,
        label_smoothing=mix.label_smoothing,
        num_classes=len(CLASSES),
    )
    out = []
    for number, batch in enumerate(batches):
        np.random.seed(batch_seed(SEED, 0, epoch, number, MIX_STREAM))
        out.append(timm_mix(batch["image"].clone(), batch["label"].clone()))
    return out


MIXES = [
    Mix(mixup_alpha=0.8, mode="batch"),
    Mix(mixup_alpha=0.0, cutmix_alpha=1.0, mode="batch"),
    Mix(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, mode="elem", prob=0.8),
    Mix(mixup_alpha=0.4, cutmix_alpha=1.0, switch_prob=0.5, mode="pair", label_smoothing=0.0),
    Mix(mixup_alpha=1.0, cutmix_alpha=0.5, mode="elem", label_smoothing=0.2),
]


def nchw(batches: list[dict], layout: str) -> list[dict]:
    """The batches with NCHW images (timm's layout)."""
    if layout == "NCHW":
        return batches
    return [{**b, "image": b["image"].permute(0, 3, 1, 2).contiguous()} for b in batches]


CASES = [(mix, "NCHW") for mix in MIXES] + [(MIXES[2], "NHWC")]


@pytest.mark.parametrize(
    "mix, layout",
    CASES,
    ids=lambda v: v if isinstance(v, str) else f"{v.mode}-mixup{v.mixup_alpha}-cutmix{v.cutmix_alpha}",
)
def test_mix_equals_timms_mixup_given_the_same_draws(photos_dataset, mix, layout):
    plain = ClassificationTrain(size=SIZE, layout=layout)
    for epoch in (0, 1):
        unmixed = nchw(epoch_batches(photos_dataset, plain, epoch), layout)
        mixed = nchw(
            epoch_batches(photos_dataset, ClassificationTrain(size=SIZE, layout=layout, mix=mix), epoch), layout
        )
        assert len(mixed) == 2 and all(len(b["image"]) == 4 for b in mixed)  # 8 photos: no padding
        changed = 0
        for ours, (images, targets) in zip(mixed, timm_mixed(unmixed, mix, epoch)):
            assert ours["label"].dtype == torch.float32 and ours["label"].shape == (4, len(CLASSES))
            torch.testing.assert_close(ours["image"], images, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(ours["label"], targets, atol=1e-6, rtol=1e-5)
            changed += int(not torch.equal(ours["image"], unmixed[0]["image"]))
        assert changed, "the batches were never mixed: the test would not see a wrong mix"


def test_no_mix_drawn_is_the_unmixed_batch_and_soft_targets_are_smoothed_one_hots(photos_dataset):
    unmixed = epoch_batches(photos_dataset, ClassificationTrain(size=SIZE))
    never = epoch_batches(photos_dataset, ClassificationTrain(size=SIZE, mix=Mix(prob=0.0, label_smoothing=0.1)))
    for plain, ours in zip(unmixed, never):
        assert torch.equal(plain["image"], ours["image"])  # the same crops: the mix adds no DALI random draws
        expected = torch.full((4, len(CLASSES)), 0.1 / len(CLASSES))
        expected[torch.arange(4), plain["label"]] = 0.9 + 0.1 / len(CLASSES)
        torch.testing.assert_close(ours["label"], expected)


def test_draws_repeat_by_seed_epoch_and_batch_and_per_sample_reads_agree(photos_dataset):
    spec = ClassificationTrain(size=SIZE, mix=Mix(mixup_alpha=1.0, cutmix_alpha=1.0, mode="elem"))
    first = epoch_batches(photos_dataset, spec, 1)
    again = epoch_batches(photos_dataset, spec, 1, run=RunOptions(device="cpu", py_num_workers=0, batch_reads=False))
    other = epoch_batches(photos_dataset, spec, 2)
    for a, b in zip(first, again):
        torch.testing.assert_close(a["label"], b["label"])
        torch.testing.assert_close(a["image"], b["image"])
    assert not torch.equal(first[0]["label"], other[0]["label"])


def test_resumed_epoch_draws_the_same_mixes(photos_dataset):
    spec = ClassificationTrain(size=SIZE, mix=Mix(cutmix_alpha=1.0, mode="pair"), flip=0.0, jitter=None)
    whole = epoch_batches(photos_dataset, spec, 0, shuffle=False)
    with DALILoader(photos_dataset, spec, batch_size=4, seed=SEED, shuffle=False, run=IN_PROCESS) as a:
        next(iter(a))
        state = a.state_dict()
    with DALILoader(photos_dataset, spec, batch_size=4, seed=SEED, shuffle=False, run=IN_PROCESS) as b:
        b.load_state_dict(state)
        rest = next(iter(b))
    torch.testing.assert_close(rest["label"], whole[1]["label"])


def test_filler_rows_are_never_partners_of_real_rows():
    mix = Mix(mixup_alpha=1.0, cutmix_alpha=1.0, mode="elem", num_classes=5)
    is_pad = np.array([False, False, True, False, False, True])
    draw = mix.draw(np.random.RandomState(0), is_pad, (32, 32))
    assert draw.partner.tolist() == [4, 3, 2, 1, 0, 5]  # the real rows reversed; filler rows keep themselves
    assert draw.image_lam[is_pad].tolist() == [1.0, 1.0] and draw.target_lam[is_pad].tolist() == [1.0, 1.0]
    assert not draw.box[is_pad].any()
    pair = Mix(mixup_alpha=1.0, mode="pair", num_classes=5).draw(np.random.RandomState(0), np.zeros(5, bool), (8, 8))
    assert (
        pair.image_lam[2] == 1.0 and pair.image_lam[0] == pair.image_lam[4] and pair.image_lam[1] == pair.image_lam[3]
    )


def test_a_short_last_batch_mixes_only_its_real_rows(tmp_path, imagenet_mini):
    from conftest import write_dataset

    path = write_photo_dataset(write_dataset.__wrapped__(), tmp_path / "ds", imagenet_mini, count=7)
    spec = ClassificationTrain(size=SIZE, mix=Mix(mixup_alpha=1.0, mode="elem", label_smoothing=0.0))
    last = epoch_batches(path, spec, 0, batch_format=BatchFormat(with_index=True))[-1]
    labels = [i % 5 for i in last["index"].tolist()]
    assert len(labels) == 3  # the filler row was trimmed off; it was never a partner
    for row, partner in ((0, 2), (1, 1), (2, 0)):
        support = set(torch.nonzero(last["label"][row]).flatten().tolist())
        assert support <= {labels[row], labels[partner]}


def test_num_classes_comes_from_the_dataset_and_bad_settings_are_named(photos_dataset):
    spec = ClassificationTrain(size=SIZE, mix=Mix())
    with DALILoader(photos_dataset, spec, batch_size=4, run=IN_PROCESS) as loader:
        assert loader.pipeline.mix.num_classes == len(CLASSES)
    for kwargs, message in (
        (dict(mixup_alpha=0.0), "both 0"),
        (dict(mode="row"), "Mix.mode"),
        (dict(prob=2), "Mix.prob"),
        (dict(num_classes=1), "num_classes"),
        (dict(cutmix_alpha=-1), "cutmix_alpha"),
    ):
        with pytest.raises(ValueError, match=message):
            Mix(**kwargs)
    with pytest.raises(ValueError, match="dtype='uint8'"):
        ClassificationTrain(mix=Mix(), dtype="uint8")
    with pytest.raises(ValueError, match=r"outside a loader pass Mix\(num_classes=...\)"):
        from nvidia.dali import pipeline_def

        from dali_pipes.pipelines import recipe_ops

        pipeline_def(lambda: recipe_ops.mix_labels(None, {}, Mix()), batch_size=1, num_threads=1, device_id=None)()
    with pytest.raises(ValueError, match="per-batch input"):
        BatchInputs(False, Mix(num_classes=5))  # fine to make; the graph without its inputs is not:
        from pipeline_helpers import run_spec_batch

        run_spec_batch(ClassificationTrain(mix=Mix(num_classes=5)), [np.zeros(4, np.uint8)])


def test_on_many_ranks_a_batch_with_filler_mixes_its_real_rows_only_with_real_rows(tmp_path, imagenet_mini):
    from conftest import write_dataset

    path = write_photo_dataset(write_dataset.__wrapped__(), tmp_path / "ds", imagenet_mini, count=7)
    spec = ClassificationTrain(size=SIZE, mix=Mix(mixup_alpha=1.0, mode="elem", label_smoothing=0.0))
    padded = 0
    for rank in range(4):  # 7 samples, 4 ranks of batch 2: one rank's batch holds a filler row
        run = RunOptions(device="cpu", rank=rank, world_size=4, py_num_workers=0)
        kwargs = dict(run=run, batch_format=BatchFormat(with_index=True))
        unmixed = epoch_batches(path, ClassificationTrain(size=SIZE), 0, batch_size=2, **kwargs)
        for batch, plain in zip(epoch_batches(path, spec, 0, batch_size=2, **kwargs), unmixed):
            pad = batch["is_pad"].bool()
            if not pad.any():
                continue
            padded += 1
            # Mixed with itself, the real row is its own image (the filler is another sample: mixing shows).
            torch.testing.assert_close(batch["image"], plain["image"], atol=1e-5, rtol=1e-5)
            # The one real row's partner is itself (the batch reversed among its real rows): its own label, whole.
            for row in range(len(pad)):
                expected = torch.zeros(len(CLASSES))
                expected[int(batch["index"][row]) % 5] = 1.0
                torch.testing.assert_close(batch["label"][row], expected)
    assert padded == 1
