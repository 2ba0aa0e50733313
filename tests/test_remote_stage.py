"""Staging from object storage, against a real S3-protocol server on 127.0.0.1 (moto) and the real s3fs client.

Faults are injected at the server side (tests/s3_helpers.py): throttling bursts, connections dropped
mid-object, unknown keys, a truncated object, a shard deleted between manifest and download. Each is
retried or named; no half-downloaded file is ever kept at its final name; a re-run completes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dali_pipes import RemoteError, open_store
from dali_pipes.dataset.manifest import MANIFEST_NAME
from dali_pipes.staging.stage import StageError, stage_dataset

from loader_helpers import sample_digests, shard_name, write_dataset


def upload(s3, local: Path) -> str:
    """Put a dataset folder into a new bucket; return its URL."""
    bucket = s3.new_bucket()
    s3.fs().put(f"{local}/", f"{bucket}/ds/", recursive=True)
    return f"s3://{bucket}/ds"


def final_files(dest: Path) -> set[str]:
    return {p.name for p in dest.iterdir() if not p.name.startswith(".")} if dest.exists() else set()


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_stage_from_s3_checks_every_file_and_reuses_the_copy(tmp_path, s3, fmt):
    source = write_dataset(tmp_path / "src", 20, fmt=fmt)
    url = upload(s3, source)
    report = stage_dataset(url, tmp_path / "dest", storage_options=s3.options, progress=False, workers=4)
    assert set(report.copied) == {p.name for p in source.iterdir() if p.name != MANIFEST_NAME}
    assert (tmp_path / "dest" / MANIFEST_NAME).read_bytes() == (source / MANIFEST_NAME).read_bytes()
    assert sample_digests(tmp_path / "dest") == sample_digests(source)
    again = stage_dataset(url, tmp_path / "dest", storage_options=s3.options, progress=False)
    assert again.reused and again.copied == []


def test_throttling_bursts_and_dropped_connections_are_retried(tmp_path, s3):
    source = write_dataset(tmp_path / "src", 20, fmt="tfrecord")
    url = upload(s3, source)
    slow = s3.proxy.add("slowdown", path=r"shard-00001\.tfrecord$", times=4)
    drop = s3.proxy.add("drop", path=r"shard-00000\.tfrecord$", times=3)
    report = stage_dataset(url, tmp_path / "dest", storage_options=s3.options, progress=False)
    assert slow.seen == 4 and drop.seen == 3  # the faults happened, and were got over
    assert len(report.copied) == 6
    assert sample_digests(tmp_path / "dest") == sample_digests(source)


def test_a_server_that_keeps_failing_ends_in_an_error_naming_the_url_not_a_hang(tmp_path, s3, monkeypatch):
    import dali_pipes.remote.transfer as transfer

    monkeypatch.setattr(transfer, "BACKOFF", 0.01)
    monkeypatch.setattr(transfer, "ATTEMPTS", 3)
    source = write_dataset(tmp_path / "src", 10, fmt="lmdb")
    url = upload(s3, source)
    s3.proxy.add("drop", path=r"shard-00000\.lmdb$", times=None)
    with pytest.raises(RemoteError, match=rf"{url}/shard-00000.lmdb: the storage server .*dropped the connection"):
        stage_dataset(url, tmp_path / "dest", storage_options=s3.options, progress=False, workers=1)
    assert shard_name("lmdb", 0) not in final_files(tmp_path / "dest")
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists()
    s3.proxy.clear()
    report = stage_dataset(url, tmp_path / "dest", storage_options=s3.options, progress=False)
    assert shard_name("lmdb", 0) in report.copied  # the re-run completes, keeping what was whole
    assert sample_digests(tmp_path / "dest") == sample_digests(source)


def test_a_truncated_object_is_named_and_never_kept(tmp_path, s3):
    source = write_dataset(tmp_path / "src", 20, fmt="hdf5")
    url = upload(s3, source)
    name = shard_name("hdf5", 1)
    key = url.removeprefix("s3://") + "/" + name
    whole = (source / name).read_bytes()
    s3.fs().pipe_file(key, whole[: len(whole) // 2])
    with pytest.raises(StageError, match=rf"{url}/{name}: is {len(whole) // 2} bytes, the manifest says {len(whole)}"):
        stage_dataset(url, tmp_path / "dest", storage_options=s3.options, progress=False)
    assert name not in final_files(tmp_path / "dest")
    assert not list((tmp_path / "dest").glob(".dali-pipes-staging-*"))
    s3.fs().pipe_file(key, whole)  # repaired: the re-run completes
    stage_dataset(url, tmp_path / "dest", storage_options=s3.options, progress=False)
    assert sample_digests(tmp_path / "dest") == sample_digests(source)


def test_a_shard_deleted_between_manifest_and_download_is_named(tmp_path, s3):
    source = write_dataset(tmp_path / "src", 20, fmt="lmdb")
    url = upload(s3, source)
    name = shard_name("lmdb", 2)
    s3.fs().rm_file(url.removeprefix("s3://") + "/" + name)
    with pytest.raises(RemoteError, match=rf"{url}/{name}: no such bucket or object"):
        stage_dataset(url, tmp_path / "dest", storage_options=s3.options, progress=False, workers=1)
    assert name not in final_files(tmp_path / "dest") and not (tmp_path / "dest" / MANIFEST_NAME).exists()
    s3.fs().put_file(str(source / name), url.removeprefix("s3://") + "/" + name)  # put back: the re-run completes
    report = stage_dataset(url, tmp_path / "dest", storage_options=s3.options, progress=False, workers=1)
    assert name in report.copied and shard_name("lmdb", 0) not in report.copied  # the whole ones were kept
    assert sample_digests(tmp_path / "dest") == sample_digests(source)


def test_wrong_keys_no_bucket_and_no_dataset_are_named(tmp_path, s3):
    url = upload(s3, write_dataset(tmp_path / "src", 6, fmt="lmdb"))
    s3.proxy.add("deny", method="HEAD", times=None)
    s3.proxy.add("deny", method="GET", times=None)
    with pytest.raises(RemoteError, match=rf"{url}/index.json: access denied .*check the credentials"):
        stage_dataset(url, tmp_path / "a", storage_options=s3.options, progress=False)
    s3.proxy.clear()
    with pytest.raises(RemoteError, match=r"s3://no-such-bucket-here/ds/index.json: the bucket no-such-bucket-here "
                       r"does not exist .*check the URL, and that the endpoint, http://127"):  # fmt: skip
        stage_dataset("s3://no-such-bucket-here/ds", tmp_path / "b", storage_options=s3.options, progress=False)
    bucket = url.removeprefix("s3://").split("/")[0]
    with pytest.raises(RemoteError, match=rf"^no index.json under {url}/nothing \(the bucket {bucket} exists\): check "
                       "the path"):  # fmt: skip
        stage_dataset(f"{url}/nothing", tmp_path / "c", storage_options=s3.options, progress=False)


def test_a_missing_backend_names_the_extra_to_install(tmp_path):
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(RemoteError, match=r'gs://bucket/ds: .*pip install "dali-pipes\[gcs\]"'):
        stage_dataset("gs://bucket/ds", tmp_path / "d", progress=False)


def test_open_store_stages_a_url_into_the_cache_folder(tmp_path, s3, monkeypatch):
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    source = write_dataset(tmp_path / "src", 12, fmt="tfrecord")
    url = upload(s3, source)
    store = open_store(url, storage_options=s3.options)
    try:
        assert Path(store.root).parent == tmp_path / "cache"
        assert sample_digests(store.root) == sample_digests(source)
    finally:
        store.close()


@pytest.mark.timeout(180)
def test_the_loader_trains_an_epoch_from_s3_staged_or_cached(tmp_path, s3, monkeypatch):
    from test_storage_loader import read_epochs

    from dali_pipes import DataOptions

    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    source = write_dataset(tmp_path / "src", 23, fmt="lmdb")
    url = upload(s3, source)
    expected, _ = read_epochs(source, epochs=1, workers=0)
    staged = DataOptions(stage_to=tmp_path / "local", storage_options=s3.options)
    rows, loader = read_epochs(url, epochs=1, workers=0, data=staged)
    assert loader.store.root == tmp_path / "local" and loader.staged.copied and rows == expected
    cached = DataOptions(storage_options=s3.options)  # no stage_to: the cache
    rows, loader = read_epochs(url, epochs=1, workers=0, data=cached)
    assert loader.store.root.parent == tmp_path / "cache" and rows == expected


def test_a_server_that_stops_answering_times_out_into_an_error(tmp_path, s3, monkeypatch):
    import time

    import dali_pipes.remote.transfer as transfer

    monkeypatch.setattr(transfer, "BACKOFF", 0.01)
    monkeypatch.setattr(transfer, "ATTEMPTS", 2)
    url = upload(s3, write_dataset(tmp_path / "src", 6, fmt="lmdb"))
    options = {**s3.options, "config_kwargs": {"read_timeout": 1, "connect_timeout": 1, "retries": {"max_attempts": 1}}}
    s3.proxy.stall = 4.0
    s3.proxy.add("stall", path=r"shard-00000", times=None)
    start = time.monotonic()
    with pytest.raises(RemoteError, match=rf"{url}/shard-00000.lmdb: the storage server did not answer"):
        stage_dataset(url, tmp_path / "dest", storage_options=options, progress=False, workers=1)
    assert time.monotonic() - start < 30
    assert shard_name("lmdb", 0) not in final_files(tmp_path / "dest")


@pytest.mark.timeout(180)
def test_a_stage_from_s3_killed_with_sigkill_resumes_keeping_the_whole_files(tmp_path, s3):
    import os
    import signal
    import subprocess
    import sys
    import time

    from test_remote_cli import s3_env

    source = write_dataset(tmp_path / "src", 32, fmt="lmdb", samples_per_shard=4)  # 8 shards
    url = upload(s3, source)
    dest = tmp_path / "dest"
    s3.proxy.stall = 60.0  # shards 4-7 hang: the kill lands while shard 4 is being downloaded
    s3.proxy.add("stall", path=r"shard-0000[4-7]", times=None)
    command = [sys.executable, "-m", "dali_pipes", "stage", url, str(dest), "--workers", "1", "--no-progress"]
    proc = subprocess.Popen(command, env=s3_env(s3), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not all((dest / shard_name("lmdb", i)).exists() for i in range(4)):
            assert proc.poll() is None, "the stage ended before it could be killed"
            assert time.monotonic() < deadline, "shards 0-3 were never staged"
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (dest / MANIFEST_NAME).exists() and shard_name("lmdb", 4) not in final_files(dest)
    s3.proxy.clear()
    report = stage_dataset(url, dest, storage_options=s3.options, progress=False)
    assert sorted(report.kept) == [shard_name("lmdb", i) for i in range(4)]
    assert sorted(report.copied) == [shard_name("lmdb", i) for i in range(4, 8)]
    assert sample_digests(dest) == sample_digests(source)


@pytest.mark.timeout(240)
def test_two_ddp_ranks_on_one_node_download_once(tmp_path, s3, monkeypatch):
    import json

    import torch.multiprocessing as mp
    from s3_helpers import ACCESS_KEY
    from stage_helpers import staging_rank
    from test_ddp import free_port

    # The ranks take their credentials from the environment, as a training job's do.
    for name, value in dict(
        AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY="testsecret", AWS_DEFAULT_REGION="eu-west-1",
        AWS_ENDPOINT_URL=s3.proxy.url, AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null",
    ).items():  # fmt: skip
        monkeypatch.setenv(name, value)
    source = write_dataset(tmp_path / "src", 23, fmt="lmdb")
    url = upload(s3, source)
    dest = tmp_path / "node-local"
    mp.start_processes(
        staging_rank, args=(2, free_port(), url, str(dest), str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    shards = sorted(p.name for p in source.glob("shard-*"))
    assert sorted(sorted(r["copied"]) for r in reports) == [[], shards]  # one rank downloaded, the other reused
    gets = [path for method, path in s3.proxy.requests if method == "GET" and "/shard-" in path]
    assert sorted(p.rsplit("/", 1)[1] for p in gets) == shards  # each shard downloaded once on the node
    seen = sorted(i for r in reports for batch in r["indices"] for i in batch)
    assert set(seen) == set(range(23))
