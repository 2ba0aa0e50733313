"""Reader processes of a streamed loader (issue 56 item 2): ``py_num_workers=2`` reading a dataset three times the
cache from the loopback S3-protocol server, by the pins of the loader's process (dali_pipes/loading/stream_readers.py).

Every sample once per epoch, fork and spawn, the cache within its limit, no more downloads than a loader without
reader processes makes, a resume mid-epoch exact; a reader process killed mid-epoch (the loader says so, a new one
resumes the rest and the dead process left no pin); a shard that cannot be downloaded (its name in the error, no
hang); a streamed 70/30 mixture read by reader processes (exact counts each epoch).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import test_streaming_mixture as mix
from test_remote_stage import upload
from test_streaming_loader import real_indices, shard_gets

from dali_pipes import BatchFormat, DALILoader, DataOptions, LoaderError, Mixture, RunOptions, StreamOptions
from dali_pipes.loading.loader import WorkerDiedError
from dali_pipes.staging.cache_folder import META

from loader_helpers import TinySpec, quiet_dali_logs, skip_if_fork_refused, wait_until_dead, write_dataset

SHARD = 12288  # every LMDB shard of 4 samples here: 3 pages
SHARDS = 80
N = SHARDS * 4 - 2  # the last shard shorter: the last batch pads
LIMIT = SHARDS * SHARD * 3 // 10  # 30%: the windows must hold the batches the 2 reader processes read at once
BATCH = 8
INDEXED = BatchFormat(with_index=True)


def run_options(workers: int, start_method: str | None = None) -> RunOptions:
    return RunOptions(device="cpu", py_num_workers=workers, py_start_method=start_method)


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory, s3_server) -> str:
    """The 80-shard dataset in a bucket (uploaded once for the module)."""
    source = write_dataset(tmp_path_factory.mktemp("readers") / "src", N, fmt="lmdb", samples_per_shard=4)
    assert sum(p.stat().st_size for p in source.glob("shard-*")) == SHARDS * SHARD
    return upload(s3_server, source)


@pytest.fixture
def streamed(tmp_path, s3, dataset_url, monkeypatch) -> tuple[str, DataOptions]:
    """The dataset's URL and the options that stream it; the cache under tmp_path."""
    quiet_dali_logs()
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    return dataset_url, DataOptions(stream=StreamOptions(cache_limit=LIMIT), storage_options=s3.options)


def stream_loader(url: str, data: DataOptions, run: RunOptions) -> DALILoader:
    return DALILoader(url, TinySpec(), batch_size=BATCH, seed=3, batch_format=INDEXED, run=run, data=data)


def two_epochs(loader: DALILoader) -> list[list[int]]:
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append(real_indices(loader))
    return epochs


def cache_pins(loader: DALILoader) -> dict:
    """The pins recorded in the cache's state, by holder (``<pid>-<random>``)."""
    state = json.loads((Path(loader.store.root) / META / "state.json").read_text())
    return {holder: keys for holder, keys in state["pins"].items() if any(n > 0 for n in keys.values())}


@pytest.fixture(scope="module")
def in_process_gets(tmp_path_factory, s3_server, dataset_url) -> list[list[int]]:
    """The shard GETs of two epochs read in the loader's own process, and the epochs' samples (the baseline)."""
    quiet_dali_logs()
    folder = tmp_path_factory.mktemp("baseline")
    data = DataOptions(stream=StreamOptions(cache_limit=LIMIT, folder=folder), storage_options=s3_server.options)
    s3_server.proxy.clear()
    with stream_loader(dataset_url, data, run_options(0)) as loader:
        epochs = two_epochs(loader)
        gets = shard_gets(s3_server)
    s3_server.proxy.clear()
    return gets, epochs


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_two_reader_processes_read_every_sample_once_within_the_limit_and_resume(
    s3, streamed, in_process_gets, start_method
):
    if start_method == "fork":
        skip_if_fork_refused()
    baseline_gets, baseline_epochs = in_process_gets
    url, data = streamed
    run = run_options(2, start_method)
    with stream_loader(url, data, run) as loader:
        assert len(loader.worker_pids) == 2
        epochs = two_epochs(loader)
        gets = shard_gets(s3)
        assert loader.cache.peak_bytes <= LIMIT
    for indices in epochs:
        assert sorted(indices) == list(range(N))
    assert epochs == baseline_epochs  # the same order as read in the loader's own process
    counts, baseline = Counter(gets), Counter(baseline_gets)
    # Each shard downloaded about once an epoch: the reader processes read a few batches ahead of the training
    # loop, so the windows move a little earlier than without them; not a download a batch.
    assert len(gets) <= len(baseline_gets) + SHARDS // 10, (len(gets), len(baseline_gets))
    assert max(counts.values()) <= max(baseline.values()) + 1, counts.most_common(3)
    with stream_loader(url, data, run) as loader:
        first, stream = [], iter(loader)
        for _ in range(13):
            first.append(next(stream))
        state = loader.state_dict()
    with stream_loader(url, data, run) as resumed:
        resumed.load_state_dict(state)
        rest = real_indices(resumed)
        assert resumed.cache.peak_bytes <= LIMIT
    assert real_indices(first) + rest == epochs[0]  # the rest of the epoch, sample for sample


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_reader_processes_waits_for_a_slow_shard_are_counted(s3, streamed, in_process_gets):
    # A shard half-way through epoch 0 answered 2 s late: the reader processes wait for it, and the loader says so
    # (loader.cache.blocked_s sums their waits, as the storage bench's blocked_share reads it).
    url, data = streamed
    slow = in_process_gets[1][0][N // 2] // 4  # 4 samples a shard
    s3.proxy.stall = 2.0
    s3.proxy.add("stall", path=rf"/shard-{slow:05d}\.lmdb$", times=1)
    with stream_loader(url, data, run_options(2)) as loader:
        assert sorted(real_indices(loader)) == list(range(N))
        assert loader.cache.blocked_s >= 1.0 and loader.cache.blocked_reads >= 1, loader.cache.blocked_s


def holds_its_batch(loader: DALILoader, pid: int) -> bool:
    """Whether reader process ``pid`` holds its batch's shards now (reads them: the loader keeps them pinned)."""
    return any(p.pid == pid and p.holding for p in loader.store.board.posted())


def kill_mid_epoch(loader: DALILoader, stream, pid: int) -> list:
    """Read a third of the epoch, then SIGKILL reader process ``pid`` (holding its batch's shards or waiting for
    them: tests/test_stream_board.py kills one while it holds); the batches read."""
    batches = [next(stream) for _ in range(loader.batches_per_epoch // 3)]
    os.kill(pid, signal.SIGKILL)
    return batches


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_reader_process_killed_mid_epoch_is_reported_and_a_new_loader_resumes_the_rest(streamed, in_process_gets):
    url, data = streamed
    run = run_options(2, "spawn")
    loader = stream_loader(url, data, run)
    pid = loader.worker_pids[1]
    stream = iter(loader)
    first = kill_mid_epoch(loader, stream, pid)
    state = loader.state_dict()
    wait_until_dead(pid)
    # What it held is let go once the loader's process finds it dead: no shard stays pinned for it.
    board, shard_of = loader.store.board, loader.store.streamer._shard_of
    dead = next(p for p in board.posted() if p.pid == pid)
    others = {k for p in board.posted() if p.holding and p.pid != pid for k in shard_of(p.indices).tolist()}
    assert board.release(sorted(set(shard_of(dead.indices).tolist())), shard_of) <= others
    assert not holds_its_batch(loader, pid)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"worker process {pid} .*was killed by SIGKILL"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 60  # noticed, not hung
    # A new loader made before the failed one is closed: it joins the live holders of the cache (not a fresh
    # start, which would drop every pin). It reads in its own process: the failed loader still holds its half of
    # the room.
    with stream_loader(url, data, run_options(0)) as resumed:
        resumed.load_state_dict(state)
        rest = real_indices(resumed)
        assert resumed.cache.peak_bytes <= LIMIT
        assert not [h for h in cache_pins(resumed) if h.startswith(f"{pid}-")]  # reader processes never pin
        loader.close()
        mine = resumed.store.streamer.cache._state.holder
        assert set(cache_pins(resumed)) <= {mine}  # the failed loader's pins went with its close
    assert real_indices(first) + rest == in_process_gets[1][0]  # exactly the rest of the epoch


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_shard_that_cannot_be_downloaded_is_named_by_the_reader_processes_error(s3, streamed, monkeypatch):
    import dali_pipes.remote.transfer as transfer

    monkeypatch.setattr(transfer, "BACKOFF", 0.01)
    monkeypatch.setattr(transfer, "ATTEMPTS", 2)
    url, data = streamed
    s3.proxy.add("deny", path=r"/shard-00040\.lmdb$", times=None)
    started = time.monotonic()
    with stream_loader(url, data, run_options(2)) as loader:
        with pytest.raises(LoaderError, match=r"shard-00040\.lmdb") as raised:
            for _ in loader:
                pass
    assert time.monotonic() - started < 60  # named, not hung
    assert "InvalidAccessKeyId" in str(raised.value) or "403" in str(raised.value) or "denied" in str(raised.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_batch_with_no_room_fails_its_reader_processes_instead_of_hanging(streamed):
    # Another loader of the node holds the whole room (its windows, and shards pinned by hand): the loader's
    # process cannot pin the shards its reader processes posted. They raise the cache's error (naming who holds
    # the room), as a read in the loader's process would, instead of waiting for ever for a byte that never comes.
    url, data = streamed
    with stream_loader(url, data, run_options(0)) as first:
        next(iter(first))
        cache = first.store.streamer.cache
        held = [k for k in range(SHARDS) if k not in first.store.streamer._pinned][-(LIMIT // SHARD) // 2 :]
        cache.pin(held)
        started = time.monotonic()
        with stream_loader(url, data, run_options(2)) as second:
            with pytest.raises(LoaderError, match=r"more than the cache's limit.*held by pid"):
                for _ in second:
                    pass
        assert time.monotonic() - started < 60  # named, not hung
        cache.unpin(held)


@pytest.fixture(scope="module")
def buckets(tmp_path_factory, s3_server) -> dict[str, str]:
    """The two datasets of tests/test_streaming_mixture.py, each in a bucket of its own."""
    root = tmp_path_factory.mktemp("mixture")
    return {
        name: upload(s3_server, write_dataset(root / name, size, fmt="lmdb", samples_per_shard=4))
        for name, size in mix.SIZES.items()
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_streamed_70_30_mixture_read_by_reader_processes_keeps_exact_counts(s3, buckets, tmp_path, monkeypatch):
    quiet_dali_logs()
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    mixture = Mixture(buckets, proportions={"a": 0.7, "b": 0.3}, num_samples=mix.EPOCH)
    data = DataOptions(stream=StreamOptions(cache_limit=2 * mix.LIMIT, loaders=1), storage_options=s3.options)
    with DALILoader(
        mixture, TinySpec(), batch_size=BATCH, seed=3, batch_format=INDEXED, run=run_options(2), data=data
    ) as loader:
        assert len(loader.worker_pids) == 2
        epochs = [mix.real(loader) for _ in range(2)]
        assert all(s.peak_bytes <= s.limit_bytes for s in loader.cache.by_name.values())
    for indices in epochs:
        a, b = mix.split(indices)
        assert (len(a), len(b)) == (210, 90)  # exactly 70/30, every epoch
    a, b = (x + y for x, y in zip(mix.split(epochs[0]), mix.split(epochs[1])))
    # Each dataset's first epoch read whole, each sample once, before any of it again.
    assert sorted(a[:240]) == list(range(240)) and sorted(b[:160]) == list(range(160))
    assert len(set(a[240:])) == len(a) - 240 and len(set(b[160:])) == len(b) - 160
