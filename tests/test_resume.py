"""A conversion killed part-way completes on a re-run, byte for byte equal to an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from converters.runner import OutputLock
from converters.synth import make_imagefolder
from dali_pipes.cli.verify import verify_dataset
from dali_pipes.dataset.manifest import FORMATS

from test_convert import CLI, run_cli, shard_digests  # noqa: E402 - shared helpers

NUM_IMAGES = 240
PER_SHARD = 10


@pytest.fixture(scope="module")
def small_images(tmp_path_factory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("synth") / "images", NUM_IMAGES, size=(160, 120), classes=4, seed=3)


def _records(out: Path) -> int:
    return len(list((out / ".dali-pipes-job").glob("shard-*.json")))


def _kill_after_shards(args, out: Path, shards: int) -> None:
    """Start a conversion and SIGKILL it (with its workers) once ``shards`` shards are recorded."""
    proc = subprocess.Popen(
        [*CLI, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 120
    try:
        while _records(out) < shards:
            if proc.poll() is not None:
                pytest.fail(f"the conversion finished before it could be killed ({_records(out)} shards recorded)")
            if time.monotonic() > deadline:
                pytest.fail("the conversion made no progress")
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", FORMATS)
def test_killed_conversion_resumes_to_identical_output(small_images, tmp_path, fmt):
    common = ["--format", fmt, "--samples-per-shard", PER_SHARD, "--no-progress"]
    reference = tmp_path / "reference"
    run_cli("convert", "imagefolder", small_images, reference, "--workers", "2", *common)

    out = tmp_path / "killed"
    _kill_after_shards(["convert", "imagefolder", small_images, out, "--workers", "2", *common], out, shards=3)
    done_at_kill = _records(out)
    assert not (out / "index.json").exists(), "the killed run must not look complete"
    assert done_at_kill < NUM_IMAGES // PER_SHARD

    # A second kill, then the re-run finishes; worker counts differ on purpose.
    _kill_after_shards(
        ["convert", "imagefolder", small_images, out, "--workers", "1", *common], out, shards=done_at_kill + 2
    )
    proc = run_cli("convert", "imagefolder", small_images, out, "--workers", "2", *common)
    assert "kept from an earlier run" in proc.stdout

    assert shard_digests(out) == shard_digests(reference)
    assert (out / "index.json").read_bytes() == (reference / "index.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert verify_dataset(out, progress=False).ok


def test_two_conversions_into_one_folder_refuse_to_run_at_once(small_images, tmp_path):
    out = tmp_path / "out"
    args = ["convert", "imagefolder", small_images, out, "--samples-per-shard", "5", "--no-progress"]
    out.mkdir()
    # This test process plays the first conversion: it holds the folder's lock, as a running job does.
    with OutputLock(out):
        second = run_cli(*args, check=False)
        assert second.returncode != 0 and "another conversion" in second.stderr
        assert not (out / "index.json").exists()
    # Once the first job lets go, the same command runs.
    run_cli(*args)
    assert verify_dataset(out, progress=False).ok


def test_a_run_killed_after_its_manifest_leaves_nothing_behind_after_a_rerun(small_images, tmp_path):
    # The manifest is written before the job folder goes: a kill in between left .dali-pipes-job and the lock
    # file beside a complete dataset, and a re-run (which finds the dataset complete) kept them (seen under load
    # in test_kill_random). The re-run now clears them, and says the dataset is complete.
    out = tmp_path / "out"
    args = ["convert", "imagefolder", small_images, out, "--samples-per-shard", "60", "--no-progress"]
    run_cli(*args)
    finished = sorted(p.name for p in out.iterdir())
    (out / ".dali-pipes-job").mkdir()
    (out / ".dali-pipes-job" / "shard-00000.json").write_text("{}")
    (out / ".dali-pipes.lock").touch()
    again = run_cli(*args)
    assert sorted(p.name for p in out.iterdir()) == finished
    assert "already" in again.stdout + again.stderr
    assert verify_dataset(out, progress=False).ok


def test_a_complete_dataset_whose_leftovers_cannot_be_cleared_is_still_reported_complete(small_images, tmp_path):
    # The lock cannot be taken (here: a folder where the lock file goes; for a user: a dataset they may only read):
    # the re-run says the dataset is complete, as before, and leaves the leftovers.
    out = tmp_path / "out"
    args = ["convert", "imagefolder", small_images, out, "--samples-per-shard", "60", "--no-progress"]
    run_cli(*args)
    (out / ".dali-pipes-job").mkdir()
    (out / ".dali-pipes.lock").mkdir()
    again = run_cli(*args)
    assert "already" in again.stdout + again.stderr and "Traceback" not in again.stderr
