"""``.ci/gpu-run``, the one command for a GPU machine: its data step and its bookkeeping, run here on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dali_pipes.dataset.manifest import load_manifest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "gpu-run"


def _run(out: Path, *steps: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(SCRIPT), str(out), *steps], capture_output=True, text=True, env=environ, timeout=300
    )


def test_data_step_writes_the_datasets_every_later_step_reads(tmp_path):
    out = tmp_path / "gpu-out"
    proc = _run(out, "data", GPU_RUN_IMAGES="24", GPU_RUN_TAR=str(tmp_path / "run.tgz"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == [
        "data-synth",
        "data-lmdb",
        "data-coco",
        "data-coco-masks",
        "data-features",
    ]
    assert all(" rc=0 " in line for line in summary), summary
    assert load_manifest(out / "data" / "imagenet").num_samples == 24
    assert load_manifest(out / "data" / "coco").num_samples == 61  # the COCO sample's photos
    # With masks too: an image keeps its other instances when one polygon is degenerate (2 points), as
    # detectron2 and torchvision's references do; the dropped polygons are reported, not the images.
    assert load_manifest(out / "data" / "coco-masks").num_samples == 61
    assert load_manifest(out / "data" / "features").num_samples == 20000
    # The archive holds the logs and summary, not the data (it is what comes back from a short lease).
    with tarfile.open(tmp_path / "run.tgz") as archive:
        names = {Path(n).name for n in archive.getnames()}
    assert {"summary.txt", "data-synth.log", "data-features.log"} <= names
    assert not any(n.startswith("./data/") for n in names)


def test_a_failing_step_is_recorded_and_the_next_still_runs(tmp_path):
    # No GPU here: selftest --device gpu fails; env (which only reports) still runs after it.
    out = tmp_path / "gpu-out"
    proc = _run(out, "selftest", "env", GPU_RUN_LIMIT_selftest="120")
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 1, proc.stderr  # a failed step fails the run, after every step ran
    lines = summary.splitlines()
    assert lines[0].split()[0] == "selftest" and " rc=0 " not in lines[0], summary
    assert lines[1].split()[0] == "env", summary


@pytest.mark.parametrize("step", ["nonsense", "cuda"])
def test_an_unknown_step_is_refused_naming_the_steps(tmp_path, step):
    proc = _run(tmp_path / "out", step)
    assert proc.returncode == 2
    assert f"unknown step '{step}'" in proc.stderr and "selftest gputests" in proc.stderr
