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
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from s3_helpers import SECRET_KEY
from test_remote_stage import upload
from test_streaming_loader import INDEXED, RUN, real_indices, shard_gets

from dali_pipes import DALILoader, DataOptions, LoaderError, StreamOptions
from dali_pipes.sampling.windowed import window_spans
from dali_pipes.staging.checked import TMP_PREFIX

from loader_helpers import TinySpec, batch_rows, grey_level, quiet_dali_logs, write_dataset

SHARD = 12288  # every LMDB shard of 4 samples here: 3 pages
SHARDS = 16
N = SHARDS * 4 - 3  # odd: on 2 ranks the last batch pads with a sample of the epoch's start
LIMIT = 8 * SHARD  # on 2 ranks of a node: windows of 1 shard, 2 shards fetched ahead
BATCH = 8
RANKS = 2
SEED = 3
FETCH_THREAD = "dali-pipes-stream-fetch"
SCRIPT = Path(__file__).with_name("stream_fault_script.py")


@pytest.fixture
def streamed(tmp_path, s3, monkeypatch) -> tuple[str, DataOptions]:
    """A 16-shard dataset in the bucket and the options that stream it (the cache in ``tmp_path/cache``).

    Retries are quick (``BACKOFF``) and few (``ATTEMPTS``): a fault that outlasts them fails in a second."""
    import dali_pipes.remote.transfer as transfer

    monkeypatch.setattr(transfer, "BACKOFF", 0.01)
    monkeypatch.setattr(transfer, "ATTEMPTS", 2)
    quiet_dali_logs()
    source = write_dataset(tmp_path / "src", N, fmt="lmdb", samples_per_shard=4)
    assert {p.stat().st_size for p in source.glob("shard-*")} == {SHARD}
    stream = StreamOptions(cache_limit=LIMIT, folder=tmp_path / "cache")
    return upload(s3, source), DataOptions(stream=stream, storage_options=s3.options)


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
    """The shards of each window of ``epoch``, in reading order (the order is a pure function of its inputs)."""
    return [span.shards for span in window_spans([4] * (SHARDS - 1) + [1], epoch, SEED, window, True)]


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


def fetch_threads_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == FETCH_THREAD and t.is_alive()]


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
        assert (loaders[0].sampling.window, streamer.ahead) == (1, 2)
        ahead_into_next = {k for shards in spans(1)[:2] for k in shards}
        assert not first_window & ahead_into_next  # so only the padding's guarded read fetches them again
        rules = [
            s3.proxy.add("slowdown" if k % 2 else "drop", path=rf"/{name(k)}$", times=1) for k in range(SHARDS)
        ]
        stream = steps(loaders)
        batches = next(stream)  # the first window read: its shard is evicted before the padding reads it again
        (first,) = first_window
        again = s3.proxy.add("drop", path=rf"/{name(first)}$", times=1)
        batches += [batch for step in stream for batch in step]
        assert streamer.peak_bytes <= LIMIT
    rows = check_rows(batches)
    assert sorted(index for index, _, pad, _ in rows if not pad) == list(range(N))
    assert {index // 4 for index, _, pad, _ in rows if pad} == first_window
    # Every shard met a fault, and got over it (asked for again); the padding's shard twice.
    gets = shard_gets(s3)
    assert [rule.seen for rule in rules] == [1] * SHARDS and again.seen == 1
    assert all(gets.count(name(k)) >= 2 for k in range(SHARDS)) and gets.count(name(first)) >= 4
    assert FETCH_THREAD in {thread for _, _, threads in faults for thread in threads}  # fetches ahead met faults
    padding = [threads for _, shard, threads in faults if shard == name(first)][1:]  # the second: the padding's
    assert padding and padding[0] and FETCH_THREAD not in padding[0], faults  # a guarded read met it
