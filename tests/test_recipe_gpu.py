"""The training recipe on the GPU: resolution schedules, MixUp/CutMix and RandomErasing with GPU operators.

Skipped cleanly where DALI sees no CUDA device. The same comparisons as the CPU
tests (``test_mix.py``, ``test_erasing.py``, ``test_resolution_schedule.py``):
timm's ``Mixup`` and ``RandomErasing`` applied to the GPU loader's own unmixed
batches, given the same draws, must give what the GPU graph gives.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from recipe_helpers import CLASSES, epoch_batches, timm_module, write_photo_dataset

from dali_pipes import ClassificationTrain, DALILoader, Mix, RandomErasing, RunOptions
from dali_pipes.pipelines.batch_inputs import ERASE_STREAM, MIX_STREAM, batch_seed

from pipeline_helpers import DALI_GPU_MARKS

pytestmark = DALI_GPU_MARKS

SIZE = 64
SEED = 3


@pytest.fixture(scope="module")
def photos_dataset(tmp_path_factory, imagenet_mini):
    from conftest import write_dataset

    return write_photo_dataset(write_dataset.__wrapped__(), tmp_path_factory.mktemp("gpu") / "ds", imagenet_mini)


def gpu_batches(path, spec, epoch=0):
    return epoch_batches(path, spec, epoch, run=RunOptions(device="gpu", py_num_workers=1))


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_mix_on_the_gpu_equals_timms_mixup(photos_dataset, mode):
    mix = Mix(mixup_alpha=0.8, cutmix_alpha=1.0, mode=mode)
    timm_mix = timm_module("mixup").Mixup(
        mixup_alpha=0.8, cutmix_alpha=1.0, mode=mode, label_smoothing=0.1, num_classes=len(CLASSES)
    )
    for epoch in (0, 1):
        plain = gpu_batches(photos_dataset, ClassificationTrain(size=SIZE), epoch)
        mixed = gpu_batches(photos_dataset, ClassificationTrain(size=SIZE, mix=mix), epoch)
        for number, (ours, before) in enumerate(zip(mixed, plain)):
            np.random.seed(batch_seed(SEED, 0, epoch, number, MIX_STREAM))
            images, targets = timm_mix(before["image"].clone(), before["label"].clone())
            torch.testing.assert_close(ours["image"], images, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ours["label"], targets, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["const", "rand", "pixel"])
def test_erasing_on_the_gpu_erases_timms_boxes(photos_dataset, mode):
    erasing = RandomErasing(prob=1.0, mode=mode, max_count=2)
    reference = timm_module("random_erasing").RandomErasing(probability=1.0, mode="const", max_count=2, device="cpu")
    plain = gpu_batches(photos_dataset, ClassificationTrain(size=SIZE))
    ours = gpu_batches(photos_dataset, ClassificationTrain(size=SIZE, erasing=erasing))
    for number, (mine, before) in enumerate(zip(ours, plain)):
        random.seed(batch_seed(SEED, 0, 0, number, ERASE_STREAM))
        const = reference(before["image"].clone())
        if mode == "const":
            assert torch.equal(mine["image"], const)
            continue
        random.seed(batch_seed(SEED, 0, 0, number, ERASE_STREAM))
        mask = reference(torch.ones_like(before["image"])) == 0
        assert torch.equal(mine["image"][~mask], before["image"][~mask])
        assert not torch.equal(mine["image"][mask], before["image"][mask])


def test_schedule_on_the_gpu_changes_the_size_without_a_new_pipeline(photos_dataset):
    spec = ClassificationTrain(size=(64, 128, 0, 2), mix=Mix(), erasing=RandomErasing(), dtype="float16")
    with DALILoader(photos_dataset, spec, batch_size=4, run=RunOptions(device="gpu", py_num_workers=1)) as loader:
        pids = loader.worker_pids  # a new pipeline would start new reader processes
        assert len(pids) == 1
        for epoch, side in ((0, 64), (1, 96), (2, 128)):
            loader.set_epoch(epoch)
            for batch in loader:
                assert batch["image"].is_cuda and batch["label"].is_cuda
                assert batch["image"].shape == (4, 3, side, side) and batch["image"].dtype == torch.float16
                assert batch["label"].shape == (4, len(CLASSES))
            assert loader.worker_pids == pids
