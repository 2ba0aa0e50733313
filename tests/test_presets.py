"""The spec presets of torchvision's reference script and timm's train.py: their flags' meaning, and they run."""

from __future__ import annotations

import pytest
import torch
from recipe_helpers import write_photo_dataset

from dali_pipes import DALILoader, RunOptions
from dali_pipes.pipelines.config import ColorJitter
from dali_pipes.pipelines.presets import timm_defaults, torchvision_reference


def test_torchvision_reference_flags():
    train, val = torchvision_reference()
    assert (
        train.jitter is None and train.flip == 0.5 and train.scale == (0.08, 1.0) and train.interpolation == "bilinear"
    )
    assert train.auto_augment is None and train.erasing is None
    assert (val.resize, val.size, val.interpolation) == (256, 224, "bilinear")
    train, val = torchvision_reference(
        train_crop_size=176, val_resize_size=232, interpolation="bicubic", auto_augment="ta_wide", random_erase=0.1
    )
    assert train.size == 176 and train.auto_augment == "trivial_augment" and train.interpolation == "bicubic"
    assert train.erasing.prob == 0.1 and train.erasing.mode == "const" and (val.resize, val.size) == (232, 224)
    with pytest.raises(ValueError, match="--auto-augment augmix.*not available"):
        torchvision_reference(auto_augment="augmix")


def test_timm_defaults_flags():
    train, val = timm_defaults()
    assert train.jitter == ColorJitter(0.4, 0.4, 0.4, 0.0)  # timm's colour jitter shifts no hue
    assert train.interpolation == "random" and train.erasing is None
    assert (val.resize, val.size, val.interpolation) == (256, 224, "bicubic")  # floor(224 / 0.875)
    train, val = timm_defaults(input_size=288, crop_pct=0.95, color_jitter=0.0, reprob=0.25, hflip=0.0)
    assert train.jitter is None and train.flip == 0.0 and train.erasing.prob == 0.25 and train.erasing.mode == "pixel"
    assert (val.resize, val.size) == (303, 288)
    with pytest.raises(ValueError, match="crop-pct"):
        timm_defaults(crop_pct=1.5)


def test_every_interpolation_runs_and_bicubic_differs_from_bilinear(tmp_path, write_dataset, imagenet_mini):
    dataset = write_photo_dataset(write_dataset, tmp_path, imagenet_mini, count=8)
    images = {}
    for name in ("bilinear", "bicubic"):
        _, val = torchvision_reference(val_resize_size=24, val_crop_size=16, interpolation=name)
        with DALILoader(dataset, val, batch_size=8, run=RunOptions(device="cpu")) as loader:
            images[name] = next(iter(loader))["image"]
    assert images["bilinear"].shape == images["bicubic"].shape == (8, 3, 16, 16)
    assert not torch.equal(images["bilinear"], images["bicubic"])
    train, _ = timm_defaults(input_size=16)  # "random": a filter drawn per image
    with DALILoader(dataset, train, batch_size=8, run=RunOptions(device="cpu")) as loader:
        assert next(iter(loader))["image"].shape == (8, 3, 16, 16)
