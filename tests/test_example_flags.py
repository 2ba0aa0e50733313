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
#: Each case is a process of its own (a few seconds): a few of each kind run in the default suite, the rest with -m slow.
SLOW = pytest.mark.slow
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
        marks=SLOW,
    ),
    pytest.param("train_imagenet", ["missing"], ["DATASET: missing: no such folder"], id="wrong-path"),
    pytest.param(
        "train_imagenet", ["three", "--mix-with", "gone"], ["--mix-with: gone"], id="wrong-mix-path", marks=SLOW
    ),
    pytest.param(
        "train_imagenet", ["images-three"], ["DATASET: images-three: no index.json"], id="not-converted", marks=SLOW
    ),
    pytest.param(
        "train_imagenet", ["coco"], ["DATASET coco has no 'label' field", "train_detection"], id="coco", marks=SLOW
    ),
    pytest.param(
        "train_imagenet",
        ["three", "--batch-size", "21", "--size", "32"],
        ["--batch-size 21 is more than the 20 samples of an epoch; use --batch-size 20 or less"],
        id="batch-over-dataset",
        marks=SLOW,
    ),
    pytest.param(
        "train_imagenet",
        ["three", "--checkpoint", "not-a-folder.pt", "--resume", "--size", "32", "--batch-size", "8"],
        ["--checkpoint not-a-folder.pt is not a checkpoint this run can resume"],
        id="not-a-checkpoint",
        marks=SLOW,
    ),
    pytest.param("train_detection", ["three"], ["DATASET three has no 'boxes' field", "convert coco"], id="det-kind"),
    pytest.param(
        "train_detection",
        ["coco", "--batch-size", "62", "--size", "64", "--max-size", "96", "--workers", "0"],
        ["--batch-size 62 is more than the 61 samples of an epoch"],
        id="det-batch",
        marks=SLOW,
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
        marks=SLOW,
    ),
    pytest.param(
        "train_features",
        ["feats", "--num-classes", "2", "--batch-size", "8", "--workers", "0"],
        ["--target label holds class 2, outside 0..1; give --num-classes 3 or more"],
        id="feat-classes",
        marks=SLOW,
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
        marks=SLOW,
    ),
    pytest.param(
        "lightning_module",
        ["three", "--devices", "none", "--batch-size", "8", "--workers", "0"],
        ["--devices none:"],
        id="lightning-devices",
        marks=SLOW,
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


@pytest.mark.timeout(300)
def test_what_the_loader_would_refuse_is_checked_before_it_is_built(data, tmp_path, write_dataset, photo_bytes):
    """Mistakes the library refuses with a plain ValueError, which the scripts do not catch: checked first."""
    from dali_pipes.dataset.manifest import Field

    def dataset(name, label_dtype, classes):
        samples = [
            {"image": photo_bytes[i % len(photo_bytes)], "label": np.array(i % len(classes), label_dtype)}
            for i in range(12)
        ]
        fields = {"image": Field.image(), "label": Field.array(label_dtype, ())}
        return write_dataset(tmp_path / name, "lmdb", fields, samples, classes=list(classes))

    other = dataset("int32-labels", "int32", ("class_000", "class_001", "class_002"))
    line = refused("train_imagenet", "three", "--mix-with", other, cwd=data, alone=True)
    assert "field 'label' is" in line and f"in --mix-with {other}: mix datasets converted alike" in line, line
    one = dataset("one-class", "int64", ("only",))
    line = refused("train_imagenet", one, "--mixup", "0.8", cwd=data, alone=True)
    assert f"--mixup and --cutmix blend the targets of the dataset's classes, and {one} names 1 class" in line, line
    line = refused("train_imagenet", "three", "--seed", "-1", cwd=data)
    assert "argument --seed: must be a whole number >= 0, got -1" in line, line


#: Flags wrong on their own, or together: argparse's usage error, naming the flag.
FLAG_MISTAKES = [
    ("train_imagenet", ["three", "--size", "0"], "argument --size: must be a whole number >= 1, got 0"),
    pytest.param("train_imagenet", ["three", "--mixup", "-1"], "argument --mixup: must be a number >= 0", marks=SLOW),
    pytest.param(
        "train_imagenet",
        ["three", "--erasing", "2"],
        "argument --erasing: must be a probability between 0 and 1",
        marks=SLOW,
    ),
    pytest.param("train_imagenet", ["three", "--resume"], "--resume continues from --checkpoint FILE", marks=SLOW),
    pytest.param(
        "train_imagenet", ["three", "--mix-labels", "offset"], "--mix-labels offset is for a mixture", marks=SLOW
    ),
    pytest.param("train_imagenet", ["three", "--checkpoint", "nowhere/ckpt.pt"], "there is no folder", marks=SLOW),
    ("train_detection", ["coco", "--size", "64", "--max-size", "32"], "--max-size 32 is below --size 64"),
    pytest.param(
        "train_detection", ["coco", "--workers", "-1"], "argument --workers: must be a whole number >= 0", marks=SLOW
    ),
    pytest.param("train_features", ["feats", "--input", "label"], "--input and --target are both 'label'", marks=SLOW),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example, args, words", FLAG_MISTAKES)
def test_a_wrong_flag_is_argparses_usage_error(data, example, args, words):
    assert words in refused(example, *args, cwd=data)


def test_gpu_without_cuda_names_the_device_flag(data):
    # The script runs with every GPU hidden (ENV), so this holds on a machine with CUDA too.
    line = refused("train_detection", "coco", "--device", "gpu", cwd=data)
    assert "--device gpu: CUDA is not available here; use --device auto" in line


@pytest.mark.parametrize("example", [EXAMPLES[0], *(pytest.param(e, marks=SLOW) for e in EXAMPLES[1:])])
def test_the_help_is_plain_text(example, tmp_path):
    if example == "lightning_module":
        pytest.importorskip("lightning", reason='Lightning is an optional extra: pip install "dali-pipes[lightning]"')
    proc = _run(example, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    description = proc.stdout.split("\n\n")[1]  # after the usage lines
    assert description.strip() and not re.search(r"``|:(class|mod|func|meth):|`", description), description


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One epoch of train_imagenet on ``three`` in a single batch of 20, and the checkpoint it saved (read only)."""
    checkpoint = tmp_path_factory.mktemp("trained") / "ckpt.pt"
    proc = _run("train_imagenet", "three", "--size", "32", "--batch-size", "20", "--checkpoint", checkpoint, cwd=data)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, checkpoint


def test_a_count_of_one_is_singular(trained):
    proc, _ = trained
    assert "rank 0 of 1: 1 batch of 20 per epoch on cpu" in proc.stdout, proc.stdout
    assert re.search(r"^epoch 0: 20 samples, .* on 1 process$", proc.stdout, re.M), proc.stdout


# --- a bug is not a usage error: it keeps its traceback and exits 1, not 2 --------------------------------------

#: Imported first by a script run with :func:`_run_with_bug` (it is on PYTHONPATH): replaces the function named by
#: $EXAMPLE_BUG (``module:Qual.name=Error``) with one raising ``Error`` from inside the library, as a bug would.
#: ``=dali`` makes DALI's own Python-side check raise (``fn.stack()`` without inputs: a ValueError of nvidia.dali).
SITECUSTOMIZE = """
import importlib, os

_target, _, _error = os.environ["EXAMPLE_BUG"].rpartition("=")
_module, _, _qualname = _target.partition(":")
_owner = importlib.import_module(_module)
*_path, _name = _qualname.split(".")
for _part in _path:
    _owner = getattr(_owner, _part)


def _bug(*args, **kwargs):
    if _error == "dali":
        from nvidia.dali import fn

        fn.stack()  # no inputs: DALI refuses the graph with a ValueError of its own
    where, _, name = _error.rpartition(".")
    raise getattr(importlib.import_module(where or "builtins"), name)(f"simulated bug in {_target}")


setattr(_owner, _name, _bug)
"""


def _run_with_bug(example: str, bug: str, *args, cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), ENV.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", f"dali_pipes.examples.{example}", *map(str, args)]
    env = {**ENV, "PYTHONPATH": path, "EXAMPLE_BUG": bug}
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=cwd)


def crashed(proc: subprocess.CompletedProcess, error: str, *where: str) -> None:
    """The run ended with the traceback of ``error`` (raised ``where``), not with a one-line usage error."""
    shown = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 2), shown
    assert "Traceback (most recent call last)" in proc.stderr, shown
    assert not [line for line in proc.stderr.splitlines() if ": error: " in line], shown
    assert re.search(rf"^{error}: ", proc.stderr, re.M), shown
    for place in where:
        assert place in proc.stderr, shown


@pytest.fixture
def checkpoint(trained) -> Path:
    """The checkpoint of :func:`trained` (its one epoch in batches of 20); runs resuming it crash or are refused."""
    return trained[1]


def test_a_plain_error_inside_user_errors_is_not_a_usage_error():
    from dali_pipes import ManifestError, StoreError
    from dali_pipes.examples.usage import UsageError, user_errors

    for bug in (ValueError("a graph bug"), TypeError("a bug"), RuntimeError("a bug"), FileNotFoundError("a bug")):
        with pytest.raises(type(bug)):
            with user_errors():
                raise bug
    for refusal in (UsageError("DATASET: x"), ManifestError("x: no index.json"), StoreError("x: truncated")):
        with pytest.raises(SystemExit) as exit_:
            with user_errors():
                raise refusal
        assert exit_.value.code == 2


#: (script, its arguments, the function made to fail, the error): a bug while the loader is built.
BUGS = [
    pytest.param(
        "train_imagenet",
        ["three", "--size", "32", "--batch-size", "8"],
        "dali_pipes.pipelines.classification:ClassificationTrain.build=dali",
        ["nvidia/dali"],
        id="dali-refuses-the-graph",
    ),
    pytest.param(
        "train_detection",
        ["coco", "--size", "64", "--max-size", "96", "--workers", "0"],
        "dali_pipes.pipelines.detection:Detection.build=FileNotFoundError",
        [],
        id="detection-graph",
        marks=SLOW,
    ),
    pytest.param(
        "train_features",
        ["feats", "--batch-size", "8", "--workers", "0"],
        "dali_pipes.pipelines.features:Features.bind=ValueError",
        [],
        id="features-source",
        marks=SLOW,
    ),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example, args, bug, where", BUGS)
def test_a_bug_while_the_loader_is_built_keeps_its_traceback(data, tmp_path, example, args, bug, where):
    proc = _run_with_bug(example, bug, *args, cwd=data, tmp_path=tmp_path)
    crashed(proc, bug.rpartition("=")[2] if not bug.endswith("=dali") else "ValueError", *where)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "bug",
    [
        "dali_pipes.loading.epoch_size:EpochSizes.restore=ValueError",
        pytest.param("dali_pipes.loading.loader:DALILoader.load_state_dict=RuntimeError", marks=SLOW),
    ],
    ids=["value-error", "runtime-error"],
)
def test_a_bug_of_the_loaders_restore_is_not_blamed_on_the_checkpoint(data, checkpoint, tmp_path, bug):
    args = ("three", "--size", "32", "--batch-size", "20", "--epochs", "2", "--checkpoint", checkpoint, "--resume")
    proc = _run_with_bug("train_imagenet", bug, *args, cwd=data, tmp_path=tmp_path)
    crashed(proc, bug.rpartition("=")[2], "simulated bug in")


@SLOW
@pytest.mark.timeout(300)
def test_a_checkpoint_of_another_dataset_or_model_is_one_line(data, checkpoint):
    import torch

    state = torch.load(checkpoint, weights_only=True)
    torch.save({**state, "loader": {**state["loader"], "num_samples": 999}}, checkpoint.with_name("other-data.pt"))
    model = dict(state["model"])
    model.pop(next(iter(model)))
    torch.save({**state, "model": model}, checkpoint.with_name("other-model.pt"))
    torch.save(state["model"], checkpoint.with_name("weights-only.pt"))
    for name, words in (
        ("other-data.pt", "it was saved reading another dataset: ValueError: "),
        ("other-model.pt", "it was saved from another model (another class count?): RuntimeError: "),
        ("weights-only.pt", "it holds keys "),
    ):
        path = checkpoint.with_name(name)
        args = ("three", "--size", "32", "--batch-size", "20", "--epochs", "2", "--checkpoint", path, "--resume")
        line = refused("train_imagenet", *args, cwd=data, alone=True)
        assert f"--checkpoint {path} is not a checkpoint this run can resume: {words}" in line, line


@SLOW
@pytest.mark.timeout(300)
def test_lightning_blames_devices_only_when_they_were_given(data, tmp_path):
    pytest.importorskip("lightning", reason='Lightning is an optional extra: pip install "dali-pipes[lightning]"')
    trainer = "lightning.pytorch.trainer.trainer:Trainer.__init__"
    args = ("three", "--batch-size", "8", "--workers", "0")
    crashed(
        _run_with_bug("lightning_module", f"{trainer}=ValueError", *args, cwd=data, tmp_path=tmp_path), "ValueError"
    )
    misconfigured = f"{trainer}=lightning.fabric.utilities.exceptions.MisconfigurationException"
    proc = _run_with_bug("lightning_module", misconfigured, *args, cwd=data, tmp_path=tmp_path)
    shown = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in shown, shown
    assert "error: MisconfigurationException: simulated bug" in proc.stderr and "--devices" not in proc.stderr, shown
