"""The ImageNet-style DDP example trains under torchrun on CPU (gloo), and resumes from its checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from converters.runner import convert
from converters.sources import ImageFolderSource
from converters.synth import make_imagefolder

NUM_IMAGES = 50


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("example")
    images = make_imagefolder(root / "images", NUM_IMAGES, size=(96, 72), classes=3, seed=1)
    convert(ImageFolderSource(images), root / "shards", format="lmdb", workers=1, progress=False)
    return root / "shards"


def _torchrun(*args: str) -> str:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "dali_pipes.examples.train_imagenet", *args],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(600)
def test_ddp_example_trains_every_sample_once_per_epoch_and_resumes(tiny_dataset, tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    common = [str(tiny_dataset), "--batch-size", "8", "--size", "32", "--checkpoint", str(checkpoint)]
    out = _torchrun(*common, "--epochs", "2")
    epochs = re.findall(r"^epoch (\d+): (\d+) samples, loss ([\d.]+)", out, re.M)
    assert [(e, int(n)) for e, n, _ in epochs] == [("0", NUM_IMAGES), ("1", NUM_IMAGES)], out
    assert all(float(loss) > 0 for _, _, loss in epochs)
    assert checkpoint.exists()

    resumed = _torchrun(*common, "--epochs", "3", "--resume")
    assert re.findall(r"^epoch (\d+): (\d+) samples", resumed, re.M) == [("2", str(NUM_IMAGES))], resumed
