"""The shard-windowed epoch order: a permutation, window by window, split over ranks exactly as epoch_order's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dali_pipes.sampling import (
    BatchMixing,
    WindowedSampling,
    batch_mixing,
    choose_window,
    compare_mixing,
    epoch_order,
    num_batches,
    samples_consumed,
    shard_of,
    shards_needed,
    spans_between,
    split_order,
    window_and_ahead,
    window_spans,
    windowed_order,
)

sizes_st = st.lists(st.integers(0, 40), min_size=1, max_size=25).filter(lambda s: sum(s) > 0)


def shard_ranges(sizes):
    """Shard k's global samples, as a set."""
    ends = np.cumsum(sizes)
    return [set(range(int(e) - s, int(e))) for s, e in zip(sizes, ends)]


@settings(max_examples=150, deadline=None)
@given(sizes=sizes_st, window=st.integers(1, 30), epoch=st.integers(0, 2**31), seed=st.integers(0, 2**63))
def test_a_permutation_whose_windows_hold_exactly_their_shards(sizes, window, epoch, seed):
    order = windowed_order(sizes, epoch, seed, window)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(sum(sizes)))
    spans = window_spans(sizes, epoch, seed, window)
    ranges = shard_ranges(sizes)
    assert len(spans) == -(-len(sizes) // window)
    assert sorted(k for s in spans for k in s.shards) == list(range(len(sizes)))
    assert [s.window for s in spans] == list(range(len(spans)))
    assert spans[0].start == 0 and spans[-1].stop == sum(sizes)
    for s, nxt in zip(spans, spans[1:]):
        assert s.stop == nxt.start and len(s.shards) == window
    for s in spans:
        expected = set().union(*(ranges[k] for k in s.shards))
        assert set(order[s.start : s.stop].tolist()) == expected
        assert s.stop - s.start == len(expected)


def test_pinned_orders():
    # A change of generator would silently change every saved run's data order.
    assert windowed_order([3, 2, 4], 0, 0, 1).tolist() == [2, 0, 1, 8, 5, 6, 7, 3, 4]
    assert [s.shards for s in window_spans([3, 2, 4], 0, 0, 2)] == [(0, 2), (1,)]


def test_deterministic_in_seed_and_epoch_and_different_across_them():
    sizes = [50] * 20
    orders = {(s, e): windowed_order(sizes, e, s, 4) for s in range(3) for e in range(4)}
    assert len({o.tobytes() for o in orders.values()}) == len(orders)
    assert np.array_equal(windowed_order(sizes, 2, 1, 4), orders[(1, 2)])
    shard_orders = {tuple(k for s in window_spans(sizes, e, 0, 4) for k in s.shards) for e in range(4)}
    assert len(shard_orders) == 4  # the shards themselves are permuted anew each epoch


def test_samples_are_shuffled_within_a_window():
    order = windowed_order([100, 100], 0, 0, 2)
    # Both shards appear in the window's first half, and the order is not sorted within a shard.
    assert {i // 100 for i in order[:100].tolist()} == {0, 1}
    assert order[:100].tolist() != sorted(order[:100].tolist())


def test_without_shuffle_the_manifest_order_and_consecutive_windows():
    assert windowed_order([3, 0, 2], 5, 9, 2, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    spans = window_spans([3, 0, 2], 5, 9, 2, shuffle=False)
    assert [(s.shards, s.start, s.stop) for s in spans] == [((0, 1), 0, 3), ((2,), 3, 5)]


def test_one_window_when_it_covers_every_shard_is_a_global_shuffle_unlike_epoch_order():
    sizes = [10] * 30
    for window in (30, 31, 1000):
        spans = window_spans(sizes, 0, 0, window)
        assert len(spans) == 1 and (spans[0].start, spans[0].stop) == (0, 300)
    order = windowed_order(sizes, 0, 0, 30)
    assert np.array_equal(order, windowed_order(sizes, 0, 0, 1000))
    assert not np.array_equal(order, epoch_order(300, 0, 0))
    # Mixed across the whole dataset: the first 30 positions come from many shards.
    assert len(set(shard_of(order[:30], sizes).tolist())) > 10


def test_shard_of_skips_empty_shards():
    sizes = [2, 0, 3, 0, 1]
    assert shard_of(np.arange(6), sizes).tolist() == [0, 0, 2, 2, 2, 4]
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 6\)"):
        shard_of([6], sizes)


def batches_touch_two_windows_at_most(sizes, window, b, epoch=0, seed=0):
    """Whether every global batch of b reads from at most 2 consecutive windows, whose shards shards_needed names."""
    order = windowed_order(sizes, epoch, seed, window)
    spans = window_spans(sizes, epoch, seed, window)
    for lo in range(0, len(order), b):
        touched = spans_between(spans, lo, min(lo + b, len(order)))
        read = set(shard_of(order[lo : lo + b], sizes).tolist())
        assert read <= set(shards_needed(spans, lo, lo + b))
        # Consecutive among the windows with samples: a window of empty shards fills no position, so none touches it.
        filled = [s.window for s in spans if s.stop > s.start]
        first = filled.index(touched[0].window)
        assert [s.window for s in touched] == filled[first : first + len(touched)]
        if len(touched) > 2:
            return False
    return True


@settings(max_examples=150, deadline=None)
@given(sizes=sizes_st, window=st.integers(1, 8), b_frac=st.floats(0, 1), epoch=st.integers(0, 100))
def test_a_batch_no_larger_than_a_window_reads_from_two_consecutive_windows_at_most(sizes, window, b_frac, epoch):
    spans = window_spans(sizes, epoch, 0, window)
    smallest = min((s.stop - s.start for s in spans if s.stop > s.start), default=1)
    b = max(1, round(b_frac * smallest))
    assert batches_touch_two_windows_at_most(sizes, window, b, epoch)


def test_the_locality_check_catches_a_batch_larger_than_a_window():
    assert not batches_touch_two_windows_at_most([10] * 10, 1, 25)


def all_ranks(order, b, w, last_batch, start=0):
    return [split_order(order, b, r, w, last_batch, start) for r in range(w)]


def read_order(per_rank, b):
    """The global read order without padding: batch 0 of every rank, then batch 1, ..."""
    out = []
    for lo in range(0, max(len(idx) for idx, _ in per_rank), b):
        for idx, pad in per_rank:
            out.extend(idx[lo : lo + b][~pad[lo : lo + b]].tolist())
    return out


@pytest.mark.parametrize("last_batch", ["pad", "drop"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("sizes, window, b", [([7, 0, 5, 9, 3, 11], 2, 4), ([16] * 8, 3, 5), ([1, 2, 3], 1, 2)])
def test_rank_split_is_exactly_once_with_equal_batch_counts(sizes, window, b, world_size, last_batch):
    order = windowed_order(sizes, 3, 7, window)
    n = len(order)
    per_rank = all_ranks(order, b, world_size, last_batch)
    counts = {-(-len(idx) // b) for idx, _ in per_rank}
    assert counts == {num_batches(n, b, world_size, last_batch)}
    seen = read_order(per_rank, b)
    kept = n if last_batch == "pad" else n // (b * world_size) * (b * world_size)
    assert seen == order[:kept].tolist()
    assert len(set(seen)) == len(seen)
    pads = sum(int(p.sum()) for _, p in per_rank)
    assert pads < world_size and (last_batch == "pad" or pads == 0)


@pytest.mark.parametrize("w_before, w_after", [(1, 2), (2, 3), (3, 1), (2, 2)])
def test_resume_on_another_world_size_covers_the_rest_exactly_once(w_before, w_after):
    sizes, b = [9, 4, 12, 7, 5, 8], 3
    order = windowed_order(sizes, 1, 5, 2)
    n = len(order)
    for k in range(num_batches(n, b, w_before) + 1):
        consumed = samples_consumed(n, b, w_before, k)
        before = read_order(all_ranks(order, b, w_before, "pad"), b)[:consumed]
        after = read_order(all_ranks(order, b, w_after, "pad", start=consumed), b)
        assert before + after == order.tolist(), (k, consumed)


def test_choose_window_examples():
    assert choose_window(1000, [100] * 50) == 5  # two windows of 5 shards of 100 bytes
    assert choose_window(1099, [100] * 50) == 5
    assert choose_window(1200, [100] * 50) == 6
    assert choose_window(1000, [100] * 50, windows=3) == 3
    assert choose_window(5000, [100] * 50) == 50  # all of it fits: one window
    assert choose_window(10, [100] * 5) == 1  # never below one shard
    assert choose_window(1000, [500, 100, 100, 100, 100, 100, 100, 600]) == 1  # the largest shards decide


def test_window_and_ahead_share_the_budget():
    assert window_and_ahead(1000, [100] * 50) == (5, 5)  # by default a whole next window ahead
    assert window_and_ahead(1150, [100] * 50) == (5, 6)  # the odd shard left over goes ahead
    assert window_and_ahead(1000, [100] * 50, fetch_ahead=2) == (8, 2)  # fewer ahead: a wider window
    assert window_and_ahead(1000, [100] * 50, fetch_ahead=0) == (10, 0)
    assert window_and_ahead(5000, [100] * 50, fetch_ahead=3) == (50, 0)  # all of it fits: nothing to fetch
    assert window_and_ahead(1000, [500, 100, 100, 100, 100, 100, 100, 600]) == (1, 0)  # the largest shards decide
    with pytest.raises(ValueError, match="fetch_ahead=10 leaves no room for a window.*fetch at most 9 ahead"):
        window_and_ahead(1000, [100] * 50, fetch_ahead=10)


@given(
    shard_bytes=st.lists(st.integers(1, 500), min_size=1, max_size=40),
    budget=st.integers(1, 5000),
    ahead=st.one_of(st.none(), st.integers(0, 10)),
)
@settings(max_examples=200, deadline=None)
def test_a_window_and_the_shards_ahead_always_fit_the_budget(shard_bytes, budget, ahead):
    try:
        window, fetched = window_and_ahead(budget, shard_bytes, ahead)
    except ValueError:
        assert ahead is not None and sum(sorted(shard_bytes)[::-1][: ahead + 1]) > budget
        return
    largest = sorted(shard_bytes, reverse=True)
    assert 1 <= window <= len(shard_bytes)
    if window == len(shard_bytes) and sum(shard_bytes) <= budget:
        assert fetched == 0
    else:
        assert sum(largest[: window + fetched]) <= budget or (window == 1 and fetched == 0)
        assert ahead is None or fetched == ahead


@settings(max_examples=200, deadline=None)
@given(
    shard_bytes=st.lists(st.integers(0, 1000), min_size=1, max_size=40).filter(lambda s: sum(s) > 0),
    limit=st.integers(1, 20000),
    windows=st.integers(1, 4),
)
def test_choose_window_is_the_largest_that_fits(shard_bytes, limit, windows):
    w = choose_window(limit, shard_bytes, windows=windows)
    largest = sorted(shard_bytes, reverse=True)
    assert 1 <= w <= len(shard_bytes)
    if sum(shard_bytes) <= limit:
        assert w == len(shard_bytes)
        return
    assert w < len(shard_bytes) or w == 1  # one shard larger than the limit: still 1
    assert w == 1 or sum(largest[: windows * w]) <= limit
    assert sum(largest[: windows * (w + 1)]) > limit


def test_batch_mixing_exact_values():
    labels = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    assert batch_mixing(labels, np.arange(8), 2) == BatchMixing(1.0, 0.0, 4)
    assert batch_mixing(labels, [0, 2, 4, 6, 1, 3, 5, 7], 4) == BatchMixing(4.0, 2.0, 2)
    mixed = batch_mixing(labels, [0, 1, 2, 4, 3, 5, 6, 7], 4)  # histograms (2, 1, 1) and (1, 1, 2)
    assert mixed.distinct_classes == 3.0 and mixed.entropy_bits == pytest.approx(1.5)
    assert batch_mixing(labels, np.arange(8), 3).batches == 2  # full batches only
    assert batch_mixing(labels, [5, 1], 4) == BatchMixing(2.0, 1.0, 1)  # shorter than a batch: one batch


def test_windows_mix_classes_worse_than_a_global_shuffle_and_better_as_they_grow():
    labels = np.repeat(np.arange(100), 50)  # written class by class, 2 classes per shard
    rows = compare_mixing(labels, [100] * 50, 32, [1, 8, 50], seed=3)
    assert list(rows) == ["window=1", "window=8", "window=50", "global"]
    w1, w8, w50, whole = rows["window=1"], rows["window=8"], rows["window=50"], rows["global"]
    assert w1.distinct_classes <= 3 and w1.entropy_bits < 1.6
    assert w1.distinct_classes < w8.distinct_classes < whole.distinct_classes
    assert w1.entropy_bits < w8.entropy_bits < whole.entropy_bits
    # One window over every shard is a global shuffle: the same mixing up to chance.
    assert w50.distinct_classes == pytest.approx(whole.distinct_classes, rel=0.05)
    assert w50.entropy_bits == pytest.approx(whole.entropy_bits, rel=0.02)


def test_windowed_sampling_plugs_in_like_the_other_orders():
    sampling = WindowedSampling([5, 7, 3], window=2)
    assert np.array_equal(sampling.order(15, 4, 2), windowed_order([5, 7, 3], 4, 2, 2))
    assert sampling.epoch_length(15) == 15
    assert sampling.identity() != WindowedSampling([5, 7, 3], window=1).identity()
    assert sampling.identity() != WindowedSampling([5, 3, 7], window=2).identity()
    assert sampling.identity() == WindowedSampling(np.array([5, 7, 3]), window=2).identity()
    with pytest.raises(ValueError, match="shards hold 15 samples but the dataset has 16"):
        sampling.order(16, 0, 0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: windowed_order([3, 4], 0, 0, 0), "window must be >= 1"),
        (lambda: windowed_order([3, 4], 0, 0, True), "window must be an integer"),
        (lambda: windowed_order([], 0, 0, 1), "shard_sizes is empty"),
        (lambda: windowed_order([3, -1, 4], 0, 0, 1), "shard 1 has -1"),
        (lambda: windowed_order([0, 0], 0, 0, 1), "shard_sizes are all 0"),
        (lambda: windowed_order([2.5, 3], 0, 0, 1), "shard_sizes must be integers"),
        (lambda: windowed_order([3, 4], -1, 0, 1), "epoch must be >= 0"),
        (lambda: window_spans([3, 4], 0, -2, 1), "seed must be >= 0"),
        (lambda: spans_between((), 5, 4), "stop must be >= 5"),
        (lambda: choose_window(0, [10]), "cache_limit_bytes must be >= 1"),
        (lambda: choose_window(10, [10], windows=0), "windows must be >= 1"),
        (lambda: choose_window(10, [-10]), "shard 0 has -10"),
        (lambda: batch_mixing([0, 1], [], 2), "order is empty"),
        (lambda: batch_mixing([0, 1], [0, 2], 2), "order must index labels"),
        (lambda: compare_mixing([0, 1], [3], 2, [1]), "2 labels but the shards hold 3 samples"),
        (lambda: WindowedSampling([3], window=0), "WindowedSampling.window must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()
