"""The loader streaming a dataset from the loopback S3-protocol server through a bounded cache (a prototype).

A dataset ten times the cache's limit, in many small LMDB shards, read with ``DataOptions(stream=StreamOptions(
cache_limit=...))`` on the CPU by the loader's own process: every sample exactly once per epoch, the
cache's peak within its limit, a second epoch, and a resume mid-epoch. See dali_pipes/loading/streaming.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from test_remote_stage import upload

from dali_pipes import BatchFormat, DALILoader, DataOptions, LoaderError, RunOptions, StreamOptions
from dali_pipes.loading.stream_engine import THREAD_NAME
from dali_pipes.loading.stream_setup import STREAM_FOLDER
from dali_pipes.sampling import num_batches

from loader_helpers import TinySpec, batch_rows, quiet_dali_logs, stream_worker, write_dataset

SHARD = 12288  # every LMDB shard of 4 samples here: 3 pages
SHARDS = 80
N = SHARDS * 4 - 2  # the last shard shorter: the last batch pads
LIMIT = SHARDS * SHARD // 10
BATCH = 8
RUN = RunOptions(device="cpu", py_num_workers=0)
INDEXED = BatchFormat(with_index=True)


@pytest.fixture
def streamed(tmp_path, s3, monkeypatch) -> tuple[str, DataOptions]:
    """The dataset's URL in the bucket and the options that stream it; the cache under tmp_path."""
    quiet_dali_logs()
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    source = write_dataset(tmp_path / "src", N, fmt="lmdb", samples_per_shard=4)
    assert sum(p.stat().st_size for p in source.glob("shard-*")) == SHARDS * SHARD
    return upload(s3, source), DataOptions(stream=StreamOptions(cache_limit=LIMIT), storage_options=s3.options)


def stream_loader(url: str, data: DataOptions) -> DALILoader:
    return DALILoader(url, TinySpec(), batch_size=BATCH, seed=3, batch_format=INDEXED, run=RUN, data=data)


def open_but_evicted(loader: DALILoader) -> list[str]:
    """The shards whose reader is open though the cache no longer holds them (a reader opens on its first read)."""
    return [r.path.name for r in loader.store.shard_readers if r._pid is not None and not Path(r.path).exists()]


def shard_gets(s3) -> list[str]:
    """The shard files the server was asked for (GET), one name per request."""
    return sorted(path.rsplit("/", 1)[1] for method, path in s3.proxy.requests if method == "GET" and "/shard-" in path)


def real_indices(batches) -> list[int]:
    return [row[0] for batch in batches for row in batch_rows(batch) if not row[2]]


@pytest.mark.timeout(120)
def test_one_epoch_reads_every_sample_once_within_the_limit_and_a_second_epoch_works(s3, streamed):
    url, data = streamed
    with stream_loader(url, data) as loader:
        assert loader.store.root.parent.name == STREAM_FOLDER
        order = loader.sampling
        assert 1 <= order.node_window < SHARDS
        rows = []
        for batch in loader:
            rows.extend(batch_rows(batch))
            assert not open_but_evicted(loader)
        gets = shard_gets(s3)
        # Each shard once, but the next epoch's first shards (which DALI reads ahead into, and the shards fetched
        # ahead of them). The last batch's padding comes from the epoch's end, which the cache holds: it downloads
        # nothing (issue 54 item 5; it was the epoch's first samples, long evicted).
        ahead = loader.store.streamer.ahead
        assert set(gets) == {f"shard-{k:05d}.lmdb" for k in range(SHARDS)}
        # DALI reads at most 6 batches ahead into the next epoch: the shards of their windows and those fetched
        # ahead of them may come again.
        spans = order.node_windows(1)[0]
        early = [k for span in spans if span.start < 6 * BATCH for k in span.shards]
        later = [k for span in spans if span.start >= 6 * BATCH for k in span.shards]
        following = {f"shard-{k:05d}.lmdb" for k in early + later[:ahead]}
        again = {name for name in gets if gets.count(name) > 1}
        assert again <= following, again
        assert len(gets) <= SHARDS + len(following)
        assert sorted(row[0] for row in rows if not row[2]) == list(range(N))
        assert all(label == index % 5 for index, label, _, _ in rows)
        second = real_indices(loader)
        assert sorted(second) == list(range(N)) and second != [row[0] for row in rows if not row[2]]
        assert loader.cache.peak_bytes <= LIMIT
    held = sum(p.stat().st_size for p in Path(loader.store.root).glob("shard-*"))
    assert 0 < held <= LIMIT


@pytest.mark.timeout(120)
def test_a_state_saved_mid_epoch_resumes_the_rest_of_it(streamed):
    url, data = streamed
    with stream_loader(url, data) as loader:
        first, stream = [], iter(loader)
        for _ in range(7):
            first.append(next(stream))
        state = loader.state_dict()
    with stream_loader(url, data) as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert resumed.cache.peak_bytes <= LIMIT
    seen = real_indices(first) + real_indices(rest)
    assert sorted(seen) == list(range(N))
    # A cache of another size gives other windows: the rest of the saved epoch keeps the saved ones.
    wider = DataOptions(stream=StreamOptions(cache_limit=2 * LIMIT), storage_options=data.storage_options)
    with stream_loader(url, wider) as other:
        assert other.sampling.node_window > state["stream"]["window"]
        # A state of 0.2's streamed order (shard windows over the whole dataset, no partitions) as it wrote them.
        former = {k: v for k, v in state.items() if k != "stream"}
        former["sampling"] = {
            "shard_sizes_sha256": state["sampling"]["shard_sizes_sha256"],
            "window": 3,
            "shuffle": True,
        }
        with pytest.raises(ValueError, match=r"saved by dali-pipes 0.2.*set_epoch\(epoch\)"):
            other.load_state_dict(former)
        other.load_state_dict({**former, "epoch": 4, "samples_consumed": N})  # an epoch's end: the next one starts
        assert other.epoch == 5 and len(other) == other.batches_per_epoch
        other.load_state_dict(state)
        assert sorted(real_indices(other)) == sorted(real_indices(rest))  # read more partitions at once


def test_windows_of_fewer_samples_than_a_batch_are_read_within_the_limit(tmp_path, monkeypatch, caplog):
    # 40 shards of one sample, a cache of 3.9 of them: a batch of 4 touches 4 windows of one shard, which pinned
    # together pass the limit (a LoaderError before): the batch pins two and reads the others shard by shard.
    import logging

    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    source = write_dataset(tmp_path / "src", 40, fmt="lmdb", samples_per_shard=1)
    limit = int(3.9 * max(p.stat().st_size for p in source.glob("shard-*")))
    data = DataOptions(stream=StreamOptions(cache_limit=limit, loaders=1))
    caplog.set_level(logging.DEBUG, logger="dali_pipes.staging.stream_cache")  # its downloads, named by thread
    with caplog.at_level(logging.DEBUG, logger="dali_pipes.loading.stream_setup"):
        with DALILoader(str(source), TinySpec(), batch_size=4, batch_format=INDEXED, run=RUN, data=data) as loader:
            assert sorted(real_indices(loader)) == list(range(40))
            assert loader.cache.peak_bytes <= limit
            # Issue 56: those reads (and the padding's) fetched on the reading thread; now they wait for the engine.
            assert loader.store.streamer.blocked_reads > 0
    assert "holds as few as 1 samples, fewer than the 4 of a step" in caplog.text
    downloads = [r for r in caplog.records if "downloaded shard-" in r.getMessage()]
    assert len(downloads) >= 40 and {r.threadName for r in downloads} == {THREAD_NAME}


def test_streaming_refuses_what_it_does_not_do_by_name(tmp_path, streamed):
    url, data = streamed
    with pytest.raises(TypeError, match=r"StreamOptions\(cache_limit=BYTES\)"):
        DataOptions(stream=True)
    with pytest.raises(TypeError, match="cache_limit"):
        StreamOptions()
    with pytest.raises(ValueError, match="StreamOptions.cache_limit must be a positive whole number"):
        StreamOptions(cache_limit=1.5)
    with pytest.raises(ValueError, match="StreamOptions.fetch_ahead"):
        StreamOptions(cache_limit=LIMIT, fetch_ahead=-1)
    with pytest.raises(ValueError, match="StreamOptions.downloads"):
        StreamOptions(cache_limit=LIMIT, downloads=0)
    with pytest.raises(ValueError, match="stage_to"):
        DataOptions(stream=StreamOptions(cache_limit=LIMIT), stage_to=tmp_path / "x")
    with pytest.raises(ValueError, match="cache='ram'"):
        DataOptions(stream=StreamOptions(cache_limit=LIMIT), cache="ram")
    with pytest.raises(ValueError, match=r"reads whole batches: leave RunOptions\(batch_reads=True\)"):
        DALILoader(url, TinySpec(), batch_size=BATCH, run=dataclasses.replace(RUN, batch_reads=False), data=data)
    from dali_pipes import Mixture
    from dali_pipes.sampling import WeightedSampling

    with pytest.raises(ValueError, match="Mixture datasets 'a' and 'b' are one dataset"):
        DALILoader(Mixture({"a": url, "b": url}), TinySpec(), batch_size=BATCH, run=RUN, data=data)
    with pytest.raises(ValueError, match=f"WeightedSampling has 3 weights but the dataset has {N} samples"):
        DALILoader(url, TinySpec(), batch_size=BATCH, run=RUN, data=data, sampling=WeightedSampling([1.0] * 3))


@pytest.mark.slow  # a process of its own or a second loader: the slow stage (the default suite stays within its time)
@pytest.mark.timeout(120)
def test_the_cache_folder_the_shards_fetched_ahead_and_the_downloads_are_the_users_to_set(tmp_path, s3, streamed):
    url, data = streamed
    stream = StreamOptions(cache_limit=LIMIT, folder=tmp_path / "nvme", fetch_ahead=1, downloads=2)
    wide = DataOptions(stream=stream, storage_options=data.storage_options)
    with stream_loader(url, wide) as loader, stream_loader(url, data) as default:
        assert Path(loader.store.root).parent == tmp_path / "nvme"
        assert loader.store.streamer.ahead == 1 and default.store.streamer.ahead == default.sampling.node_window
        assert sorted(real_indices(loader)) == list(range(N))
        assert loader.cache.peak_bytes <= LIMIT
    with pytest.raises(ValueError, match="StreamOptions.fetch_ahead=.* does not fit"):
        stream_loader(
            url,
            DataOptions(
                stream=StreamOptions(cache_limit=LIMIT, fetch_ahead=SHARDS), storage_options=data.storage_options
            ),
        )


@pytest.mark.slow  # a process of its own or a second loader: the slow stage (the default suite stays within its time)
@pytest.mark.timeout(120)
def test_a_loader_dropped_without_close_releases_its_pins_and_its_thread(streamed):
    import gc

    def fetch_threads() -> int:
        return sum(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())

    url, data = streamed
    before = fetch_threads()
    loader = stream_loader(url, data)
    next(iter(loader))
    del loader
    gc.collect()
    deadline = time.monotonic() + 10
    while fetch_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fetch_threads() == before
    # Its pins gone: another loader's windows fit (they would not beside the dropped one's).
    with DALILoader(url, TinySpec(), batch_size=BATCH, seed=4, batch_format=INDEXED, run=RUN, data=data) as other:
        assert sorted(real_indices(other)) == list(range(N))


@pytest.mark.timeout(120)
def test_close_does_not_wait_for_the_downloads_ahead(s3, streamed):
    # A Ctrl-C or close() while the next window downloads from a hung server returns at once; the cache is
    # released when those downloads end.

    url, data = streamed
    # One partition, one loader: windows one after the other, the first batches in window 0.
    wide = dataclasses.replace(data, stream=StreamOptions(cache_limit=3 * LIMIT, partitions=1, loaders=1))
    loader = stream_loader(url, wide)
    assert 4 * BATCH < 4 * loader.sampling.node_window  # what DALI reads ahead of the first batch (4 samples a shard)
    ahead = loader.sampling.node_windows(0)[0][1].shards
    s3.proxy.stall = 60.0
    s3.proxy.add("stall", path="|".join(rf"shard-{k:05d}\.lmdb$" for k in ahead), times=None)
    next(iter(loader))
    deadline = time.monotonic() + 30
    while not any(f"shard-{ahead[0]:05d}" in path for _, path in s3.proxy.requests) and time.monotonic() < deadline:
        time.sleep(0.05)  # the fetching thread is held by the server
    start = time.monotonic()
    loader.close()
    assert time.monotonic() - start < 15  # not the 60 s the server holds the download
    s3.proxy.clear()  # the server answers: the downloads end, then the thread releases the cache
    deadline = time.monotonic() + 30
    while any(t.name == THREAD_NAME for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == THREAD_NAME for t in threading.enumerate())
    with stream_loader(url, wide) as again:  # the folder is free: a loader of the same job reads it
        assert sorted(real_indices(again)) == list(range(N))


def run_ranks(world_size: int, url: str, out_dir: Path, **options) -> list[dict]:
    """``world_size`` ranks as processes of their own reading ``url`` at once through the node's one cache folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    options.setdefault("batch_size", 4)
    mp.start_processes(
        stream_worker, args=(world_size, url, str(out_dir), options), nprocs=world_size, join=True, start_method="spawn"
    )
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(world_size)]


def real_of(report: dict) -> list[int]:
    return [i for indices, pads in report["batches"] for i, pad in zip(indices, pads) if not pad]


@pytest.mark.timeout(240)
@pytest.mark.slow  # processes of their own; one rank and a process group of 2 stay in the default suite
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_of_one_node_read_every_sample_once_within_the_shared_limit(tmp_path, streamed, world_size):
    # Processes without a process group: nothing keeps them in lockstep, yet the node's pins stay within the limit.
    # Each rank may read its own windows then: the limit holds each rank's (3 shards of each of 2 loaders a rank).
    url, data = streamed
    options = {"stream": {"cache_limit": 3 * LIMIT}, "storage": data.storage_options}
    reports = run_ranks(world_size, url, tmp_path / "out", **options)
    assert sorted(sum((real_of(r) for r in reports), [])) == list(range(N))
    expected = num_batches(N, 4, world_size)
    assert [len(r["batches"]) for r in reports] == [expected] * world_size == [r["len"] for r in reports]
    assert all(r["limit"] == 3 * LIMIT and 0 < r["peak"] <= 3 * LIMIT for r in reports)
    assert len({r["window"] for r in reports}) == 1  # one order: every rank sized its window alike


@pytest.mark.slow  # 10 s of five processes; a resume on one rank stays in the default suite
@pytest.mark.timeout(240)
def test_a_state_saved_mid_epoch_on_two_ranks_resumes_on_three(tmp_path, streamed):
    url, data = streamed
    # Without a process group each rank's windows have their room: other windows on 3 ranks, the saved ones kept.
    options = {"stream": {"cache_limit": 3 * LIMIT}, "storage": data.storage_options}
    first = run_ranks(2, url, tmp_path / "two", **options, stop=9)
    assert first[0]["state"] == first[1]["state"] and first[0]["state"]["samples_consumed"] == 9 * 4 * 2
    rest = run_ranks(3, url, tmp_path / "three", **options, state=first[0]["state"])
    seen = sum((real_of(r) for r in first + rest), [])
    assert sorted(seen) == list(range(N))
    assert len({len(r["batches"]) for r in rest}) == 1
    assert all(r["peak"] <= 3 * LIMIT for r in first + rest)


@pytest.mark.timeout(240)
def test_ranks_with_other_limits_agree_on_one_window_in_a_process_group(tmp_path, streamed):
    # Two "nodes" (a cache folder each) whose limits give different windows: alone they would read different
    # orders (samples twice, others never); in a gloo process group they agree on the smaller window.
    url, data = streamed
    narrow = {"cache_limit": LIMIT, "node_ranks": 1, "folder": str(tmp_path / "node-0")}
    wide = {"cache_limit": 3 * LIMIT, "node_ranks": 1, "folder": str(tmp_path / "node-1")}
    options = {"stream": [narrow, wide], "storage": data.storage_options, "group": True}
    reports = run_ranks(2, url, tmp_path / "out", **options)
    assert reports[0]["window"] == reports[1]["window"]
    assert sorted(sum((real_of(r) for r in reports), [])) == list(range(N))
    assert [r["peak"] <= r["limit"] for r in reports] == [True, True] and reports[1]["limit"] == 3 * LIMIT


def test_a_rank_finds_its_node_as_torchrun_numbers_them(tmp_path, streamed, monkeypatch):
    from dali_pipes.loading.stream_layout import node_ranks, rank_place
    from dali_pipes.sampling import EpochRules, World

    url, data = streamed
    assert node_ranks(data.stream, 4) == 4  # without a launcher's word: the job on one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_ranks(data.stream, 4) == 2 and node_ranks(data.stream, 1) == 1
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=2 ranks run on this node"):
        node_ranks(StreamOptions(cache_limit=LIMIT, node_ranks=1), 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="6 ranks do not fill nodes of 4"):
        node_ranks(StreamOptions(cache_limit=LIMIT, node_ranks=4), 6)
    place = rank_place(StreamOptions(cache_limit=LIMIT, node_ranks=2), EpochRules(8, World(3, 4)))
    assert (place.node, place.local_rank, place.layout.nodes, place.layout.ranks) == (1, 1, 2, 2)
    monkeypatch.setenv("GROUP_RANK", "0")
    with pytest.raises(ValueError, match="GROUP_RANK=0"):
        rank_place(StreamOptions(cache_limit=LIMIT, node_ranks=2), EpochRules(8, World(3, 4)))
    small = DataOptions(stream=StreamOptions(cache_limit=5 * SHARD), storage_options=data.storage_options)
    with pytest.raises(ValueError, match=f"raise cache_limit to at least {6 * SHARD} bytes.*loaders=1"):
        DALILoader(url, TinySpec(), batch_size=BATCH, run=RUN, data=small)


def test_ranks_whose_windows_hold_less_than_a_step_pin_within_their_share_or_are_refused(tmp_path):
    # Windows of one sample and a batch of 4 on 8 ranks of a process group: each rank's batch lies in windows of its
    # own, so each pins within its share of its loader's room; below one shard a rank, refused by name.
    import torch.distributed as dist

    from dali_pipes.loading.stream_setup import _read_cap
    from dali_pipes.staging.stream_cache import ShardCache

    source = write_dataset(tmp_path / "src", 40, fmt="lmdb", samples_per_shard=1)
    largest = max(p.stat().st_size for p in source.glob("shard-*"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for shards, cap in ((40, 40 * largest // 16 - largest), (6, None)):
            stream = StreamOptions(cache_limit=shards * largest)
            with ShardCache(source, tmp_path / f"cache-{shards}", stream.cache_limit) as cache:
                if cap is None:
                    with pytest.raises(ValueError, match=f"raise cache_limit to at least {16 * largest} bytes"):
                        _read_cap(cache, stream, 1, 4, 8, "ds")
                else:
                    assert _read_cap(cache, stream, 1, 4, 8, "ds") == cap  # 8 ranks x 2 loaders share the limit
                    assert _read_cap(cache, stream, 8, 4, 1, "ds") == 16 * largest  # a window holds the step: two
    finally:
        dist.destroy_process_group()


def test_a_local_dataset_has_one_cache_folder_however_its_path_is_written(tmp_path, monkeypatch):
    from dali_pipes.loading.stream_setup import stream_folder

    (tmp_path / "ds").mkdir()
    monkeypatch.chdir(tmp_path)
    assert stream_folder("ds") == stream_folder("./ds") == stream_folder(tmp_path / "ds")
    assert stream_folder("s3://bucket/ds") != stream_folder("ds")


@pytest.mark.slow  # waits on the real retries (their default number and pauses)
@pytest.mark.timeout(120)
def test_a_shard_that_keeps_failing_is_asked_for_a_bounded_number_of_times(s3, streamed):
    # Issue 54 item 6: the fetch ahead, the batch's read and the read sample by sample each tried it again,
    # every try retried: 15 requests here. The retry settings are the defaults.
    from dali_pipes.remote.transfer import ATTEMPTS

    url, data = streamed
    with stream_loader(url, data) as loader:
        bad = loader.sampling.node_windows(0)[0][1].shards[0]  # fetched ahead while window 0 is read
        name = f"shard-{bad:05d}.lmdb"
        s3.proxy.add("corrupt", path=rf"/{name}$", times=None)  # every answer damaged on the way
        with pytest.raises(LoaderError, match=rf"{name}: .*gave up after {ATTEMPTS} request\(s\) for {name}"):
            real_indices(loader)
    assert shard_gets(s3).count(name) == ATTEMPTS


# --- loaders sharing a node's cache folder (issue 54 item 3) --------------------------------------------------


@pytest.mark.slow  # two epochs of two loaders
@pytest.mark.timeout(240)
def test_a_training_and_an_evaluation_loader_read_in_turn_by_one_thread(s3, streamed):
    # Each sizes its window and the shards it fetches ahead by the whole limit: together they asked for more, and
    # the evaluation loader's first pin was refused. Now the shards fetched ahead are given up for the other's window.
    url, data = streamed
    with stream_loader(url, data) as train:
        evaluation = DALILoader(url, TinySpec(), batch_size=BATCH, seed=5, batch_format=INDEXED, run=RUN, data=data)
        with evaluation:
            assert train.sampling.node_window == evaluation.sampling.node_window and train.store.streamer.ahead > 0
            seen: dict[str, list[int]] = {"train": [], "eval": []}
            streams = {"train": iter(train), "eval": iter(evaluation)}
            while streams:
                for which, stream in list(streams.items()):  # a batch of each in turn, the evaluation 3 at a time
                    for _ in range(1 if which == "train" else 3):
                        batch = next(stream, None)
                        if batch is None:
                            del streams[which]
                            break
                        seen[which] += real_indices([batch])
            assert train.cache.peak_bytes <= LIMIT
    assert sorted(seen["train"]) == sorted(seen["eval"]) == list(range(N))
    assert seen["train"] != seen["eval"]  # two orders (two seeds), one cache folder


@pytest.mark.slow  # processes of their own
@pytest.mark.timeout(240)
def test_two_single_rank_jobs_of_a_sweep_share_the_default_cache_folder(tmp_path, streamed):
    from stream_cache_helpers import solo_stream

    url, data = streamed
    options = {"stream": {"cache_limit": LIMIT}, "storage": data.storage_options}
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(solo_stream, args=(url, str(out), options), nprocs=2, join=True, start_method="spawn")
    reports = [json.loads((out / f"job-{k}.json").read_text()) for k in range(2)]
    assert [sorted(r["real"]) for r in reports] == [list(range(N))] * 2
    assert all(0 < r["peak"] <= r["limit"] == LIMIT for r in reports)


@pytest.mark.slow  # waits for held downloads
@pytest.mark.timeout(240)
def test_a_loader_made_again_right_after_close_reads_its_epoch(s3, streamed):
    # The first loader's downloads ahead are held by the server when it closes: its pins stayed until they ended.

    url, data = streamed
    loader = stream_loader(url, data)
    ahead = [k for span in loader.sampling.node_windows(0)[0][2:4] for k in span.shards]
    s3.proxy.stall = 5.0
    s3.proxy.add("stall", path="|".join(rf"shard-{k:05d}\.lmdb$" for k in ahead), times=len(ahead))
    next(iter(loader))
    loader.close()
    with stream_loader(url, data) as again:
        assert sorted(real_indices(again)) == list(range(N))
        assert again.cache.peak_bytes <= LIMIT
