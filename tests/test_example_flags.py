"""The example scripts answer a mistake in their flags or data with one line naming the flag, and exit 2.

Each case runs the script as a user does (``python -m dali_pipes.examples.NAME ...``) and
checks: exit status 2 (argparse's usage error), no traceback, exactly one ``error:`` line,
and the words a user needs (the flag to use; never the library's Python argument).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from converters.runner import convert
from converters.sources import ArraysSource, CocoSource, ImageFolderSource
from converters.synth import make_imagefolder

ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
EXAMPLES = ("train_imagenet", "train_detection", "train_instance_segmentation", "train_features", "lightning_module")


@pytest.fixture(scope="module")
def data(tmp_path_factory, coco_mini) -> Path:
    """Small datasets of each kind, side by side: ``three`` and ``two`` (other class lists), ``coco``, ``feats``."""
    root = tmp_path_factory.mktemp("flags")
    three = make_imagefolder(root / "images-three", 20, size=(64, 48), classes=3, seed=1, workers=1)
    convert(ImageFolderSource(three), root / "three", format="lmdb", workers=1, progress=False)
    for name in ("cat", "dog"):  # other class names than make_imagefolder's class_000...
        (root / "images-two" / name).mkdir(parents=True)
    for i, photo in enumerate(sorted(three.glob("*/*.jpg"))[:10]):
        (root / "images-two" / ("cat", "dog")[i % 2] / photo.name).write_bytes(photo.read_bytes())
    convert(ImageFolderSource(root / "images-two"), root / "two", format="lmdb", workers=1, progress=False)
    coco = CocoSource(coco_mini / "images", coco_mini / "instances.json")
    convert(coco, root / "coco", format="lmdb", workers=1, progress=False)
    rng = np.random.default_rng(0)
    np.save(root / "emb.npy", rng.standard_normal((30, 8)).astype(np.float32))
    np.save(root / "label.npy", np.arange(30) % 3)
    convert(
        ArraysSource([root / "emb.npy", root / "label.npy"]), root / "feats", format="hdf5", workers=1, progress=False
    )
    (root / "not-a-folder.pt").write_text("not a checkpoint")
    return root


def _run(example: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", f"dali_pipes.examples.{example}", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=ENV, cwd=cwd)


def refused(example: str, *args, cwd: Path, alone: bool = False) -> str:
    """Run a script that must refuse its flags; its one error line (``alone``: the only line it printed)."""
    proc = _run(example, *args, cwd=cwd)
    shown = proc.stdout + proc.stderr
    assert proc.returncode == 2, shown
    assert "Traceback" not in shown, shown
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, shown
    if alone:  # argparse prints its usage above a malformed flag's error; a mistake in the data needs none
        assert proc.stderr.strip() == errors[0] and not proc.stdout.strip(), shown
    return errors[0]


#: (script, its arguments, words its one error line must hold): a mistake with the data the flags name.
DATA_MISTAKES = [
    pytest.param(
        "train_imagenet",
        ["three", "--mix-with", "two"],
        [
            "three and --mix-with two have different class lists (class 0 is 'class_000' in three but 'cat' in two)",
            "add --mix-labels offset",
        ],
        id="mixture-of-other-classes",
    ),
    pytest.param(
        "train_imagenet",
        ["three", "--mix-with", "two", "--mix-labels", "keep"],
        ["--mix-labels keep would train on wrong labels", "--mix-labels offset"],
        id="mixture-kept-wrongly",
    ),
    pytest.param("train_imagenet", ["missing"], ["DATASET: missing: no such folder"], id="wrong-path"),
    pytest.param("train_imagenet", ["three", "--mix-with", "gone"], ["--mix-with: gone"], id="wrong-mix-path"),
    pytest.param("train_imagenet", ["images-three"], ["DATASET: images-three: no index.json"], id="not-converted"),
    pytest.param("train_imagenet", ["coco"], ["DATASET coco has no 'label' field", "train_detection"], id="coco"),
    pytest.param(
        "train_imagenet",
        ["three", "--batch-size", "21", "--size", "32"],
        ["--batch-size 21 is more than the 20 samples of an epoch; use --batch-size 20 or less"],
        id="batch-over-dataset",
    ),
    pytest.param(
        "train_imagenet",
        ["three", "--checkpoint", "not-a-folder.pt", "--resume", "--size", "32", "--batch-size", "8"],
        ["--checkpoint not-a-folder.pt is not a checkpoint this run can resume"],
        id="not-a-checkpoint",
    ),
    pytest.param("train_detection", ["three"], ["DATASET three has no 'boxes' field", "convert coco"], id="det-kind"),
    pytest.param(
        "train_detection",
        ["coco", "--batch-size", "62", "--size", "64", "--max-size", "96", "--workers", "0"],
        ["--batch-size 62 is more than the 61 samples of an epoch"],
        id="det-batch",
    ),
    pytest.param(
        "train_instance_segmentation", ["coco"], ["DATASET coco has no 'masks' field", "--masks"], id="seg-no-masks"
    ),
    pytest.param(
        "train_features", ["feats", "--input", "nope"], ["--input nope: the dataset has no such field"], id="feat-input"
    ),
    pytest.param(
        "train_features",
        ["three", "--input", "image"],
        ["--input image is not a fixed-shape numeric array"],
        id="feat-image",
    ),
    pytest.param(
        "train_features",
        ["feats", "--num-classes", "2", "--batch-size", "8", "--workers", "0"],
        ["--target label holds class 2, outside 0..1; give --num-classes 3 or more"],
        id="feat-classes",
    ),
    pytest.param(
        "lightning_module",
        ["three", "--val-dataset", "two", "--batch-size", "8"],
        ["--val-dataset two has another class list than three (class 0 is 'class_000' in three but"],
        id="lightning-val",
    ),
    pytest.param(
        "lightning_module",
        ["three", "--batch-size", "64"],
        ["--batch-size 64 is more than the 20 samples of DATASET three; use --batch-size 20 or less"],
        id="lightning-batch",
    ),
    pytest.param(
        "lightning_module",
        ["three", "--devices", "none", "--batch-size", "8", "--workers", "0"],
        ["--devices none:"],
        id="lightning-devices",
    ),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("example, args, words", DATA_MISTAKES)
def test_a_mistake_in_the_data_is_one_line_naming_the_flag(data, example, args, words):
    if example == "lightning_module":
        pytest.importorskip("lightning", reason='Lightning is an optional extra: pip install "dali-pipes[lightning]"')
    line = refused(example, *args, cwd=data, alone=True)
    for word in words:
        assert word in line, line
    assert "labels='" not in line and "Mixture(" not in line, line  # the library's Python words, not the flags'


#: Flags wrong on their own, or together: argparse's usage error, naming the flag.
FLAG_MISTAKES = [
    ("train_imagenet", ["three", "--size", "0"], "argument --size: must be a whole number >= 1, got 0"),
    ("train_imagenet", ["three", "--mixup", "-1"], "argument --mixup: must be a number >= 0"),
    ("train_imagenet", ["three", "--erasing", "2"], "argument --erasing: must be a probability between 0 and 1"),
    ("train_imagenet", ["three", "--resume"], "--resume continues from --checkpoint FILE"),
    ("train_imagenet", ["three", "--mix-labels", "offset"], "--mix-labels offset is for a mixture"),
    ("train_imagenet", ["three", "--checkpoint", "nowhere/ckpt.pt"], "there is no folder"),
    ("train_detection", ["coco", "--size", "64", "--max-size", "32"], "--max-size 32 is below --size 64"),
    ("train_detection", ["coco", "--workers", "-1"], "argument --workers: must be a whole number >= 0"),
    ("train_features", ["feats", "--input", "label"], "--input and --target are both 'label'"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example, args, words", FLAG_MISTAKES)
def test_a_wrong_flag_is_argparses_usage_error(data, example, args, words):
    assert words in refused(example, *args, cwd=data)


def test_gpu_without_cuda_names_the_device_flag(data):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device gpu is no mistake")
    line = refused("train_detection", "coco", "--device", "gpu", cwd=data)
    assert "--device gpu: CUDA is not available here; use --device auto" in line


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_help_is_plain_text(example, tmp_path):
    if example == "lightning_module":
        pytest.importorskip("lightning", reason='Lightning is an optional extra: pip install "dali-pipes[lightning]"')
    proc = _run(example, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    description = proc.stdout.split("\n\n")[1]  # after the usage lines
    assert description.strip() and not re.search(r"``|:(class|mod|func|meth):|`", description), description


def test_a_count_of_one_is_singular(data):
    proc = _run("train_imagenet", "three", "--batch-size", "20", "--size", "32", cwd=data)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 1: 1 batch of 20 per epoch on cpu" in proc.stdout, proc.stdout
    assert re.search(r"^epoch 0: 20 samples, .* on 1 process$", proc.stdout, re.M), proc.stdout
