"""The streaming loader under faults, end to end (issue 48 item 5): the loopback S3-protocol server (moto)
behind the fault proxy of tests/s3_helpers.py, real DALI pipelines, real LMDB shards, real processes.

Faults are injected mid-epoch: 503 SlowDown and connections dropped mid-object (retried: every sample
still once), an object that stays throttled, corrupted or truncated (named, within a bounded time, the
fetch thread gone after ``close()``), a shard evicted and read again, a full cache disk, a Ctrl-C (the
next run resumes from the cached shards), and the secret key never shown.

Which thread fetched when a fault struck is read off the stacks at that moment: the reading thread
(the external source, in the loader's own process) and the fetch-ahead thread download only while
holding the streamer's lock, so at most one of them is inside ``ShardCache.fetch`` at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from s3_helpers import SECRET_KEY, options
from test_remote_stage import upload
from test_streaming_loader import INDEXED, RUN, open_but_evicted, real_indices, shard_gets

from dali_pipes import DALILoader, DataOptions, LoaderError, StreamOptions
from dali_pipes.loading.stream_engine import THREAD_NAME
from dali_pipes.sampling.partitioned import NodeLayout, PartitionedSampling, node_window_spans
from dali_pipes.staging.checked import TMP_PREFIX

from loader_helpers import TinySpec, batch_rows, grey_level, quiet_dali_logs, write_dataset

SHARD = 12288  # every LMDB shard of 4 samples here: 3 pages
SHARDS = 16
N = SHARDS * 4 - 3  # odd: on 2 ranks the last batch pads (with a sample of the epoch's end)
LIMIT = 8 * SHARD  # on 2 ranks of a node without a process group: windows of 1 shard, 1 fetched ahead
BATCH = 8
RANKS = 2
SEED = 3
FETCH_THREAD = THREAD_NAME
SCRIPT = Path(__file__).with_name("stream_fault_script.py")


@pytest.fixture
def streamed(tmp_path, s3, monkeypatch) -> tuple[str, DataOptions]:
    """A 16-shard dataset in the bucket and the options that stream it (the cache in ``tmp_path/cache``): one
    partition and one loader a node, so that a node reads its windows one after the other (:func:`spans`).

    Retries are quick (``BACKOFF``) and few (``ATTEMPTS``), and botocore's own are off (s3fs's remain):
    a fault that outlasts them all fails in a few seconds."""
    import dali_pipes.remote.transfer as transfer

    monkeypatch.setattr(transfer, "BACKOFF", 0.01)
    monkeypatch.setattr(transfer, "ATTEMPTS", 2)
    quiet_dali_logs()
    source = write_dataset(tmp_path / "src", N, fmt="lmdb", samples_per_shard=4)
    assert {p.stat().st_size for p in source.glob("shard-*")} == {SHARD}
    stream = StreamOptions(cache_limit=LIMIT, folder=tmp_path / "cache", partitions=1, loaders=1)
    config = {"connect_timeout": 3, "read_timeout": 5, "retries": {"max_attempts": 1, "mode": "standard"}}
    return upload(s3, source), DataOptions(stream=stream, storage_options=options(s3.proxy.url, config_kwargs=config))


def open_loader(url: str, data: DataOptions, rank: int = 0, world_size: int = 1) -> DALILoader:
    run = dataclasses.replace(RUN, rank=rank, world_size=world_size)
    return DALILoader(url, TinySpec(), batch_size=BATCH, seed=SEED, batch_format=INDEXED, run=run, data=data)


@contextlib.contextmanager
def job(url: str, data: DataOptions) -> Iterator[list[DALILoader]]:
    """The :data:`RANKS` ranks of a job on one node, in this process (stepped in lockstep by :func:`steps`)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(open_loader(url, data, rank, RANKS)) for rank in range(RANKS)]


def steps(loaders: list[DALILoader]) -> Iterator[list[dict]]:
    """The job's steps: one batch of every rank each."""
    yield from (list(batches) for batches in zip(*loaders, strict=True))


def name(shard: int) -> str:
    return f"shard-{shard:05d}.lmdb"


def spans(epoch: int, window: int = 1) -> list[tuple[int, ...]]:
    """The shards of each window of ``epoch`` in reading order, one partition's windows of ``window`` shards (the
    order is a pure function of its inputs)."""
    sampling = PartitionedSampling([4] * (SHARDS - 1) + [1], window, partitions=1)
    return [span.shards for span in node_window_spans(sampling, NodeLayout(), 0, epoch, SEED)]


def fetching_threads() -> list[str]:
    """The threads inside ``ShardCache.fetch`` now (their pools' threads do the downloading for them)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    found = []
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            code = frame.f_code
            if code.co_name == "fetch" and code.co_filename.endswith("stream_cache.py"):
                found.append(names.get(ident, str(ident)))
                break
            frame = frame.f_back
    return found


def record_faults(s3, monkeypatch) -> list[tuple[str, str, list[str]]]:
    """``(action, path, fetching threads)`` for each fault the proxy injects from now on."""
    seen: list[tuple[str, str, list[str]]] = []
    match = s3.proxy.match

    def recording(method: str, path: str) -> str | None:
        action = match(method, path)
        if action is not None:
            seen.append((action, path.rsplit("/", 1)[1], fetching_threads()))
        return action

    monkeypatch.setattr(s3.proxy, "match", recording)
    return seen


def check_rows(batches) -> list[tuple[int, int, bool, int]]:
    """Every row of ``batches``, checked to be the sample its index says (label and grey level)."""
    rows = [row for batch in batches for row in batch_rows(batch)]
    assert all(label == index % 5 and abs(grey - grey_level(index)) <= 4 for index, label, _, grey in rows)
    return rows


def temporaries(folder: Path) -> list[Path]:
    return list(folder.rglob(f"{TMP_PREFIX}*"))


def no_secret_in(folder: Path, *texts: str) -> None:
    files = [p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file()]
    assert not [text for text in [*texts, *files] if SECRET_KEY in text]


# --- transient faults: retried, every sample once ---------------------------------------------


@pytest.mark.timeout(90)
def test_throttling_and_dropped_connections_mid_epoch_lose_and_repeat_no_sample(s3, streamed, monkeypatch):
    url, data = streamed
    first_window = set(spans(0)[0])
    faults = record_faults(s3, monkeypatch)
    with job(url, data) as loaders:
        streamer = loaders[0].store.streamer
        assert (loaders[0].sampling.node_window, streamer.ahead) == (1, 1)
        assert [s.shards for s in loaders[0].sampling.node_windows(0)[0]] == spans(0)
        ahead_into_next = {k for shards in spans(1)[:1] for k in shards}
        assert not first_window & ahead_into_next  # so only a padding from the epoch's start would fetch them again
        rules = [s3.proxy.add("slowdown" if k % 2 else "drop", path=rf"/{name(k)}$", times=1) for k in range(SHARDS)]
        steps_read = list(steps(loaders))
        assert streamer.peak_bytes <= LIMIT
    batches = [batch for step in steps_read for batch in step]
    rows = check_rows(batches)
    assert sorted(index for index, _, pad, _ in rows if not pad) == list(range(N))
    # The last batch pads with samples of the epoch's end, which it reads anyway (issue 54 item 5): not with the
    # epoch's first, evicted long ago and downloaded again for rows thrown away.
    last = check_rows(steps_read[-1])
    assert {index // 4 for index, _, pad, _ in last if pad} <= {index // 4 for index, _, pad, _ in last if not pad}
    # Every shard met a fault, and got over it (asked for again); the first window's no more than that.
    gets = shard_gets(s3)
    assert [rule.seen for rule in rules] == [1] * SHARDS
    assert all(gets.count(name(k)) >= 2 for k in range(SHARDS)) and [gets.count(name(k)) for k in first_window] == [2]
    assert FETCH_THREAD in {thread for _, _, threads in faults for thread in threads}  # fetches ahead met faults


# --- a fault that lasts: named, in bounded time, and nothing left running ---------------------


def spoil(s3, url: str, source: Path, shard: int, how: str) -> str:
    """Make every download of ``shard`` fail ``how``; the error message expected, as a regex."""
    shown = rf"{url}/{name(shard)}"
    if how == "throttled":
        s3.proxy.add("slowdown", path=rf"/{name(shard)}$", times=None)
        return rf"{shown}: the server kept asking to slow down \(503 SlowDown\) after every retry .*try again later"
    whole = (source / name(shard)).read_bytes()
    key = f"{url.removeprefix('s3://')}/{name(shard)}"
    if how == "corrupted":  # replaced in the bucket after the loader read the manifest: a byte flipped
        s3.fs().pipe_file(key, whole[:5000] + bytes([whole[5000] ^ 1]) + whole[5001:])
        return rf"{shown}: SHA-256 does not match the manifest.*run 'dali-pipes verify' on it"
    s3.fs().pipe_file(key, whole[: SHARD // 2])
    return rf"{shown}: is {SHARD // 2} bytes, the manifest says {SHARD}.*run 'dali-pipes verify' on it"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "how",
    [pytest.param("throttled", marks=pytest.mark.slow), "corrupted", pytest.param("truncated", marks=pytest.mark.slow)],
)
def test_a_shard_that_never_downloads_is_named_and_close_leaves_nothing_running(tmp_path, s3, streamed, caplog, how):
    url, data = streamed
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="dali_pipes")  # the package's records too, which the fixture quietened
    with open_loader(url, data) as loader:
        streamer = loader.store.streamer
        last = loader.sampling.node_windows(0)[0][-1].shards[0]  # read last in the epoch: far from downloaded yet
        stream = iter(loader)
        seen = real_indices([next(stream)])
        expected = spoil(s3, url, tmp_path / "src", last, how)
        with pytest.raises(LoaderError, match=expected) as failed:
            seen += real_indices(stream)
        assert len(seen) < N and len(set(seen)) == len(seen)
        with pytest.raises(LoaderError, match="failed earlier and cannot continue"):
            iter(loader)
    assert streamer.engine.threads == 0  # closed: its download threads ended
    assert not temporaries(tmp_path / "cache") and not list((tmp_path / "cache").glob(f"*/{name(last)}"))
    no_secret_in(tmp_path / "cache", str(failed.value), caplog.text)


# --- a shard evicted and needed again ---------------------------------------------------------


@pytest.mark.slow  # a process of its own or a second loader: the slow stage (the default suite stays within its time)
@pytest.mark.timeout(90)
def test_evicted_shards_are_fetched_again_for_the_next_epoch(tmp_path, s3, streamed):
    url, data = streamed
    with job(url, data) as loaders:
        epochs = []
        for epoch in range(2):
            for loader in loaders:
                loader.set_epoch(epoch)
            epochs.append([batch for step in steps(loaders) for batch in step])
            assert not [open_but_evicted(loader) for loader in loaders if open_but_evicted(loader)]
        assert loaders[0].cache.peak_bytes <= LIMIT
    for batches in epochs:
        rows = check_rows(batches)  # the shards downloaded again hold what they held: every sample as it was
        assert sorted(index for index, _, pad, _ in rows if not pad) == list(range(N))
    gets = shard_gets(s3)
    # The cache holds at most LIMIT // SHARD shards when the second epoch begins: every other one is downloaded again.
    assert sum(gets.count(name(k)) >= 2 for k in range(SHARDS)) >= SHARDS - LIMIT // SHARD
    assert len(gets) <= 3 * SHARDS


# --- a full cache disk, a Ctrl-C: in a process of their own -----------------------------------


def start_run(tmp_path: Path, url: str, data: DataOptions, out: str, **settings) -> subprocess.Popen:
    """tests/stream_fault_script.py streaming one epoch of ``url`` into the cache folder of ``data``; its
    stderr in the file ``out`` + ``.err``."""
    settings = dict(
        url=url, storage=data.storage_options, cache_limit=LIMIT, folder=str(data.stream.folder), seed=SEED,
        partitions=data.stream.partitions, loaders=data.stream.loaders, batch_size=BATCH, out=str(tmp_path / out),
        **settings,
    )  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=open(tmp_path / f"{out}.err", "w"), text=True, env=env,
    )  # fmt: skip
    proc.stdin.write(json.dumps(settings))  # on stdin: the credentials in no command line
    proc.stdin.close()
    return proc


@pytest.mark.slow  # a process of its own or a second loader: the slow stage (the default suite stays within its time)
@pytest.mark.timeout(120)
def test_a_full_cache_disk_is_one_clear_error_naming_the_folder_and_the_limit(tmp_path, s3, streamed):
    # RLIMIT_FSIZE in the process: its writes past SHARD // 2 bytes fail as a full disk's do (EFBIG), no root needed.
    url, data = streamed
    proc = start_run(tmp_path, url, data, "full.json", fsize=SHARD // 2)
    proc.wait(timeout=90)
    stderr = (tmp_path / "full.json.err").read_text()
    assert proc.returncode == 1, stderr
    report = json.loads((tmp_path / "full.json").read_text())
    error, cache = report["error"], data.stream.folder
    assert report["type"] == "ShardReadError" and report["batches"] == []
    assert re.search(rf"{cache}/[^/ ]+: the disk is full \(File too large\) while downloading shard-\d+\.lmdb", error)
    assert f"the cache's limit is 98.3 KB ({LIMIT} bytes); free space there, lower the limit" in error
    assert error.count("the disk is full") == 1
    assert not temporaries(cache) and not list(cache.glob("*/shard-*"))
    no_secret_in(cache, error, stderr)


def resume(s3, url: str, data: DataOptions, state: dict) -> tuple[list[int], list[str]]:
    """The real indices of the rest of the epoch of ``state``, and the shards downloaded meanwhile."""
    s3.proxy.clear()
    with open_loader(url, data) as loader:
        assert loader.sampling.node_window == 3
        loader.load_state_dict(state)
        rest = real_indices(loader)
    return rest, shard_gets(s3)


@pytest.mark.slow  # 7 s of three processes
@pytest.mark.timeout(120)
def test_ctrl_c_mid_epoch_ends_the_run_and_the_next_resumes_from_the_cached_shards(tmp_path, s3, streamed):
    url, data = streamed
    s3.proxy.stall = 1.0  # every shard past the first few takes a second: Ctrl-C lands mid-epoch, mid-download
    late = [k for shards in spans(0, 3)[1:] for k in shards]  # one rank: windows of 3 shards
    s3.proxy.add("stall", path=rf"/shard-({'|'.join(f'{k:05d}' for k in late)})\.lmdb$", times=None)
    proc = start_run(tmp_path, url, data, "first.json")
    try:
        assert proc.stdout.readline().strip() == "batch 1", (tmp_path / "first.json.err").read_text()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)  # no hang: the fetch thread's downloads end, the loader closes
    finally:
        proc.kill()
        proc.stdout.close()
    stderr = (tmp_path / "first.json.err").read_text()
    assert proc.returncode in (-signal.SIGINT, 1, 130) and "KeyboardInterrupt" in stderr, stderr
    first = json.loads((tmp_path / "first.json").read_text())
    assert first["state"] is not None and "error" not in first
    folder = next(data.stream.folder.iterdir())
    kept = {int(p.name[6:11]) for p in folder.glob("shard-*.lmdb") if p.stat().st_size == SHARD}
    rest, gets = resume(s3, url, data, first["state"])
    seen = [i for indices, pads in first["batches"] for i, pad in zip(indices, pads) if not pad] + rest
    assert sorted(seen) == list(range(N))
    read = {index // 4 for index in rest}
    assert read & kept - set(gets)  # shards the interrupted run cached, read without a download
    # The same resumed run on an empty folder downloads more (the next epoch's first shards, fetched ahead, in both).
    fresh = DataOptions(
        stream=dataclasses.replace(data.stream, folder=tmp_path / "fresh"), storage_options=data.storage_options
    )
    again = resume(s3, url, fresh, first["state"])
    assert again[0] == rest and len(gets) < len(again[1])
    assert not temporaries(folder)
    no_secret_in(data.stream.folder, stderr)


# --- credentials --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_secret_key_is_in_no_log_record_message_repr_or_file(tmp_path, s3, streamed, caplog):
    url, data = streamed
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="dali_pipes")  # the fixture quietened the package: every record here
    texts = [repr(data), str(data)]
    with open_loader(url, data) as loader:
        texts.append(repr(loader))
        s3.proxy.add("drop", path=r"/shard-\d+\.lmdb$", times=1)  # retried, and logged
        s3.proxy.add("deny", path=rf"/{name(loader.sampling.node_windows(0)[0][-1].shards[0])}$", times=None)
        with pytest.raises(LoaderError, match="InvalidAccessKeyId|credentials|access") as denied:
            list(loader)
        texts.append(repr(loader))
    assert "retrying" in caplog.text or "Retryable error" in caplog.text
    no_secret_in(data.stream.folder, *texts, str(denied.value), caplog.text)


@pytest.mark.slow  # two processes of their own
@pytest.mark.timeout(240)
def test_ctrl_c_while_a_download_hangs_exits_at_once_and_the_next_run_reuses_the_folder(tmp_path, s3, streamed):
    # Issue 54 item 4: Python joined the download threads (a ThreadPoolExecutor's) at exit, and the fetch waited
    # for the downloads under way: 30 s here, as long as the server held them.
    url, data = streamed
    config = {"connect_timeout": 3, "read_timeout": 60, "retries": {"max_attempts": 1, "mode": "standard"}}
    data = dataclasses.replace(data, storage_options=options(s3.proxy.url, config_kwargs=config))
    s3.proxy.stall = 30.0  # a server that holds the downloads of the later windows (the client waits for it)
    late = [k for shards in spans(0, 3)[4:] for k in shards]  # one rank: windows of 3 shards, DALI reads ahead
    s3.proxy.add("stall", path=rf"/shard-({'|'.join(f'{k:05d}' for k in late)})\.lmdb$", times=None)
    proc = start_run(tmp_path, url, data, "first.json")
    try:
        assert proc.stdout.readline().strip() == "batch 1", (tmp_path / "first.json.err").read_text()
        deadline = time.monotonic() + 90
        while not any(name(k) in path for _, path in s3.proxy.requests for k in late):  # a download held there
            assert time.monotonic() < deadline
            time.sleep(0.05)
        start, sent = time.monotonic(), time.time()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        proc.kill()
        proc.stdout.close()
    stderr = (tmp_path / "first.json.err").read_text()
    closed = float((tmp_path / "first.json.closed").read_text()) - sent
    # The loader is closed within 2 s of the Ctrl-C (0.1 s here); the interpreter's exit adds its own (1.2 s in all
    # here; 0.6 s for a process that imported torch and DALI and did nothing, on these 2 cores).
    assert "KeyboardInterrupt" in stderr and closed < 2 and took < 5, (closed, took, stderr)
    first = json.loads((tmp_path / "first.json").read_text())
    s3.proxy.clear()  # the held requests end
    rest, _ = resume(s3, url, data, first["state"])
    seen = [i for indices, pads in first["batches"] for i, pad in zip(indices, pads) if not pad] + rest
    assert sorted(seen) == list(range(N))
    assert not temporaries(data.stream.folder)
