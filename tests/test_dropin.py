"""The drop-ins for timm's and torchvision's training scripts (issue 37): their functions, called as the scripts call them.

The scripts are not in this repository (and torchvision does not import beside the pinned CPU torch): the calls
below are the scripts' own, argument for argument; timm's ``Mixup``/``FastCollateMixup`` are timm's, loaded from
its installed ``data/mixup.py`` (tests/recipe_helpers.py).
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from converters.runner import convert
from converters.sources import ImageFolderSource
from converters.synth import make_imagefolder

N_TRAIN, N_VAL, CLASSES = 24, 10, 3


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """``DIR/train`` and ``DIR/val``: converted image folders of 3 classes, as the scripts' --data-dir expects."""
    root = tmp_path_factory.mktemp("dropin")
    for split, count, seed in (("train", N_TRAIN, 1), ("val", N_VAL, 2)):
        images = make_imagefolder(root / "images" / split, count, size=(48, 40), classes=CLASSES, seed=seed)
        convert(ImageFolderSource(images), root / "shards" / split, format="lmdb", workers=1, progress=False)
    return root / "shards"


def _timm_mixup():
    from recipe_helpers import timm_module

    try:
        return timm_module("mixup")
    except Exception as exc:  # noqa: BLE001 - timm is installed --no-deps by the README's test command
        pytest.skip(f"timm's data/mixup.py is not installed: {exc}")


# --- timm's train.py ---------------------------------------------------------------------------------


def test_timm_create_dataset_finds_the_converted_splits_by_timms_names(data_dir, tmp_path):
    from dali_pipes.dropin.timm_train import create_dataset

    # train.py: create_dataset(args.dataset, root=args.data_dir, split=args.val_split (default "validation"), ...)
    val = create_dataset("", root=data_dir, split="validation", is_training=False, batch_size=8, class_map="")
    train = create_dataset("", root=data_dir, split="train", is_training=True, batch_size=8, seed=42, repeats=0)
    assert (len(train), len(val)) == (N_TRAIN, N_VAL) and len(train.classes) == CLASSES
    with pytest.raises(ValueError, match="create_dataset\\('hfds/beans'\\)"):
        create_dataset("hfds/beans", root=data_dir, split="train")
    (tmp_path / "raw" / "train" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="not a dataset converted by dali-pipes.*point --data-dir"):
        create_dataset("", root=tmp_path / "raw", split="train")


def test_timm_create_loader_takes_train_py_arguments_and_mixes_as_fast_collate_mixup_would(data_dir):
    from dali_pipes.dropin.timm_train import create_dataset, create_loader

    mixup = _timm_mixup()
    dataset = create_dataset("", root=data_dir, split="train", is_training=True)
    # train.py, prefetcher mode with --mixup 0.8 --cutmix 1.0 --smoothing 0.1: collate_fn=FastCollateMixup(...).
    fast = mixup.FastCollateMixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=CLASSES)
    loader = create_loader(
        dataset,
        input_size=(3, 32, 32),
        batch_size=8,
        is_training=True,
        no_aug=False,
        re_prob=0.25,
        re_mode="pixel",
        re_count=1,
        re_split=False,
        train_crop_mode=None,
        scale=None,
        ratio=None,
        hflip=0.5,
        vflip=0.0,
        color_jitter=0.4,
        color_jitter_prob=None,
        grayscale_prob=0.0,
        gaussian_blur_prob=0.0,
        auto_augment=None,
        num_aug_repeats=0,
        num_aug_splits=0,
        interpolation="random",
        num_workers=2,
        worker_seeding="all",
        collate_fn=fast,
        use_multi_epochs_loader=False,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        pin_memory=False,
        img_dtype=torch.bfloat16,
        device=torch.device("cpu"),
        distributed=False,
        use_prefetcher=True,
    )
    with loader:
        spec = loader.pipeline
        assert spec.size == 32 and spec.jitter.hue == 0.0 and spec.erasing.mode == "pixel"
        assert len(loader) == N_TRAIN // 8 and loader.drop_last
        image, target = next(iter(loader))
        assert image.shape == (8, 3, 32, 32) and image.dtype == torch.bfloat16
        assert target.shape == (8, CLASSES) and target.is_floating_point()  # soft, mixed targets
        assert torch.allclose(target.sum(1), torch.ones(8))
        loader.mixup_enabled = False  # train.py at --mixup-off-epoch, prefetcher mode
        _, target = next(iter(loader))
        assert torch.allclose(target.max(1).values, torch.full((8,), 0.9 + 0.1 / CLASSES))  # smoothed, not mixed


def test_timm_create_loader_refuses_what_it_cannot_honour_and_evaluates_every_sample_once(data_dir):
    from dali_pipes.dropin.timm_train import create_dataset, create_loader

    dataset = create_dataset("", root=data_dir, split="val", is_training=False)
    with pytest.raises(ValueError, match=r"create_loader\(vflip=0.5\)"):
        create_loader(dataset, input_size=(3, 32, 32), batch_size=4, vflip=0.5)
    with pytest.raises(ValueError, match=r"create_loader\(auto_augment='rand-m9-mstd0.5'\)"):
        create_loader(dataset, input_size=32, batch_size=4, is_training=True, auto_augment="rand-m9-mstd0.5")
    # train.py's eval loader: crop_pct and interpolation from data_config.
    with create_loader(
        dataset, input_size=(3, 32, 32), batch_size=4, is_training=False, interpolation="bicubic", crop_pct=0.9,
        num_workers=2, distributed=False, crop_mode="center", pin_memory=False, device="cpu", use_prefetcher=False,
    ) as loader:  # fmt: skip
        assert loader.pipeline.resize == int(32 / 0.9) and not loader.shuffle
        labels = torch.cat([label for _, label in loader])
    assert labels.tolist() == [int(np.asarray(s["label"])) for s in _samples(data_dir / "val")]


def _samples(path):
    from dali_pipes import open_store

    store = open_store(path)
    return [store[i] for i in range(len(store))]


# --- torchvision's references/classification/train.py --------------------------------------------------------------


def _reference_args(data_dir, **overrides):
    """The reference script's defaults for the flags load_data reads."""
    args = dict(
        data_path=str(data_dir), train_crop_size=32, val_resize_size=36, val_crop_size=32, interpolation="bilinear",
        auto_augment=None, random_erase=0.0, ra_magnitude=9, augmix_severity=3, ra_sampler=False, ra_reps=3,
        distributed=False, cache_dataset=False, weights=None, test_only=False, backend="pil", use_v2=False,
    )  # fmt: skip
    return argparse.Namespace(**{**args, **overrides})


def test_torchvision_load_data_and_dataloader_train_and_evaluate_as_the_script_does(data_dir):
    from torch.utils.data import default_collate

    from dali_pipes.dropin.torchvision_reference import DataLoader, load_data

    args = _reference_args(data_dir, random_erase=0.1)
    dataset, dataset_test, train_sampler, test_sampler = load_data(str(data_dir / "train"), str(data_dir / "val"), args)
    num_classes = len(dataset.classes)  # the script's next line
    seen = []

    def collate_fn(batch):  # as the script's: mixup_cutmix(*default_collate(batch)), any callable
        seen.append(len(batch))
        images, labels = default_collate(batch)
        return images.flip(0), torch.nn.functional.one_hot(labels, num_classes).float()

    train_sampler.set_epoch(3)  # before the loader exists, as a script may
    data_loader = DataLoader(
        dataset, batch_size=8, sampler=train_sampler, num_workers=4, pin_memory=True, collate_fn=collate_fn
    )
    data_loader_test = DataLoader(dataset_test, batch_size=4, sampler=test_sampler, num_workers=4, pin_memory=True)
    with data_loader, data_loader_test:
        assert data_loader.epoch == 3 and data_loader.pipeline.erasing.prob == 0.1
        image, target = next(iter(data_loader))
        assert seen == [8] and image.shape == (8, 3, 32, 32) and target.shape == (8, num_classes)
        train_sampler.set_epoch(5)  # the script's next epoch: the next pass covers it
        next(iter(data_loader))
        assert data_loader.epoch == 5 and len(train_sampler) == 8 * len(data_loader)
        # evaluate(): every sample once, in order; len(data_loader.dataset) is what it compares with.
        count = sum(len(target) for _, target in data_loader_test)
        assert count == len(data_loader_test.dataset) == N_VAL and not data_loader_test.shuffle


def test_torchvision_flags_the_loader_cannot_honour_are_refused_by_name(data_dir):
    from dali_pipes.dropin.torchvision_reference import DataLoader, load_data

    dirs = (str(data_dir / "train"), str(data_dir / "val"))
    for overrides, message in (
        (dict(ra_sampler=True), "--ra-sampler"),
        (dict(auto_augment="augmix"), "--auto-augment augmix"),
        (dict(weights="ResNet18_Weights.DEFAULT", test_only=True), "--weights with --test-only"),
    ):
        with pytest.raises(ValueError, match=message):
            load_data(*dirs, _reference_args(data_dir, **overrides))
    dataset, _, _, _ = load_data(*dirs, _reference_args(data_dir))
    with pytest.raises(ValueError, match="draws its own epochs"):
        DataLoader(dataset, batch_size=4, sampler=torch.utils.data.RandomSampler(range(4)))


def test_the_drop_ins_evaluate_on_every_rank_and_take_the_scripts_seed(data_dir, monkeypatch):
    # 10 validation samples, batch 3, 3 ranks: after 9 rows the 10th goes to rank 0 and ranks 1 and 2 get filler
    # only; dropping it would leave them an empty last batch, which the scripts' metrics divide by. The filler is
    # kept, as their samplers keep it. timm's create_dataset(seed=...) is the loader's seed.
    from dali_pipes.dropin.timm_train import create_dataset, create_loader
    from dali_pipes.dropin.torchvision_reference import DataLoader, load_data

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    dataset = create_dataset("", root=data_dir, split="validation", is_training=False, seed=7)
    with create_loader(dataset, input_size=32, batch_size=3, crop_pct=0.9, interpolation="bilinear") as loader:
        assert loader.world.rank == 2 and loader.seed == 7
        assert [len(label) for _, label in loader] == [3, 1]
    _, dataset_test, _, test_sampler = load_data(
        str(data_dir / "train"), str(data_dir / "val"), _reference_args(data_dir)
    )
    with DataLoader(dataset_test, batch_size=3, sampler=test_sampler, num_workers=2, pin_memory=True) as loader:
        assert [len(label) for _, label in loader] == [3, 1]
    with pytest.raises(TypeError, match="unexpected keyword argument.*bogus"):
        DataLoader(dataset_test, batch_size=4, bogus=1)
    with pytest.raises(ValueError, match="mutually exclusive with shuffle"):
        DataLoader(dataset_test, batch_size=4, sampler=test_sampler, shuffle=True)
