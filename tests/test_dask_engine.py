"""Conversion on a Dask cluster: a real LocalCluster on loopback, one worker killed mid-job."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from converters.synth import make_imagefolder
from dali_pipes.cli.verify import verify_dataset

from loader_helpers import skip_if_fork_refused
from test_convert import CLI, run_cli, shard_digests  # noqa: E402 - shared helpers

NUM_IMAGES = 120
PER_SHARD = 10


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("synth") / "images", NUM_IMAGES, size=(128, 96), classes=3)


# The cluster runs in its own process, and this test process never imports distributed:
# importing it installs tblib's pickling of every exception process-wide (copyreg), which
# the loader's worker shared memory then refuses, failing the loader tests that follow.
_CLUSTER = """
import json, os, sys
import dask, distributed
# Read when the scheduler starts: how many worker deaths one task may live through.
dask.config.set({"distributed.scheduler.allowed-failures": 10})
cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None)
client = distributed.Client(cluster)
def report():
    client.wait_for_workers(2, timeout=60)
    print(json.dumps({"address": cluster.scheduler_address, "pids": client.run(os.getpid)}), flush=True)
report()
for line in sys.stdin:  # each line asks for the workers again; end of input closes the cluster
    report()
client.close()
cluster.close()
"""

needs_dask = pytest.mark.skipif(importlib.util.find_spec("distributed") is None, reason="needs dali-pipes[dask]")

#: A dask conversion's CLI arguments (after the images and the output folder) pointed at a port nothing listens on.
NOBODY_THERE = ("--no-progress", "--engine", "dask", "--scheduler", "tcp://127.0.0.1:9")


class Cluster:
    """A LocalCluster (two single-threaded worker processes behind nannies) in a child process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CLUSTER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        first = self._read()
        self.address: str = first["address"]
        self.pids: dict[str, int] = first["pids"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the Dask LocalCluster process ended before reporting its workers")
        return json.loads(line)

    def worker_pids(self) -> dict[str, int]:
        """The current workers, once two are running again."""
        self.proc.stdin.write("pids\n")
        self.proc.stdin.flush()
        return self._read()["pids"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def cluster():
    local = Cluster()
    try:
        yield local
    finally:
        local.close()


def _records(out: Path) -> int:
    return len(list((out / ".dali-pipes-job").glob("shard-*.json")))


@pytest.mark.timeout(300)
@needs_dask
def test_dask_conversion_survives_a_killed_worker_and_equals_a_local_run(images, tmp_path, cluster):
    common = ["--samples-per-shard", PER_SHARD, "--no-progress"]
    reference = tmp_path / "reference"
    run_cli("convert", "imagefolder", images, reference, "--workers", "2", *common)

    out = tmp_path / "dask"
    proc = subprocess.Popen(
        [
            *CLI,
            *map(
                str,
                ["convert", "imagefolder", images, out, "--engine", "dask", "--scheduler", cluster.address, *common],
            ),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = cluster.pids  # worker address -> pid
    victim = sorted(pids)[0]
    deadline = time.monotonic() + 120
    while _records(out) < 1:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the Dask conversion ended or stalled before its first shard:\n{proc.communicate()[1]}")
        time.sleep(0.005)
    recorded_at_kill = _records(out)
    os.kill(pids[victim], signal.SIGKILL)
    # The kill must have landed mid-job, or this test shows nothing about recovery.
    assert recorded_at_kill < NUM_IMAGES // PER_SHARD and not (out / "index.json").exists()

    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"the Dask conversion failed after a worker was killed:\n{stdout}\n{stderr}"
    assert verify_dataset(out, progress=False).ok
    assert shard_digests(out) == shard_digests(reference)
    assert (out / "index.json").read_bytes() == (reference / "index.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    # The nanny replaced the killed worker: the cluster is whole again, with a new process.
    assert pids[victim] not in cluster.worker_pids().values()


# --on-error fail on the cluster. The driver runs in its own process (it imports distributed), with
# a source that takes 0.1 s a sample and logs each load: its class lives in __main__, so Dask
# ships it to the workers by value.
_FAIL_DRIVER = """
import json, sys, time
from pathlib import Path
from converters.base import SampleError
from converters.runner import convert
from converters.sources import ImageFolderSource

address, root, out, log = sys.argv[1:5]

class SlowLoggedSource(ImageFolderSource):
    def load(self, item):
        with open(log, "a") as f:
            f.write(Path(item.name).name + "\\n")
        time.sleep(0.1)
        return super().load(item)

started = time.monotonic()
try:
    convert(SlowLoggedSource(root), out, format="lmdb", samples_per_shard=int(sys.argv[5]), on_error="fail",
            engine="dask", scheduler=address, progress=False, order="source")  # the bad input 4th in shard 0
except SampleError as exc:
    print(json.dumps({"input": exc.name, "seconds": time.monotonic() - started}))
else:
    print(json.dumps({"input": None}))
"""


@pytest.fixture(scope="module")
def images_with_a_bad_one(tmp_path_factory) -> Path:
    """60 images, and at the fourth place a file that is not an image (shard 0 of 20-sample shards fails there)."""
    root = make_imagefolder(tmp_path_factory.mktemp("bad") / "images", 60, size=(64, 48), classes=1)
    (cls,) = [p for p in root.iterdir() if p.is_dir()]
    (cls / "img_000002z.jpg").write_text("this is not an image\n")
    return root


def _loaded(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.timeout(300)
@needs_dask
def test_dask_on_error_fail_stops_the_running_shards_and_leaves_nothing(images_with_a_bad_one, tmp_path, cluster):
    per_shard = 20  # 2 s a shard at 0.1 s a sample; three shards, two workers
    out = tmp_path / "out"
    out.mkdir()  # the user's empty folder: it stays, and must stay empty
    log = tmp_path / "loaded.txt"
    proc = subprocess.run(
        [sys.executable, "-c", _FAIL_DRIVER, cluster.address, images_with_a_bad_one, out, log, str(per_shard)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["input"] is not None and result["input"].endswith("img_000002z.jpg"), result

    # The job's output is gone, and nothing still runs that could write it again: what a running
    # shard would have written (in 2 s) does not appear, and no more samples are loaded.
    loaded = _loaded(log)
    time.sleep(2.5)
    assert sorted(p.name for p in out.iterdir()) == [], "the failed job left files behind, or a task wrote on"
    assert _loaded(log) == loaded, "a shard task kept running after the job failed"
    # The shards running when shard 0 failed gave up part way (a worker freed by the failure may
    # start a pending shard before the news arrives; that one stops too). Without the stop each
    # would load all its samples; how few it loads depends on the machine's load, so only
    # "not all" is asserted.
    order = sorted(p.name for p in images_with_a_bad_one.glob("*/*"))
    per = collections.Counter(order.index(name) // per_shard for name in loaded)
    assert per[0] == 4, per  # up to and including the bad input
    assert all(count < per_shard for count in per.values()), f"samples loaded per shard: {per}"


@needs_dask
@pytest.mark.timeout(300)
def test_dask_on_error_fail_on_the_cli_is_one_line_naming_the_input(images_with_a_bad_one, tmp_path, cluster):
    out = tmp_path / "out"
    args = ["convert", "imagefolder", images_with_a_bad_one, out, "--no-progress", "--on-error", "fail"]
    proc = run_cli(*args, "--engine", "dask", "--scheduler", cluster.address, "--samples-per-shard", "10", check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dali-pipes: error:")]
    assert len(lines) == 1 and "img_000002z.jpg" in lines[0] and "nothing was kept" in lines[0], proc.stderr
    assert not out.exists(), f"half-written output left behind: {list(out.iterdir())}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "dask"], "--engine dask needs --scheduler"),
        (["--scheduler", "tcp://127.0.0.1:1"], "--scheduler is only used with --engine dask"),
    ],
)
def test_engine_options_are_checked_with_one_line_errors(images, tmp_path, args, message):
    out = tmp_path / "out"
    proc = run_cli("convert", "imagefolder", images, out, "--no-progress", *args, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dali-pipes: error: "), proc.stderr
    assert message in proc.stderr
    assert not out.exists(), "a refused job must not create its output folder"


def test_dask_engine_without_dask_installed_says_how_to_install(images, tmp_path):
    # `import distributed` raises ImportError when its sys.modules entry is None.
    code = (
        "import sys; sys.modules['distributed'] = None; from dali_pipes.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "out"
    args = ["convert", "imagefolder", images, out, *NOBODY_THERE]
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "pip install 'dali-pipes[dask]'" in proc.stderr
    assert not out.exists(), "a refused job must not create its output folder"


@needs_dask
def test_unreachable_scheduler_is_a_clear_error(images, tmp_path):
    out = tmp_path / "out"
    args = ["convert", "imagefolder", images, out, *NOBODY_THERE]
    # Nothing listens on port 9; Dask's connect timeout (an environment setting) makes it give up soon.
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "1s"}
    proc = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in proc.stderr
    assert not (out / "index.json").exists()


@needs_dask
@pytest.mark.timeout(180)
def test_the_loader_works_in_a_process_that_imported_dask(images, tmp_path):
    # distributed installs tblib's exception pickling process-wide; the loader's forked
    # workers must still end their epochs (StopIteration crosses to DALI pickled).
    skip_if_fork_refused()
    shards = tmp_path / "shards"
    run_cli("convert", "imagefolder", images, shards, "--no-progress")
    code = f"""
import distributed
from dali_pipes import BatchFormat, ClassificationTrain, DALILoader, RunOptions
loader = DALILoader({str(shards)!r}, ClassificationTrain(size=32), batch_size=16,
                    run=RunOptions(py_num_workers=1, py_start_method="fork"), batch_format=BatchFormat(with_index=True))
for epoch in range(2):
    seen = sorted(int(i) for batch in loader for i, pad in zip(batch["index"], batch["is_pad"]) if not pad)
    assert seen == list(range({NUM_IMAGES})), seen
print("two epochs ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0 and "two epochs ok" in proc.stdout, proc.stderr[-2000:]
