"""The feature-array (HDF5 + virtual merge) and Lightning examples run as written, on tiny data, on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_show import converted_imagefolder

CLI = (sys.executable, "-m", "dali_pipes")  # the CLI wherever the package imports, no script needed
LIGHTNING = (sys.executable, "-m", "dali_pipes.examples.lightning_module")
#: One epoch on the CPU, images of 32 px, the training process reading (no reader process).
LIGHTNING_FLAGS = ("--max-epochs", "1", "--size", "32", "--device", "cpu", "--workers", "0")
NEEDS_LIGHTNING = 'Lightning is an optional extra: pip install "dali-pipes[lightning]"'
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _run(*args, cwd: Path) -> str:
    proc = subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd, env=ENV)
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_feature_recipe_through_the_cli_and_a_virtual_merge(tmp_path):
    n, classes = 70, 3
    rng = np.random.default_rng(0)
    label = rng.integers(0, classes, n)
    # Separable clusters, stored as float16 as a feature cache often is: the model must learn them.
    emb = (rng.standard_normal((n, 16)) + 2.0 * label[:, None]).astype(np.float16)
    np.save(tmp_path / "emb.npy", emb)
    np.save(tmp_path / "label.npy", label.astype(np.int64))

    _run(
        *CLI,
        "convert",
        "arrays",
        "emb.npy",
        "label.npy",
        "shards",
        "--format",
        "hdf5",
        "--samples-per-shard",
        "30",
        "--workers",
        "1",
        "--no-progress",
        cwd=tmp_path,
    )
    _run(*CLI, "merge", "shards", "merged.h5", "--virtual", cwd=tmp_path)
    with h5py.File(tmp_path / "merged.h5", "r") as f:
        assert f["emb"].is_virtual  # the features were not copied

    out = _run(
        sys.executable,
        "-m",
        "dali_pipes.examples.train_features",
        "merged.h5",
        "--input",
        "emb",
        "--target",
        "label",
        "--epochs",
        "3",
        "--batch-size",
        "16",
        "--workers",
        "0",
        cwd=tmp_path,
    )
    epochs = re.findall(r"^epoch (\d+): (\d+) samples, loss ([\d.]+)", out, re.M)
    assert [(int(e), int(s)) for e, s, _ in epochs] == [(0, n), (1, n), (2, n)], out
    losses = [float(loss) for _, _, loss in epochs]
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    pytest.importorskip("lightning", reason=NEEDS_LIGHTNING)
    return converted_imagefolder(tmp_path_factory.mktemp("lightning"), 50, seed=3)


def test_lightning_example_trains_one_step_per_loader_batch(images, tmp_path):
    from dali_pipes import ClassificationTrain, DALILoader, RunOptions

    batch = 8
    with DALILoader(
        images, ClassificationTrain(size=32), batch_size=batch, run=RunOptions(device="cpu", py_num_workers=0)
    ) as loader:
        expected = len(loader)
    assert expected == 7  # 50 samples, the last batch padded

    out = _run(*LIGHTNING, images, *LIGHTNING_FLAGS, "--batch-size", str(batch), cwd=tmp_path)
    found = re.search(r"^trained (\d+) steps over (\d+) epoch\(s\); metrics (.*)$", out, re.M)
    assert found, out
    assert (int(found[1]), int(found[2])) == (expected, 1), out
    assert "val_loss" in found[3], out  # the validation loader ran too


def test_lightning_ddp_splits_each_epoch_between_the_processes(images, tmp_path):
    # Two CPU processes (gloo), started by Lightning itself: each reads its half of every global batch of 16.
    out = _run(*LIGHTNING, images, *LIGHTNING_FLAGS, "--devices", "2", "--batch-size", "8", cwd=tmp_path)
    found = re.search(r"^trained (\d+) steps over (\d+) epoch", out, re.M)
    assert found and (int(found[1]), int(found[2])) == (4, 1), out  # ceil(50 / (8 * 2)), not the 7 of one process


def test_epoch_loader_forwards_a_new_epoch_only(images):
    from dali_pipes import BatchFormat, ClassificationVal, DALILoader, RunOptions
    from dali_pipes.examples.lightning_module import EpochLoader

    with DALILoader(
        images, ClassificationVal(size=32, resize=36), batch_size=8, batch_format=BatchFormat(with_index=True),
        run=RunOptions(device="cpu", py_num_workers=0),
    ) as loader:  # fmt: skip
        wrapped = EpochLoader(loader)
        assert len(wrapped) == 7
        wrapped.sampler.set_epoch(2)  # what Lightning calls on the sampler each epoch
        assert loader.epoch == 2
        wrapped.set_epoch(3)
        assert loader.epoch == 3
        it = iter(wrapped)
        next(it)
        wrapped.set_epoch(3)  # Lightning's call after the pass began: must not restart the epoch
        assert loader.state_dict()["samples_consumed"] == 8
