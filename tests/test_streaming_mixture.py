"""A :class:`~dali_pipes.Mixture` of two datasets in two buckets of the loopback S3-protocol server, streamed through
bounded caches (dali_pipes/loading/mixture_stream.py): exactly 70/30 each epoch, each dataset read once in each of
its own epochs, a resume mid-epoch exact, each cache's peak within its share of the limit. And a weighted draw
streamed (dali_pipes/sampling/stream_weighted.py): each epoch the staged draw's samples, resumed exactly.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from test_remote_stage import upload

from dali_pipes import BatchFormat, DALILoader, DataOptions, Mixture, RunOptions, StreamOptions, WeightedSampling

from loader_helpers import TinySpec, batch_rows, quiet_dali_logs, write_dataset

SHARD = 12288  # every LMDB shard of 4 samples here: 3 pages
SIZES = {"a": 240, "b": 160}  # 60 and 40 shards
EPOCH = 300  # 210 of a and 90 of b an epoch: two epochs read all of a's first epoch and of b's
LIMIT = 15 * SHARD  # 15% of the two datasets' 100 shards
BATCH = 8
RUN = RunOptions(device="cpu", py_num_workers=0)


@pytest.fixture(scope="module")
def buckets(tmp_path_factory, s3_server) -> dict[str, str]:
    """Each dataset in a bucket of its own (uploaded once for the module)."""
    root = tmp_path_factory.mktemp("mixture")
    return {
        name: upload(s3_server, write_dataset(root / name, size, fmt="lmdb", samples_per_shard=4))
        for name, size in SIZES.items()
    }


@pytest.fixture
def mixed(tmp_path, s3, buckets, monkeypatch) -> tuple[Mixture, DataOptions]:
    quiet_dali_logs()
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    mixture = Mixture(buckets, proportions={"a": 0.7, "b": 0.3}, num_samples=EPOCH)
    # One loader of each dataset at a time (loaders=1): b's 30% of the room holds 4 of its shards, more than 3.
    stream = StreamOptions(cache_limit=LIMIT, loaders=1)
    return mixture, DataOptions(stream=stream, storage_options=s3.options)


def mixture_loader(mixture: Mixture, data: DataOptions) -> DALILoader:
    return DALILoader(
        mixture, TinySpec(), batch_size=BATCH, seed=3, batch_format=BatchFormat(with_index=True), run=RUN, data=data
    )


def real(batches) -> list[int]:
    rows = [row for batch in batches for row in batch_rows(batch)]
    assert all(label == (index - (index >= SIZES["a"]) * SIZES["a"]) % 5 for index, label, _, _ in rows)
    return [index for index, _, is_pad, _ in rows if not is_pad]


def split(indices: list[int]) -> tuple[list[int], list[int]]:
    """Each dataset's own sample numbers, in reading order."""
    a = SIZES["a"]
    return [i for i in indices if i < a], [i - a for i in indices if i >= a]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_70_30_mixture_of_two_buckets_streams_exact_counts_and_resumes_exactly(s3, mixed):
    mixture, data = mixed
    with mixture_loader(mixture, data) as loader:
        epochs = [real(loader) for _ in range(2)]
        gets = Counter(
            path.split("/")[1] for method, path in s3.proxy.requests if "/shard-" in path and method == "GET"
        )
        # Each dataset's windows followed: its shards downloaded about once per epoch of it read (1.75 of a's 60
        # shards, 1.125 of b's 40), within 5%, and `ahead` more (the next epoch's first shards, fetched ahead before
        # the test stops). Seen: a 112 against a bound of 114 (110 before the download engine fetched ahead across
        # windows at once), b 48 against 48.
        buckets = {name: url.split("/")[2] for name, url in mixture.datasets.items()}
        ahead = {name: store.streamer.ahead for name, store in loader.store.stores.items()}
        bound = {"a": 1.05 * 105 + ahead["a"], "b": 1.05 * 45 + ahead["b"]}
        assert all(gets[buckets[name]] <= bound[name] for name in bound), (gets, bound)
        caches = loader.cache.by_name
        assert {name: s.peak_bytes <= s.limit_bytes for name, s in caches.items()} == {"a": True, "b": True}
        assert sum(s.limit_bytes for s in caches.values()) <= LIMIT
        folders = {Path(store.root) for store in loader.store.stores.values()}
    for indices in epochs:
        a, b = split(indices)
        assert (len(a), len(b)) == (210, 90)  # exactly 70/30, every epoch
    a, b = (x + y for x, y in zip(split(epochs[0]), split(epochs[1])))
    # Each dataset's first epoch read whole, each sample once, before any of it again.
    assert sorted(a[:240]) == list(range(240)) and sorted(b[:160]) == list(range(160))
    assert len(set(a[240:])) == len(a) - 240 and len(folders) == 2
    with mixture_loader(mixture, data) as loader:
        first, stream = [], iter(loader)
        for _ in range(11):
            first.append(next(stream))
        state = loader.state_dict()
    assert 0 < state["samples_consumed"] < EPOCH and state["stream"]["nodes"] == 1
    with mixture_loader(mixture, data) as resumed:
        resumed.load_state_dict(state)
        rest = real(resumed)
        after = real(resumed)
        assert all(s.peak_bytes <= s.limit_bytes for s in resumed.cache.by_name.values())
    assert real(first) + rest == epochs[0]  # the rest of the saved epoch, sample for sample
    assert after == epochs[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_share_too_small_for_a_datasets_shards_is_refused_naming_it(mixed):
    mixture, data = mixed
    small = DataOptions(stream=StreamOptions(cache_limit=6 * SHARD, loaders=1), storage_options=data.storage_options)
    with pytest.raises(
        ValueError,
        match=r"Mixture dataset 'b' streams with \d+ bytes, its share \(30.0%.* the mixture's is 3.33 times it",
    ):
        mixture_loader(mixture, small)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_weighted_draw_streams_the_staged_draws_samples_and_resumes_exactly(s3, buckets, tmp_path, monkeypatch):
    quiet_dali_logs()
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    size, url = SIZES["a"], buckets["a"]
    draw = WeightedSampling([4.0 if i % 5 == 0 else 1.0 for i in range(size)], num_samples=120)
    limit = 6 * SHARD  # 10% of the dataset
    data = DataOptions(stream=StreamOptions(cache_limit=limit, loaders=1), storage_options=s3.options)

    def weighted_loader() -> DALILoader:
        indexed = BatchFormat(with_index=True)
        return DALILoader(
            url, TinySpec(), batch_size=BATCH, seed=3, batch_format=indexed, run=RUN, data=data, sampling=draw
        )

    with weighted_loader() as loader:
        epochs = [real(loader) for _ in range(2)]
        assert loader.cache.peak_bytes <= limit
    gets = [path for method, path in s3.proxy.requests if "/shard-" in path and method == "GET"]
    for epoch, indices in enumerate(epochs):  # the staged draw's samples, each as often
        assert sorted(indices) == sorted(draw.order(size, epoch, 3).tolist())
    assert len(gets) <= 2 * 60 + 10, len(gets)  # windows followed: about a download a shard an epoch
    with weighted_loader() as loader:
        stream = iter(loader)
        first = [next(stream) for _ in range(5)]
        state = loader.state_dict()
    with weighted_loader() as resumed:
        resumed.load_state_dict(state)
        assert real(first) + real(resumed) == epochs[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_of_a_process_group_read_the_mixture_exactly_and_resume_on_one(tmp_path, s3, buckets, monkeypatch):
    from test_streaming_loader import real_of, run_ranks

    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))  # inherited by the ranks: one node's cache
    options = {
        "stream": {"cache_limit": LIMIT, "loaders": 1},
        "storage": s3.options,
        "group": True,
        "seed": 3,
        "mixture": {"proportions": {"a": 0.7, "b": 0.3}, "num_samples": EPOCH},
        "stop": 6,
    }
    first = run_ranks(2, buckets, tmp_path / "two", **options)
    state = first[0]["state"]
    assert state == first[1]["state"] and state["samples_consumed"] == 2 * 6 * 4
    assert all(r["peak"] <= r["limit"] <= LIMIT for r in first)
    rest = run_ranks(1, buckets, tmp_path / "one", **{**options, "group": False, "stop": None, "state": state})
    a, b = split(sum((real_of(r) for r in first + rest), []))
    assert (len(a), len(b)) == (210, 90) and len(set(a)) == 210 and len(set(b)) == 90
