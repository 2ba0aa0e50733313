"""``dali-pipes selftest``: the real command on this machine, a real failure, and checks that catch bad outputs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dali_pipes.pipelines import ClassificationTrain
from dali_pipes.selftest.data import make_sample_data
from dali_pipes.selftest.runner import SPEC_NAMES, _run_one, check_batches

from loader_helpers import write_dataset

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_sample_data(tmp_path_factory.mktemp("selftest"))


@pytest.mark.timeout(300)
def test_the_command_passes_here_and_lists_every_spec_and_device(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "dali_pipes", "selftest", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert report["lines"] == proc.stdout.strip().splitlines()  # the JSON holds every line printed
    assert report["lines"][-1] == "selftest passed"
    assert report["versions"]["dali"] and report["versions"]["torch"] == torch.__version__
    rows = {(r["spec"], r["device"], r["workers"]): r for r in report["rows"]}
    for spec in SPEC_NAMES:
        for workers in (0, 1):
            row = rows[(spec, "cpu", workers)]
            assert row["status"] == "ok" and row["images_per_s"] > 0, row
        if CUDA:
            assert all(rows[(spec, "gpu", w)]["status"] == "ok" for w in (0, 1))
        else:
            assert rows[(spec, "gpu", None)]["status"] == "skipped"
            assert rows[(spec, "gpu", None)]["message"] == "skipped: no CUDA"


@pytest.mark.skipif(CUDA, reason="checks the answer of a machine without CUDA")
def test_asking_for_the_gpu_without_cuda_fails_saying_so(capsys):
    # The command's main in this process (the test above runs the console command): it stops before any pipeline.
    from dali_pipes.cli import main

    assert main(["selftest", "--device", "gpu"]) == 1
    out = capsys.readouterr().out
    assert "FAILED  classification-train  gpu  workers=-  at device: no CUDA" in out
    assert out.strip().endswith(f"selftest FAILED: {len(SPEC_NAMES)} of {len(SPEC_NAMES)} rows")


@pytest.mark.timeout(120)
def test_a_failure_names_the_spec_device_step_and_dali_message(tmp_path, data):
    # A dataset with an image DALI cannot decode, in place of the classification set.
    broken = write_dataset(tmp_path / "broken", 10, samples_per_shard=5, corrupt=frozenset({3}))
    row = _run_one("classification-train", "cpu", 0, dataclasses.replace(data, classification=broken))
    assert (row.status, row.step) == ("failed", "epoch 1")
    assert "sample 3" in row.message and "cannot be decoded" in row.message
    assert row.line.startswith("FAILED  classification-train  cpu  workers=0  at epoch 1: LoaderError: ")


def _batch(index, pad, image, label):
    return {"index": np.array(index), "is_pad": np.array(pad), "image": image, "label": np.array(label)}


def test_the_checks_catch_wrong_outputs(data):
    spec = ClassificationTrain(size=4)
    rng = np.random.default_rng(0)
    good = rng.uniform(-1.5, 1.5, (2, 3, 4, 4)).astype(np.float32)

    def check(*batches, device="cpu", on="cpu", n=3):
        batches = [b | {"_device": {k: on for k in b}} for b in batches]
        return check_batches("classification-train", device, batches, n, data, spec)

    first = _batch([0, 1], [False, False], good, [0, 2])
    assert check(first, _batch([2, 0], [False, True], good, [1, 0])) is None
    assert "not each of the 3 samples once" in check(first, _batch([1, 0], [False, True], good, [1, 0]))
    assert "wrong device" in check(first, device="gpu", n=2)
    assert "is_pad has dtype" in check({**first, "is_pad": np.array([0, 0])}, n=2)
    assert "image dtype float64" in check(_batch([0, 1], [False, False], good.astype(np.float64), [0, 1]), n=2)
    assert "expected 4 x 4" in check(_batch([0, 1], [False, False], good[:, :, :3], [0, 1]), n=2)
    assert "outside" in check(_batch([0, 1], [False, False], good * 255, [0, 1]), n=2)  # not normalised
    assert "nothing was decoded" in check(_batch([0, 1], [False, False], np.zeros_like(good), [0, 1]), n=2)
    assert "labels [0, 3] outside 0..2" in check(_batch([0, 1], [False, False], good, [0, 3]), n=2)


def test_the_detection_checks_catch_a_box_outside_the_image(data):
    from dali_pipes.pipelines import Detection

    spec = Detection(size=(4, 4))
    image = np.random.default_rng(0).uniform(-1, 1, (1, 3, 4, 4)).astype(np.float32)
    batch = {
        "index": np.array([0]),
        "is_pad": np.array([False]),
        "image": image,
        "image_size": np.array([[4, 4]]),
        "boxes": np.array([[[0, 0, 2, 2], [0, 0, 0, 0]]], np.float32),
        "labels": np.array([[1, -1]]),
        "num_boxes": np.array([1]),
    }

    def check(b):
        return check_batches("detection-train", "cpu", [b | {"_device": {k: "cpu" for k in b}}], 1, data, spec)

    assert check(batch) is None
    outside = {**batch, "boxes": np.array([[[0, 0, 5, 2], [0, 0, 0, 0]]], np.float32)}
    assert "inside its 4 x 4 image" in check(outside)
    assert "outside 0..1" in check({**batch, "labels": np.array([[2, -1]])})
    assert "not the filler" in check({**batch, "labels": np.array([[1, 0]])})
    assert "does not fit the 4 x 4 batch" in check({**batch, "image_size": np.array([[5, 4]])})


def test_the_sample_data_converts_into_every_kind_of_dataset(data):
    for path in (data.classification, data.detection, data.features, data.instance, data.semantic):
        assert (Path(path) / "index.json").is_file()
    assert data.feature_values.shape[0] == data.feature_labels.shape[0]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_recipe_graph_passes_and_its_soft_targets_are_checked(data, workers):
    row = _run_one("recipe", "cpu", workers, data)
    assert row.status == "ok", row.line
    spec = ClassificationTrain(size=4)
    image = np.random.default_rng(0).uniform(-1, 1, (2, 3, 4, 4)).astype(np.float32)
    soft = np.array([[0.7, 0.3, 0.0], [0.2, 0.2, 0.6]], dtype=np.float32)

    def check(labels):
        batch = {"index": np.array([0, 1]), "is_pad": np.array([False, False]), "image": image, "label": labels}
        return check_batches("recipe", "cpu", [batch | {"_device": {k: "cpu" for k in batch}}], 2, data, spec)

    assert check(soft) is None
    assert "not distributions" in check(soft * 2)
    assert "expected float32 (N, 3)" in check(soft[:, :2])
