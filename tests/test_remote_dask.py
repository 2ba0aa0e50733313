"""``convert ... s3://... --engine dask``: a real Dask LocalCluster (worker processes on loopback) writes the shards and
uploads them to moto's S3 server; the storage options reach the workers, the secret among them shows nowhere."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from s3_helpers import ACCESS_KEY
from test_remote_cli import CANARY

from converters.synth import make_imagefolder

from test_convert import CLI, run_cli, shard_digests

needs_dask = pytest.mark.skipif(importlib.util.find_spec("distributed") is None, reason="needs dali-pipes[dask]")

# The cluster runs in a process of its own (see test_dask_engine.py), with no AWS variables in its environment: the
# storage options must travel with the tasks. Its workers' log lines (Dask's "Compute Failed" quotes a failed task's
# arguments) go to its stderr, which the test reads.
_CLUSTER = """
import json, sys, distributed
cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                   dashboard_address=None, silence_logs=False)
client = distributed.Client(cluster)
client.wait_for_workers(2, timeout=60)
print(json.dumps({"address": cluster.scheduler_address}), flush=True)
sys.stdin.read()
client.close()
cluster.close()
"""


@pytest.fixture
def cluster(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AWS_")}
    log = tmp_path / "cluster.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CLUSTER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    address = json.loads(proc.stdout.readline())["address"]
    try:
        yield address, log
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def convert_cli(images: Path, url: str, work: Path, address: str, endpoint: str) -> subprocess.CompletedProcess:
    options = [
        f"endpoint_url={endpoint}",
        f"key={ACCESS_KEY}",
        f"secret={CANARY}",
        "client_kwargs.region_name=eu-west-1",
    ]
    return subprocess.run(
        [*CLI, "-v", "convert", "imagefolder", str(images), url, "--samples-per-shard", "10", "--no-progress"]
        + ["--engine", "dask", "--scheduler", address, "--work-dir", str(work)]
        + [arg for option in options for arg in ("--storage-option", option)],
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(300)
@needs_dask
def test_dask_workers_upload_to_s3_with_the_options_given_and_show_no_secret(tmp_path, s3, cluster):
    address, log = cluster
    images = make_imagefolder(tmp_path / "images", 40, size=(64, 48), classes=2)
    reference = tmp_path / "reference"
    run_cli("convert", "imagefolder", images, reference, "--samples-per-shard", "10", "--no-progress")
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/shards"
    # The first shard's upload is refused (as for keys without write access): the task fails on its worker.
    s3.proxy.add("deny", method="PUT", path=r"shard-00000", times=None)
    failed = convert_cli(images, url, tmp_path / "work", address, s3.proxy.url)
    assert failed.returncode != 0 and f"{url}/shard-00000.lmdb: access denied" in failed.stderr
    assert not s3.fs().exists(f"{bucket}/shards/index.json")
    s3.proxy.clear()
    done = convert_cli(images, url, tmp_path / "work", address, s3.proxy.url)  # resumes
    assert done.returncode == 0, done.stderr
    got = tmp_path / "got"
    s3.fs().get(f"{bucket}/shards/", f"{got}/", recursive=True)
    assert shard_digests(got) == shard_digests(reference)
    texts = [failed.stdout, failed.stderr, done.stdout, done.stderr, log.read_text()]
    texts += [p.read_text(errors="replace") for p in [*got.rglob("*"), *(tmp_path / "work").rglob("*")] if p.is_file()]
    assert "Compute Failed" in log.read_text() or "shard-00000" in log.read_text()  # the workers' lines were read
    assert not [t for t in texts if CANARY in t]


def test_the_uploader_a_task_carries_shows_no_option_in_its_repr():
    from converters.runner import write_shard
    from converters.upload import Uploader

    uploader = Uploader("s3://bucket/ds", {"key": ACCESS_KEY, "secret": CANARY})
    assert "s3://bucket/ds" in repr(uploader.after(write_shard)) and CANARY not in repr(uploader.after(write_shard))
