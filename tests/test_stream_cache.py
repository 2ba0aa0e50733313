"""The streaming shard cache against a real S3-protocol server on 127.0.0.1 (moto) and the real s3fs client.

Faults are injected at the server side (tests/s3_helpers.py): throttling, connections dropped mid-object,
an object corrupted or truncated in the bucket, a download stalled while its process is killed. The bound
checked throughout: the folder's complete shards and temporaries together never pass the limit (a
download's bytes are reserved before its first byte is written), so ``peak_bytes <= limit`` with no
extra shard. Other processes of the node are real ``spawn`` processes (tests/stream_cache_helpers.py).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from s3_helpers import SECRET_KEY
from stream_cache_helpers import fetch_in_process, fork_mid_download
from test_remote_stage import upload

from dali_pipes.staging.cache_folder import META
from dali_pipes.staging.checked import TMP_PREFIX, StageError
from dali_pipes.staging.stream_cache import CacheError, CacheTuning, ShardCache

from loader_helpers import shard_name, write_dataset

SHARD = 12288  # every LMDB shard of 4 samples here: 3 pages


@pytest.fixture
def dataset(tmp_path, s3) -> tuple[Path, str]:
    """An 8-shard LMDB dataset of 32 samples in the bucket: ``(local source, URL)``."""
    source = write_dataset(tmp_path / "src", 32, fmt="lmdb", samples_per_shard=4)
    assert {p.stat().st_size for p in source.glob("shard-*")} == {SHARD}
    return source, upload(s3, source)


def shard_gets(s3) -> list[str]:
    """The shard files the server was asked for (GET), one name per request."""
    return sorted(path.rsplit("/", 1)[1] for method, path in s3.proxy.requests if method == "GET" and "/shard-" in path)


def on_disk(folder: Path) -> int:
    """Bytes of every file in the folder but the bookkeeping: complete shards and temporaries."""
    total = 0
    for path in folder.rglob("*"):
        if META not in path.parts:
            try:
                total += path.stat().st_size if path.is_file() else 0
            except FileNotFoundError:
                pass
    return total


def temporaries(folder: Path) -> list[Path]:
    return list(folder.rglob(f"{TMP_PREFIX}*"))


def assert_no_secret(folder: Path, *texts: str) -> None:
    files = [p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file()]
    assert not [text for text in [*texts, *files] if SECRET_KEY in text]


def in_process(tmp_path: Path, name: str, *args, **kwargs) -> tuple[multiprocessing.Process, Path]:
    out = tmp_path / f"{name}.json"
    proc = multiprocessing.get_context("spawn").Process(target=fetch_in_process, args=(*args, str(out)), kwargs=kwargs)
    proc.start()
    return proc, out


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_fetch_brings_whole_shards_and_a_second_fetch_downloads_nothing(tmp_path, s3, fmt):
    source = write_dataset(tmp_path / "src", 24, fmt=fmt, samples_per_shard=4)
    url = upload(s3, source)
    with ShardCache(url, tmp_path / "cache", 10**6, storage_options=s3.options) as cache:
        paths = cache.fetch([0, shard_name(fmt, 1)])
        assert [p.name for p in paths] == [shard_name(fmt, 0), shard_name(fmt, 1)]
        local = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name != META)
        assert local == sorted(p.name for p in source.iterdir() if p.name.startswith(("shard-00000", "shard-00001")))
        for name in local:  # a TFRecord shard comes with its index
            assert (tmp_path / "cache" / name).read_bytes() == (source / name).read_bytes()
        assert cache.present(0) and cache.present(1) and not cache.present(2)
        assert cache.bytes_held == on_disk(tmp_path / "cache") == sum(cache.shard_bytes[:2])
        s3.proxy.clear()
        cache.fetch([1, 0])
        assert shard_gets(s3) == []
    assert_no_secret(tmp_path / "cache")


def test_eviction_is_least_recently_used_and_never_of_a_pinned_shard(tmp_path, s3, dataset):
    _, url = dataset
    cache = ShardCache(url, tmp_path / "cache", 3 * SHARD, storage_options=s3.options)
    cache.pin([0])
    for k in (
        0,
        1,
        2,
        1,
    ):  # full: 0 (pinned), 1, 2; then 2 is the least recently used unpinned (0 is older, but pinned)
        cache.fetch([k])
    cache.fetch([3])
    assert [cache.present(k) for k in range(4)] == [True, True, False, True]
    cache.unpin([0])
    cache.fetch([4])  # 0 is the least recently used, and no longer pinned
    assert [cache.present(k) for k in range(5)] == [False, True, False, True, True]
    with cache.hold([1, 3]) as paths:
        assert all(p.exists() for p in paths)
        cache.fetch([5])  # 4 goes: 1 and 3 are held
        assert [cache.present(k) for k in (1, 3, 4, 5)] == [True, True, False, True]
    assert cache.bytes_held == on_disk(tmp_path / "cache") == 3 * SHARD
    assert cache.peak_bytes == 3 * SHARD
    with pytest.raises(ValueError, match="shard-00001.lmdb: not pinned by this cache"):
        cache.unpin([1])
    cache.close()


def test_the_folder_never_holds_more_than_the_limit(tmp_path, s3):
    source = write_dataset(tmp_path / "src", 48, fmt="tfrecord", samples_per_shard=4)  # 12 shards with indexes
    url = upload(s3, source)
    folder = tmp_path / "cache"
    probe = ShardCache(url, folder, 10**6, storage_options=s3.options)
    limit = 4 * max(probe.shard_bytes)
    probe.close()
    cache = ShardCache(url, folder, limit, storage_options=s3.options, tuning=CacheTuning(downloads=4))
    seen, done = [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.append(on_disk(folder))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for start in range(0, 12, 2):  # a window of two shards read, the next two fetched ahead
            with cache.hold([start, start + 1]):
                cache.fetch([(start + 2) % 12, (start + 3) % 12])
    finally:
        done.set()
        sampler.join()
    assert len(seen) > 10 and max(seen) <= limit
    assert 3 * min(cache.shard_bytes) < cache.peak_bytes <= limit
    cache.close()


@pytest.mark.slow  # a process of its own or a second loader: the slow stage (the default suite stays within its time)
def test_two_processes_asking_for_the_same_shards_download_each_once(tmp_path, s3, dataset):
    source, url = dataset
    s3.proxy.stall = 1.0  # every shard download takes a second: the second process asks while the first downloads
    s3.proxy.add("stall", path=r"shard-0000[0-3]\.lmdb$", times=None)
    start = multiprocessing.get_context("spawn").Barrier(3)
    args = (url, str(tmp_path / "cache"), 8 * SHARD, s3.options, [0, 1, 2, 3])
    procs = [in_process(tmp_path, f"rank-{r}", *args, start=start) for r in range(2)]
    start.wait(60)
    for proc, _ in procs:
        proc.join(60)
        assert proc.exitcode == 0
    results = [json.loads(out.read_text()) for _, out in procs]
    assert [r["error"] for r in results] == [None, None]
    assert any(r["waited"] for r in results), results  # one waited for the other's downloads
    assert shard_gets(s3) == [shard_name("lmdb", k) for k in range(4)]  # each shard once on the node
    for k in range(4):
        assert (tmp_path / "cache" / shard_name("lmdb", k)).read_bytes() == (
            source / shard_name("lmdb", k)
        ).read_bytes()


def test_throttling_and_dropped_connections_are_retried(tmp_path, s3, dataset, monkeypatch):
    import dali_pipes.remote.transfer as transfer

    monkeypatch.setattr(transfer, "BACKOFF", 0.01)
    source, url = dataset
    slow = s3.proxy.add("slowdown", path=r"shard-00001\.lmdb$", times=3)
    drop = s3.proxy.add("drop", path=r"shard-00002\.lmdb$", times=2)
    with ShardCache(url, tmp_path / "cache", 4 * SHARD, storage_options=s3.options) as cache:
        paths = cache.fetch([0, 1, 2])
        assert slow.seen == 3 and drop.seen == 2  # the faults happened, and were got over
        assert [p.read_bytes() for p in paths] == [(source / p.name).read_bytes() for p in paths]
        assert cache.bytes_held == 3 * SHARD and not temporaries(tmp_path / "cache")


def test_a_corrupted_or_truncated_object_is_named_and_nothing_of_it_is_kept(tmp_path, s3, dataset, caplog):
    source, url = dataset
    bad, short = shard_name("lmdb", 1), shard_name("lmdb", 2)
    whole = (source / bad).read_bytes()
    s3.fs().pipe_file(f"{url.removeprefix('s3://')}/{bad}", whole[:100] + bytes([whole[100] ^ 1]) + whole[101:])
    s3.fs().pipe_file(f"{url.removeprefix('s3://')}/{short}", (source / short).read_bytes()[: SHARD // 2])
    folder = tmp_path / "cache"
    with ShardCache(url, folder, 4 * SHARD, storage_options=s3.options) as cache:
        with pytest.raises(StageError, match=rf"{url}/{bad}: SHA-256 does not match the manifest") as corrupted:
            cache.fetch([0, 1])
        with pytest.raises(
            StageError, match=rf"{url}/{short}: is {SHARD // 2} bytes, the manifest says {SHARD}"
        ) as cut:
            cache.fetch([2])
        assert [cache.present(k) for k in range(3)] == [True, False, False]
        assert not temporaries(folder) and cache.bytes_held == on_disk(folder) == SHARD  # reservations released
        s3.fs().pipe_file(f"{url.removeprefix('s3://')}/{bad}", whole)  # repaired: fetched now
        assert cache.fetch([1])[0].read_bytes() == whole
    assert_no_secret(folder, str(corrupted.value), str(cut.value), caplog.text)


@pytest.mark.parametrize(
    "fault, noticed",
    [("corrupt", "did not match calculated checksum"), ("corrupt-bare", "SHA-256 does not match the manifest")],
)
def test_a_download_damaged_on_the_way_is_downloaded_once_more(tmp_path, s3, dataset, caplog, fault, noticed):
    # Found by the object's stored checksum (a retried request), or else by the manifest's SHA-256 (a new download).
    caplog.set_level(logging.INFO, logger="dali_pipes")  # an earlier test may have quietened the package's loggers
    source, url = dataset
    name = shard_name("lmdb", 1)
    s3.proxy.add(fault, path=rf"/{name}$", times=1)  # the bucket's copy is whole: only this answer is not
    with ShardCache(url, tmp_path / "cache", 4 * SHARD, storage_options=s3.options) as cache:
        assert cache.fetch([1])[0].read_bytes() == (source / name).read_bytes()
    gets = [path for method, path in s3.proxy.requests if method == "GET" and path.endswith(name)]
    assert len(gets) >= 2 and noticed in caplog.text


def test_ctrl_c_mid_download_leaves_nothing_half_written(tmp_path, s3, dataset, monkeypatch):
    import dali_pipes.staging.download as download

    real = download.download_to

    def interrupted(fs, path, url, out, expected, advance, options):
        out.write(b"x" * 1000)
        raise KeyboardInterrupt

    _, url = dataset
    folder = tmp_path / "cache"
    with ShardCache(url, folder, 2 * SHARD, storage_options=s3.options) as cache:
        monkeypatch.setattr(download, "download_to", interrupted)
        with pytest.raises(KeyboardInterrupt):
            cache.fetch([0])
        assert not temporaries(folder) and cache.bytes_held == on_disk(folder) == 0 and not cache.present(0)
        monkeypatch.setattr(download, "download_to", real)
        cache.fetch([0, 1])  # nothing pinned or reserved was left behind: both fit
        assert cache.bytes_held == 2 * SHARD


@pytest.mark.slow  # a process of its own or a second loader: the slow stage (the default suite stays within its time)
@pytest.mark.timeout(120)
def test_a_cache_killed_mid_download_is_reused(tmp_path, s3, dataset):
    _, url = dataset
    folder = tmp_path / "cache"
    limit = 4 * SHARD
    alive = ShardCache(url, folder, limit, storage_options=s3.options)  # another process of the node, still running
    s3.proxy.stall = 60.0  # shard 3 hangs: the kill lands while it is being downloaded
    s3.proxy.add("stall", path=r"shard-00003\.lmdb$", times=None)
    proc, _ = in_process(tmp_path, "killed", url, str(folder), limit, s3.options, [0, 1, 2, 3], pin=True, workers=1)
    try:
        deadline = time.monotonic() + 60
        while not (all(alive.present(k) for k in range(3)) and temporaries(folder)):
            assert proc.is_alive() and time.monotonic() < deadline, "the fetch never reached shard 3"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    finally:
        proc.kill()
    assert proc.exitcode == -signal.SIGKILL
    s3.proxy.clear()
    # The dead process's pins (0-3) and its reservation of shard 3 are dropped, and its temporary removed.
    alive.pin([4, 5, 6, 7])
    alive.unpin([4, 5, 6, 7])
    assert not temporaries(folder) and alive.bytes_held == on_disk(folder) == 3 * SHARD
    alive.fetch([0, 1, 2, 3])
    assert shard_gets(s3) == [shard_name("lmdb", 3)]  # 0-2 kept
    assert not temporaries(folder) and alive.bytes_held == on_disk(folder) == limit
    alive.close()
    (folder / f"{TMP_PREFIX}{shard_name('lmdb', 5)}-999-1").write_bytes(b"half")  # as a kill would leave it
    with ShardCache(url, folder, limit, storage_options=s3.options) as again:  # the first process of a new run
        assert [again.present(k) for k in range(5)] == [True, True, True, True, False]
        assert not temporaries(folder) and again.bytes_held == limit
    assert_no_secret(folder)


def test_pins_over_the_limit_and_a_shard_over_it_are_refused_with_what_they_need(tmp_path, s3, dataset):
    _, url = dataset
    folder = tmp_path / "cache"
    limit = 2 * SHARD
    need = rf"would need 36.9 KB \({3 * SHARD} bytes, 3 shard\(s\), these among them: shard-00002.lmdb\)"
    message = (
        rf"{folder}: the shards pinned on this node {need}, more than the cache's limit of 24.6 KB \({limit} bytes\)"
    )
    cache = ShardCache(url, folder, limit, storage_options=s3.options)
    other = ShardCache(url, folder, limit, storage_options=s3.options)  # another process's pins count too
    cache.pin([0])
    other.pin([1])
    with pytest.raises(CacheError, match=message):
        cache.pin([2])
    with pytest.raises(CacheError, match=message):
        other.fetch([2])
    other.close()  # its pins go with it
    cache.fetch([2])
    with pytest.raises(CacheError, match=rf"other processes of this node use it with a limit of {limit} bytes, not"):
        ShardCache(url, folder, 3 * SHARD, storage_options=s3.options)
    cache.close()
    with pytest.raises(
        CacheError,
        match=rf"shard shard-00000.lmdb takes 12.3 KB \({SHARD} bytes, .*limit of 12.3 KB \({SHARD - 1} bytes\)",
    ):
        ShardCache(url, tmp_path / "small", SHARD - 1, storage_options=s3.options)


def test_a_folder_of_another_dataset_or_a_staged_copy_is_refused(tmp_path, s3, dataset):
    from dali_pipes.staging.stage import stage_dataset

    _, url = dataset
    other = upload(s3, write_dataset(tmp_path / "other", 8, fmt="lmdb", samples_per_shard=4))
    ShardCache(url, tmp_path / "cache", 4 * SHARD, storage_options=s3.options).close()
    with pytest.raises(CacheError, match=rf"{tmp_path / 'cache'}: already caches {url}, not {other}"):
        ShardCache(other, tmp_path / "cache", 4 * SHARD, storage_options=s3.options)
    stage_dataset(other, tmp_path / "staged", storage_options=s3.options, progress=False)
    with pytest.raises(CacheError, match=rf"{tmp_path / 'staged'}: holds a staged copy"):
        ShardCache(other, tmp_path / "staged", 4 * SHARD, storage_options=s3.options)


def test_a_damaged_shard_is_kept_on_size_and_dropped_with_verify(tmp_path, s3, dataset):
    _, url = dataset
    folder = tmp_path / "cache"
    with ShardCache(url, folder, 4 * SHARD, storage_options=s3.options) as cache:
        cache.fetch([0, 1])
    damaged = bytearray((folder / shard_name("lmdb", 0)).read_bytes())
    damaged[5000] ^= 0xFF
    (folder / shard_name("lmdb", 0)).write_bytes(bytes(damaged))
    with ShardCache(url, folder, 4 * SHARD, storage_options=s3.options) as cache:
        assert cache.present(0) and cache.present(1)  # sizes only
    with ShardCache(url, folder, 4 * SHARD, storage_options=s3.options, tuning=CacheTuning(verify=True)) as cache:
        assert not cache.present(0) and cache.present(1) and cache.bytes_held == SHARD
        assert not (folder / shard_name("lmdb", 0)).exists()


@pytest.mark.timeout(120)
def test_a_full_disk_is_one_clear_error_and_leaves_nothing(tmp_path, s3, dataset):
    _, url = dataset
    folder = tmp_path / "cache"
    limit = 4 * SHARD
    proc, out = in_process(tmp_path, "full", url, str(folder), limit, s3.options, [0], fsize=SHARD // 2)
    proc.join(60)
    assert proc.exitcode == 0
    error = json.loads(out.read_text())["error"]
    assert error.startswith(f"{folder}: the disk is full (File too large) while downloading shard-00000.lmdb: ")
    assert f"the cache's limit is 49.2 KB ({limit} bytes); free space there, lower the limit" in error
    assert not temporaries(folder) and not (folder / shard_name("lmdb", 0)).exists()
    with ShardCache(url, folder, limit, storage_options=s3.options) as cache:
        assert cache.bytes_held == 0  # nothing reserved was left behind
    assert_no_secret(folder, error)


@pytest.mark.slow  # a process of its own or a second loader: the slow stage (the default suite stays within its time)
def test_a_download_another_process_never_finishes_ends_in_an_error_naming_the_shard(tmp_path, s3, dataset):
    from dali_pipes.staging.cache_folder import CacheFolder

    _, url = dataset
    folder = tmp_path / "cache"
    with ShardCache(url, folder, 4 * SHARD, storage_options=s3.options, tuning=CacheTuning(wait_s=0.3)) as cache:
        stuck = CacheFolder(folder).try_shard_lock(shard_name("lmdb", 0))  # as a process hung mid-download holds it
        start = time.monotonic()
        with pytest.raises(
            CacheError,
            match=rf"{folder}: shard shard-00000.lmdb: another process of this node has been downloading it for 0.3 s without progress",
        ):
            cache.fetch([0])
        assert time.monotonic() - start < 10 and cache.bytes_held == 0
        os.close(stuck)
        cache.fetch([0])


def test_a_local_dataset_on_a_slow_filesystem_is_cached_alike(tmp_path):
    source = write_dataset(tmp_path / "nfs" / "train", 16, fmt="tfrecord", samples_per_shard=4)
    with ShardCache(source, tmp_path / "cache", 10**6) as cache:
        limit = 2 * max(cache.shard_bytes)
    with ShardCache(source, tmp_path / "cache", limit) as cache:
        paths = [cache.fetch([k])[0] for k in (0, 1)]  # one at a time: 0 is the least recently used
        assert [p.read_bytes() for p in paths] == [(source / shard_name("tfrecord", k)).read_bytes() for k in (0, 1)]
        cache.fetch([2])
        assert [cache.present(k) for k in range(3)] == [False, True, True] and cache.peak_bytes <= limit
    with pytest.raises(StageError, match="is where .* already is"):
        ShardCache(source, source, limit)


def test_a_look_that_changes_nothing_does_not_rewrite_the_state_and_another_caches_change_is_kept(tmp_path):
    # Every transaction used to write the state whole (a file made and renamed: on some filesystems more CPU than
    # the rest of a small shard's download); one that changes nothing writes nothing now.
    source = write_dataset(tmp_path / "nfs" / "train", 16, fmt="tfrecord", samples_per_shard=4)
    state = tmp_path / "cache" / META / "state.json"
    with ShardCache(source, tmp_path / "cache", 10**6) as cache, ShardCache(source, tmp_path / "cache", 10**6) as other:
        cache.fetch([0])
        cache.set_ahead([1])
        written = state.stat().st_ino  # each write renames a new file over the old one
        cache.set_ahead([1])
        assert state.stat().st_ino == written
        cache.fetch([1], ahead=True)  # missing and pinned ahead: reserved, downloaded, committed
        assert state.stat().st_ino != written and cache.bytes_held == sum(cache.shard_bytes[:2])
        other.pin([1])  # another process's write between two looks of this one's
        written = state.stat().st_ino
        cache.set_ahead([1])  # changes nothing: the other's pin stays in the file
        assert state.stat().st_ino == written
        assert json.loads(state.read_text())["pins"] == {other._state.holder: {shard_name("tfrecord", 1): 1}}
        other.unpin([1])


@pytest.mark.slow  # a process of its own or a second loader: the slow stage (the default suite stays within its time)
def test_a_run_with_a_smaller_limit_keeps_the_most_recently_used_shards(tmp_path, s3, dataset):
    _, url = dataset
    folder = tmp_path / "cache"
    with ShardCache(url, folder, 4 * SHARD, storage_options=s3.options) as cache:
        for k in (0, 1, 2, 3, 1):
            cache.fetch([k])
    with ShardCache(url, folder, 2 * SHARD, storage_options=s3.options) as cache:
        assert [cache.present(k) for k in range(4)] == [False, True, False, True]
        assert cache.bytes_held == on_disk(folder) == cache.peak_bytes == 2 * SHARD


def test_a_forked_child_holds_none_of_the_parents_locks(tmp_path):
    # A reader process forked mid-download must not keep a download lock nor the parent's holder lock alive.
    from dali_pipes.staging.cache_folder import CacheFolder, _held

    folder = CacheFolder(tmp_path / "cache")
    with folder.locked():
        holder = folder.register()
    started, said = os.pipe()
    with folder.shard_lock("shard-00000.lmdb", 5.0, []):
        child = os.fork()
        if child == 0:  # the child says it runs (its fork handlers done), then outlives the checks below
            os.write(said, b"1")
            time.sleep(30)
            os._exit(0)
    try:
        assert os.read(started, 1) == b"1"
        fd = folder.try_shard_lock("shard-00000.lmdb")
        assert fd is not None, "the forked child kept the download lock"
        os.close(fd)
        folder.close_descriptors()  # the parent's holder gone as if it died, its lock file left behind
        assert not _held(folder.meta / "holders" / f"{holder}.lock"), "the forked child kept the holder lock"
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
        os.close(started), os.close(said)


@pytest.mark.slow  # processes of their own
@pytest.mark.timeout(120)
def test_a_download_lock_ends_with_its_process_though_a_forked_child_lives_on(tmp_path, s3, dataset):
    # Issue 54 item 7: the child's copy of the lock's descriptor kept the download lock held after its parent was
    # killed, and the node's other processes waited for a download nobody made, until their wait_s.
    _, url = dataset
    folder = tmp_path / "cache"
    s3.proxy.stall = 60.0  # the parent's download of shard 0 hangs: the kill lands mid-download
    s3.proxy.add("stall", path=r"shard-00000\.lmdb$", times=None)
    out = tmp_path / "child.pid"
    args = (url, str(folder), 4 * SHARD, s3.options, 0, str(out))
    parent = multiprocessing.get_context("spawn").Process(target=fork_mid_download, args=args)
    parent.start()
    child = None
    try:
        deadline = time.monotonic() + 60
        while not out.exists():
            assert parent.is_alive() and time.monotonic() < deadline, "the download never began"
            time.sleep(0.05)
        child = int(out.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        while parent.exitcode is None:  # not join(): the child holds the parent's sentinel pipe open
            time.sleep(0.02)
        s3.proxy.clear()
        with ShardCache(url, folder, 4 * SHARD, storage_options=s3.options, tuning=CacheTuning(wait_s=5)) as cache:
            start = time.monotonic()
            cache.fetch([0])  # taken over at once, not after 5 s without progress (a CacheError then)
            assert time.monotonic() - start < 5 and cache.present(0)
    finally:
        parent.kill()
        if child is not None:
            os.kill(child, signal.SIGKILL)
    assert not temporaries(folder)


def test_shards_fetched_ahead_give_up_their_room_to_a_pin_to_read(tmp_path, s3, dataset):
    # Issue 54 item 3: two holders of one node (two loaders of one process here), each pinning up to the limit.
    _, url = dataset
    folder = tmp_path / "cache"
    train = ShardCache(url, folder, 4 * SHARD, storage_options=s3.options)
    evaluation = ShardCache(url, folder, 4 * SHARD, storage_options=s3.options)
    train.pin([0])
    assert train.set_ahead([1, 2, 3, 4]) == [1, 2, 3]  # the room no other pin uses, in reading order
    train.fetch([1, 2, 3, 4], ahead=True)  # downloads those still pinned ahead only
    assert [train.present(k) for k in range(5)] == [False, True, True, True, False]
    evaluation.pin([5, 6])  # the furthest ahead go first
    assert evaluation.set_ahead([7]) == [] and train.set_ahead([1, 2, 3]) == [1]
    evaluation.fetch([5, 6])
    assert train.present(1) and evaluation.bytes_held <= 4 * SHARD
    start = time.monotonic()
    with pytest.raises(CacheError) as refused:  # only this process's pins stand in the way: refused at once
        evaluation.pin([7, 3])
    assert time.monotonic() - start < 5
    message = str(refused.value)
    assert message.startswith(
        f"{folder}: the shards pinned on this node would need 61.4 KB ({5 * SHARD} bytes, 5 shard(s), these among "
        f"them: shard-00007.lmdb, shard-00003.lmdb), more than the cache's limit of 49.2 KB ({4 * SHARD} bytes); "
        f"held by pid {os.getpid()} (this process): "
    )
    mine = f"pid {os.getpid()} (this process)"
    assert f"{mine}: 1 shard(s) being read (12.3 KB), 1 ahead (12.3 KB)" in message  # the training loader's
    assert f"{mine}: 2 shard(s) being read (24.6 KB)" in message and "close the loaders no longer read" in message
    train.close()
    evaluation.pin([7, 3])  # the room of a closed cache
    evaluation.close()


def test_every_limit_a_stream_takes_fetches_the_next_shards_ahead(tmp_path, s3, dataset):
    # The rule of dali-pipes 0.2 (a rank's share of the limit: a window and what it left) took a limit of two
    # shards and fetched nothing ahead: the first batches of every window waited for its downloads, with a warning.
    # A node window leaves room beside two windows for a shard ahead at least, for every limit it takes.
    from dali_pipes.loading.config import StreamOptions
    from dali_pipes.loading.stream_setup import _node_window
    from dali_pipes.sampling.node_room import least_cache_limit, node_window

    least = least_cache_limit([SHARD] * 8, 2)  # 6 shards: two windows of one and one more, for 2 readers
    with ShardCache(dataset[1], tmp_path / "cache", least, storage_options=s3.options) as cache:
        for loaders, readers in ((2, 1), (1, 2)):  # readers: ranks without a process group each read apart
            plan = _node_window(cache, StreamOptions(cache_limit=least, loaders=loaders), readers)
            assert (plan.window, plan.ahead) == (1, 1), (loaders, readers, plan)
    one = node_window(3 * SHARD, [SHARD] * 8, 1)  # one loader: 3 shards
    assert (one.window, one.ahead) == (1, 1)
    for loaders in (1, 2):
        with pytest.raises(ValueError, match=f"raise cache_limit to at least {3 * SHARD * loaders} bytes"):
            node_window(3 * SHARD * loaders - 1, [SHARD] * 8, loaders)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        sizes = rng.integers(1, 100, int(rng.integers(1, 30)))
        limit, loaders = int(rng.integers(1, 3 * sizes.sum())), int(rng.integers(1, 5))
        if limit >= least_cache_limit(sizes, loaders):
            plan = node_window(limit, sizes, loaders)
            assert plan.ahead >= 1 or plan.window == len(sizes), (sizes.tolist(), limit, loaders, plan)


def test_the_old_name_workers_still_sets_the_downloads_with_a_warning_and_a_bad_count_is_refused():
    with pytest.warns(DeprecationWarning, match=r"CacheTuning\(downloads=\.\.\.\)"):
        assert CacheTuning(workers=3).downloads == 3
    with pytest.warns(DeprecationWarning, match=r"CacheTuning.workers is now CacheTuning.downloads"):
        assert CacheTuning(downloads=6).workers == 6  # read by its old name too
    with pytest.raises(ValueError, match=r"downloads=2 and workers=3, its old name: give one"):
        CacheTuning(downloads=2, workers=3)
    assert CacheTuning(downloads=6).downloads == 6
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=r"CacheTuning\(downloads=\.\.\.\) must be a whole number >= 1"):
            CacheTuning(downloads=bad)


def test_a_shard_to_read_waits_for_room_a_download_under_way_holds_instead_of_failing(tmp_path, s3, dataset):
    # Room held by the reservation of a download under way (a shard fetched ahead, no longer wanted ahead when the
    # windows moved): the shard to be read now waits for it to end, then evicts it (issue 56: reader processes'
    # batches failed with "no room" under load).
    _, url = dataset
    with ShardCache(url, tmp_path / "cache", 3 * SHARD, storage_options=s3.options) as cache:
        cache.pin([0, 1])
        cache.fetch([0, 1])
        cache.set_ahead([2])
        s3.proxy.stall = 1.5
        s3.proxy.add("stall", path=rf"/{shard_name('lmdb', 2)}$", times=1)
        ahead = threading.Thread(target=cache.fetch, args=([2],), kwargs={"ahead": True}, daemon=True)
        ahead.start()
        deadline = time.monotonic() + 20
        while not any(shard_name("lmdb", 2) in path for _, path in s3.proxy.requests):  # reserved, held by the server
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cache.set_ahead([])  # shard 2 no longer wanted ahead: its download goes on, its bytes reserved
        cache.pin([3])
        started = time.monotonic()
        cache.fetch([3], ahead=True)  # pinned to read: waits for the room, then evicts shard 2
        assert time.monotonic() - started > 0.5
        assert cache.present(3) and not cache.present(2)
        assert cache.peak_bytes <= 3 * SHARD
        ahead.join(10)
