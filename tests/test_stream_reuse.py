"""A rerun after an interrupted streamed epoch reuses the shards the cache kept (issue 54 item 14): the cache
evicts the shard needed furthest ahead in the reading order, not the least recently used one."""

from __future__ import annotations

import pytest
from test_remote_stage import upload
from test_streaming_loader import INDEXED, RUN, real_indices

from dali_pipes import DALILoader, DataOptions, StreamOptions
from dali_pipes.sampling import shard_of

from loader_helpers import TinySpec, quiet_dali_logs, write_dataset

SHARD = 12288  # every LMDB shard of 4 samples here: 3 pages
SHARDS = 12
N = SHARDS * 4


@pytest.mark.slow  # two loaders, an epoch and a half
@pytest.mark.timeout(180)
def test_a_rerun_after_an_interrupted_epoch_downloads_only_what_the_cache_did_not_keep(tmp_path, s3):
    quiet_dali_logs()
    source = write_dataset(tmp_path / "src", N, fmt="lmdb", samples_per_shard=4)
    url = upload(s3, source)
    limit = SHARDS * SHARD * 65 // 100  # 7 shards of 12
    # One partition, one loader: windows of 3 shards read one after the other, 3 shards fetched ahead.
    stream = StreamOptions(cache_limit=limit, folder=tmp_path / "cache", partitions=1, loaders=1)
    data = DataOptions(stream=stream, storage_options=s3.options)

    def loader() -> DALILoader:
        return DALILoader(url, TinySpec(), batch_size=4, seed=1, batch_format=INDEXED, run=RUN, data=data)

    with loader() as first:
        stream = iter(first)
        assert (first.sampling.node_window, first.store.streamer.ahead) == (3, 3)
        for _ in range(
            2 * first.sampling.node_window + 1
        ):  # into the third window (a shard a batch): interrupted there
            next(stream)
    kept = {p.name for p in next((tmp_path / "cache").iterdir()).glob("shard-*.lmdb")}
    s3.proxy.clear()
    with loader() as rerun:
        streamer, requests = rerun.store.streamer, {}
        spans = rerun.sampling.node_windows(0)[0]
        last = spans[-1].shards[0]  # the epoch's last window: fetched ahead of it from there on
        before_read = streamer.before_read

        def noting(epoch, indices, is_pad):  # the downloads until the epoch reaches its last window
            if epoch > 0 or last in shard_of(indices, [4] * SHARDS):
                requests.setdefault("then", list(s3.proxy.requests))
            before_read(epoch, indices, is_pad)

        streamer.before_read = noting
        assert sorted(real_indices(rerun)) == list(range(N))
    gets = sorted(path.rsplit("/", 1)[1] for method, path in requests["then"] if method == "GET" and "/shard-" in path)
    # What it kept was read without a download, but for the shards the pinned windows left no room for: the first
    # window and the next (fetched ahead) are pinned from the start, and beside them `room` shards stay. Those
    # evicted are the ones needed last; the least recently used would be those the interrupted run read first.
    assert len(kept) >= 4 and len(gets) < SHARDS, (kept, gets)
    first = {f"shard-{k:05d}.lmdb" for k in spans[0].shards + spans[1].shards}
    room = limit // SHARD - len(first)
    assert len(set(gets) & kept) <= max(0, len(kept - first) - room), (kept, gets)


def test_the_shard_needed_furthest_ahead_is_evicted_first(tmp_path, s3):
    from dali_pipes.staging.stream_cache import ShardCache

    source = write_dataset(tmp_path / "src", 24, fmt="lmdb", samples_per_shard=4)
    url = upload(s3, source)
    with ShardCache(url, tmp_path / "cache", 3 * SHARD, storage_options=s3.options) as cache:
        for k in (0, 1, 2):  # 0 is the least recently used
            cache.fetch([k])
        cache.plan_reads([3, 0, 5, 2, 4])  # 1 is never read again, 2 after 0
        cache.fetch([3])
        assert [cache.present(k) for k in range(4)] == [True, False, True, True]
        cache.fetch([5])  # 2 is needed after 0 and 3
        assert [cache.present(k) for k in (0, 2, 3, 5)] == [True, False, True, True]
