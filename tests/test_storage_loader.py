"""``DataOptions(stage_to=...)`` and ``DataOptions(cache="ram")``: where the loader reads, and that it reads the same."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from stage_helpers import staging_rank

from dali_pipes import BatchFormat, DALILoader, DataOptions, RunOptions
from dali_pipes.dataset.manifest import MANIFEST_NAME
from dali_pipes.staging.ramcache import DEFAULT_SHARE, FOLDER_PREFIX, RESERVE_MIN, RESERVE_SHARE

from loader_helpers import TinySpec, batch_rows, free_port, quiet_dali_logs, write_dataset

N = 23
BATCH = 3
INDEXED = BatchFormat(with_index=True)
RAM = DataOptions(cache="ram")


def read_epochs(dataset, epochs=2, *, workers=1, data=None):
    """``(index, label, is_pad, grey)`` rows of ``epochs`` passes on the CPU, and the loader (closed)."""
    quiet_dali_logs()
    run = RunOptions(device="cpu", py_num_workers=workers)
    loader = DALILoader(dataset, TinySpec(), batch_size=BATCH, batch_format=INDEXED, run=run, data=data)
    try:
        rows = [[row for batch in loader for row in batch_rows(batch)] for _ in range(epochs)]
    finally:
        loader.close()
    return rows, loader


@pytest.mark.timeout(120)
def test_stage_to_reads_the_staged_copy_and_the_same_samples(tmp_path):
    source = write_dataset(tmp_path / "src", N, fmt="hdf5")
    expected, _ = read_epochs(source)
    local = DataOptions(stage_to=tmp_path / "local")
    rows, loader = read_epochs(source, data=local)
    assert loader.store.root == tmp_path / "local" and loader.staged.copied
    assert rows == expected
    _, second = read_epochs(source, epochs=1, data=local)
    assert second.staged.reused and second.staged.copied == []


@pytest.mark.timeout(240)
def test_two_ddp_ranks_on_one_node_stage_once(tmp_path):
    source = write_dataset(tmp_path / "src", N, fmt="lmdb")
    dest = tmp_path / "node-local"
    mp.start_processes(
        staging_rank,
        args=(2, free_port(), str(source), str(dest), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    shards = sorted(p.name for p in source.glob("shard-*"))
    copied = [sorted(r["copied"]) for r in reports]
    assert sorted(copied) == [[], shards]  # one rank copied every shard, the other copied nothing
    assert [r["reused"] for r in reports].count(True) == 1
    assert all(r["root"] == str(dest) for r in reports)
    seen = sorted(i for r in reports for batch in r["indices"] for i in batch)
    assert set(seen) == set(range(N))  # the job read the whole dataset, from the staged copy
    assert (dest / MANIFEST_NAME).read_bytes() == (source / MANIFEST_NAME).read_bytes()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "tfrecord"])
def test_ram_cache_gives_the_samples_read_from_disk(tmp_path, fmt):
    source = write_dataset(tmp_path / "src", N, fmt=fmt)
    expected, _ = read_epochs(source)
    quiet_dali_logs()
    loader = DALILoader(
        source, TinySpec(), batch_size=BATCH, batch_format=INDEXED, run=RunOptions(device="cpu", py_num_workers=1),
        data=RAM,
    )  # fmt: skip
    cache = loader.cache
    assert sorted(cache.copies) == [0, 1, 2, 3] and cache.on_disk == []
    assert cache.folder.parent == Path("/dev/shm")
    rows = [[row for batch in loader for row in batch_rows(batch)] for _ in range(2)]
    if fmt == "lmdb":  # the worker maps the cached copies, not the originals
        maps = Path(f"/proc/{loader.worker_pids[0]}/maps").read_text()
        assert str(cache.folder) in maps and str(source) not in maps
    loader.close()
    assert rows == expected
    assert not cache.folder.exists()  # closing the loader frees the memory


@pytest.mark.timeout(120)
def test_ram_cache_keeps_to_its_budget_and_reads_the_rest_from_disk(tmp_path):
    source = write_dataset(tmp_path / "src", N, fmt="lmdb")
    sizes = [p.stat().st_size for p in sorted(source.glob("shard-*"))]
    budget = sizes[0] + sizes[1] + sizes[2] // 2  # two shards and half of the third
    expected, _ = read_epochs(source)
    rows, loader = read_epochs(source, data=DataOptions(cache="ram", cache_bytes=budget))
    assert sorted(loader.cache.copies) == [0, 1] and loader.cache.on_disk == [2, 3]
    assert loader.cache.bytes == sizes[0] + sizes[1] <= budget
    assert rows == expected


@pytest.mark.timeout(120)
def test_ram_cache_without_shuffle_holds_only_this_ranks_shards(tmp_path):
    source = write_dataset(tmp_path / "src", 28, fmt="tfrecord", samples_per_shard=7)
    quiet_dali_logs()
    # 28 samples on 2 ranks, unshuffled: rank 0 reads samples 0-2, 6-8, ... (batches of 3 in turn)
    loader = DALILoader(
        source,
        TinySpec(),
        batch_size=BATCH,
        shuffle=False,
        batch_format=INDEXED,
        run=RunOptions(device="cpu", rank=1, world_size=2, py_num_workers=0),
        data=RAM,
    )
    try:
        read = sorted({i for batch in loader for i in batch["index"].tolist()})
        shards = sorted({i // 7 for i in read})
        assert sorted(loader.cache.copies) == shards
    finally:
        loader.close()


def test_a_budget_beyond_free_memory_is_capped(tmp_path, caplog):
    source = write_dataset(tmp_path / "src", 8, fmt="lmdb")
    from dali_pipes.staging.ramcache import cache_in_ram
    from dali_pipes.stores import open_store

    store, cache = cache_in_ram(open_store(source), [0, 1], cache_bytes=1 << 62, progress=False)
    try:
        # The room measured (free memory and tmpfs space), less the reserve always left free.
        assert cache.room > 0
        assert cache.budget == cache.room - max(RESERVE_MIN, int(cache.room * RESERVE_SHARE))
        assert "caching at most" in caplog.text
    finally:
        store.close()
        cache.close()


@pytest.mark.parametrize(("local_world_size", "sharers"), [("2", 2), (None, 4)])
def test_the_default_budget_is_split_between_the_ranks_of_a_node(tmp_path, monkeypatch, local_world_size, sharers):
    # Each rank of a node measures the same free memory at the same moment: half of it each would ask for
    # world_size/2 times what there is. Without LOCAL_WORLD_SIZE the whole world is taken to be on this node.
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    source = write_dataset(tmp_path / "src", 8, fmt="lmdb")
    run = RunOptions(device="cpu", rank=1, world_size=4, py_num_workers=0)
    loader = DALILoader(source, TinySpec(), batch_size=2, run=run, data=RAM)
    try:
        assert loader.cache.budget == int(loader.cache.room * DEFAULT_SHARE / sharers)
    finally:
        loader.close()


def test_cache_folders_of_killed_loaders_are_removed(tmp_path):
    import fcntl

    from dali_pipes.staging.tmpfs import OWNER_LOCK

    # A folder whose owner lock is free (its loader was killed), and one whose lock is held.
    orphan = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}1-", dir="/dev/shm"))
    (orphan / OWNER_LOCK).touch()
    (orphan / "shard").write_bytes(b"x" * 10)
    alive = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}1-", dir="/dev/shm"))
    with open(alive / OWNER_LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            source = write_dataset(tmp_path / "src", 8, fmt="lmdb")
            _, loader = read_epochs(source, epochs=1, workers=0, data=RAM)
            assert not orphan.exists() and alive.exists()
            assert not loader.cache.folder.exists()  # its own, removed at close
        finally:
            shutil.rmtree(orphan, ignore_errors=True)
            shutil.rmtree(alive, ignore_errors=True)


FALLBACK_SCRIPT = """
import resource, signal, sys
from dali_pipes.staging.ramcache import cache_in_ram
from dali_pipes.stores import open_store
sys.path.insert(0, sys.argv[3])
from loader_helpers import sample_digests, _digest
import hashlib

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
store, cache = cache_in_ram(open_store(sys.argv[1]), range(4), cache_bytes=1 << 30, progress=False)
digests = [_digest(store[i], hashlib) for i in range(len(store))]
print(sorted(cache.copies), cache.on_disk, sorted(p.name for p in cache.folder.iterdir()))
print(digests == sample_digests(sys.argv[1]))
"""


def test_a_cache_copy_that_fails_to_write_falls_back_to_disk(tmp_path):
    source = write_dataset(tmp_path / "src", N, fmt="tfrecord")
    sizes = [p.stat().st_size for p in sorted(source.glob("shard-*.tfrecord"))]
    # Files may not grow past the smallest shard (the last): the first shard's copy fails half-way.
    proc = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT, str(source), str(sizes[-1]), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[] [0, 1, 2, 3] ['.owner.lock']", "True"]  # no partial copy left
    assert "the remaining shards are read from disk" in proc.stderr


def own_cache_folders() -> list[Path]:
    """This process's RAM cache folders in /dev/shm."""
    return sorted(Path("/dev/shm").glob(f"{FOLDER_PREFIX}{os.getpid()}-*"))


class ClashingSpec(TinySpec):
    """A spec whose build fails after the cache is made: it returns a name the loader adds itself."""

    def build(self, inputs, *, device):
        return {**super().build(inputs, device=device), "is_pad": inputs["label"]}


def test_a_loader_that_fails_to_start_removes_its_ram_cache(tmp_path):
    source = write_dataset(tmp_path / "src", 8, fmt="lmdb")
    before = own_cache_folders()
    with pytest.raises(ValueError, match="a name the loader adds itself") as failure:
        DALILoader(source, ClashingSpec(), batch_size=2, run=RunOptions(device="cpu", py_num_workers=0), data=RAM)
    assert failure.traceback  # the failed loader is still referenced from here, so no finalizer ran yet
    assert own_cache_folders() == before


def test_a_damaged_shard_met_while_caching_leaves_no_cache(tmp_path):
    from dali_pipes.staging.ramcache import cache_in_ram
    from dali_pipes.staging.stage import StageError
    from dali_pipes.stores import open_store

    source = write_dataset(tmp_path / "src", 8, fmt="tfrecord")
    shard = sorted(source.glob("shard-*.tfrecord"))[1]
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF  # same size, other content
    shard.write_bytes(bytes(raw))
    before = own_cache_folders()
    with pytest.raises(StageError, match=f"{shard}: SHA-256 does not match") as failure:
        cache_in_ram(open_store(source), range(2), progress=False)
    assert failure.traceback
    assert own_cache_folders() == before


HOLD_A_FOLDER = """
import sys, time
from dali_pipes.staging.tmpfs import OwnedFolder
folder = OwnedFolder(sys.argv[1])
(folder.path / "staged-shard").write_bytes(b"x" * 1000)
print(folder.path, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_a_killed_benchs_staging_folder_is_removed_by_the_next(tmp_path):
    import signal

    from dali_pipes.bench.suites.storage import STAGE_PREFIX
    from dali_pipes.staging.tmpfs import OwnedFolder

    proc = subprocess.Popen([sys.executable, "-c", HOLD_A_FOLDER, STAGE_PREFIX], stdout=subprocess.PIPE, text=True)
    try:
        killed = Path(proc.stdout.readline().strip())
        assert killed.name.startswith(STAGE_PREFIX) and (killed / "staged-shard").exists()
        following = OwnedFolder(STAGE_PREFIX)  # its owner is alive: kept
        assert killed.exists()
        following.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        following = OwnedFolder(STAGE_PREFIX)
        try:
            assert not killed.exists()
            assert following.path.exists()
        finally:
            following.close()
        assert not following.path.exists()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_folder_whose_maker_died_before_locking_it_is_removed_later(tmp_path):
    import time

    from dali_pipes.staging.tmpfs import OWNER_LOCK, UNLOCKED_GRACE_S, OwnedFolder

    prefix = "dali-pipes-test-unlocked-"
    young = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))  # as if being made right now
    old = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    then = time.time() - 2 * UNLOCKED_GRACE_S
    os.utime(old, (then, then))  # its maker was killed between mkdtemp and the lock
    try:
        owned = OwnedFolder(prefix)
        assert young.exists() and not old.exists()
        assert (owned.path / OWNER_LOCK).exists()
        owned.close()
    finally:
        shutil.rmtree(young, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def test_errors_reading_a_cached_shard_name_the_datasets_shard_not_the_copy(tmp_path):
    from dali_pipes.staging.ramcache import cache_in_ram
    from dali_pipes.stores import StoreError, open_store

    source = write_dataset(tmp_path / "src", 8, fmt="tfrecord")
    store, cache = cache_in_ram(open_store(source), range(2), progress=False)
    try:
        copy = cache.copies[0]
        with open(copy, "r+b") as f:  # the copy shrinks after it was checked (as a full tmpfs could leave it)
            f.truncate(copy.stat().st_size - 10)
        with pytest.raises(StoreError) as failure:
            store[0]
        shard = source / json.loads((source / MANIFEST_NAME).read_text())["shards"][0]["path"]
        assert str(shard) in str(failure.value) and str(copy) not in str(failure.value)
        assert str(copy) in str(failure.value.__cause__)  # the copy is still in the chained error
    finally:
        store.close()
        cache.close()
