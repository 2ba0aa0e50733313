"""The download engine of a stream (dali_pipes/loading/stream_engine.py): reading never downloads.

Issue 56 item 1: the reading thread fetched a shard outside the pinned windows itself, one at a time, holding
the streamer's lock, and the fetch thread held that lock across a group of downloads, so a slow shard ahead held
up the next window's repin. Now every download runs in the engine's threads; a read that needs a shard not yet
there asks for it first and waits with no lock held (counted in ``Streamer.blocked_s``). That every download runs
in the engine's threads: ``test_streaming_loader.py::test_windows_of_fewer_samples_than_a_batch_are_read_within_the_limit``.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from test_streaming_loader import BATCH, LIMIT, N, real_indices, stream_loader, streamed  # noqa: F401

from dali_pipes import StreamOptions


@pytest.mark.slow  # a server that holds a shard for seconds
@pytest.mark.timeout(120)
def test_a_slow_shard_ahead_holds_up_no_read_of_the_windows_before_it(s3, streamed):  # noqa: F811
    url, data = streamed
    wide = dataclasses.replace(data, stream=StreamOptions(cache_limit=3 * LIMIT, partitions=1, loaders=1))
    loader = stream_loader(url, wide)
    spans = loader.sampling.node_windows(0)[0]
    assert len(spans) >= 4 and spans[1].stop - spans[0].start >= 4 * BATCH
    held = spans[2].shards[-1]  # a shard two windows ahead of the first batch: downloaded ahead while window 1 is read
    s3.proxy.stall = 30.0  # long: the old code waited for most of it; this reads the windows before it in seconds
    s3.proxy.add("stall", path=rf"/shard-{held:05d}\.lmdb$", times=1)
    try:
        stream = iter(loader)
        batches = [next(stream)]
        start = time.monotonic()
        batches += [next(stream) for _ in range(spans[1].stop // BATCH - 2)]  # the batches of windows 0 and 1
        took = time.monotonic() - start
        assert took < s3.proxy.stall / 2, took  # before: the repin at window 1 waited for the held download
        s3.proxy.clear()
        batches += list(stream)
        assert sorted(real_indices(batches)) == list(range(N))
        assert loader.cache.peak_bytes <= loader.cache.limit_bytes
    finally:
        s3.proxy.clear()
        loader.close()


def test_the_default_downloads_keep_a_latencys_worth_of_bytes_in_flight():
    # Issue 56: 4 downloads at once paid a server's 30 ms latency in series for small shards (0.08x staged with
    # shards of about 100 KB); the default now follows the shards' size.
    from dali_pipes.loading.stream_engine import default_downloads

    assert default_downloads([1_700_000] * 99 + [1]) == 10  # the median shard: 16 MiB in flight
    assert default_downloads([170_000] * 100) == 32  # at most 32
    assert default_downloads([100 << 20] * 3) == 4  # at least 4
    assert StreamOptions(cache_limit=1 << 30).downloads is None  # chosen at the open; a number given is kept
    assert StreamOptions(cache_limit=1 << 30, downloads=2).downloads == 2
