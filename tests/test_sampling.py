"""Epoch order and DDP rank split: exhaustive checks over small cases, then properties."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dali_pipes.sampling import World, epoch_order, num_batches, rank_indices, samples_consumed, samples_per_rank

SIZES = [1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 100]
BATCHES = [1, 2, 3, 4, 8]
WORLDS = [1, 2, 3, 4, 5, 8]


def all_ranks(n, b, w, last_batch, start=0, epoch=0, seed=0, shuffle=True):
    return [
        rank_indices(n, b, r, w, epoch, seed, shuffle=shuffle, last_batch=last_batch, start=start) for r in range(w)
    ]


def interleave(per_rank, b):
    """The global read order: batch 0 of every rank, then batch 1, ..."""
    out = []
    longest = max(len(idx) for idx, _ in per_rank)
    for lo in range(0, longest, b):
        for idx, pad in per_rank:
            out.extend(idx[lo : lo + b][~pad[lo : lo + b]].tolist())
    return out


def batch_count(length, b):
    return -(-length // b)


def check_split(n, b, w, last_batch, start, epoch=0, seed=0):
    """Every invariant of one (N, batch, world, policy, start) case."""
    order = epoch_order(n, epoch, seed)
    rest = order[start:].tolist()
    per_rank = all_ranks(n, b, w, last_batch, start, epoch, seed)
    expected_batches = num_batches(n, b, w, last_batch, start)
    for idx, pad in per_rank:
        assert idx.dtype == np.int64 and pad.dtype == bool and idx.shape == pad.shape
        # Equal batch counts, and only the last batch may be short.
        assert batch_count(len(idx), b) == expected_batches
        assert len(idx) > (expected_batches - 1) * b or expected_batches == 0
        # Every index (pad or not) is a real sample.
        assert ((idx >= 0) & (idx < n)).all()
    lengths = {len(idx) for idx, _ in per_rank}
    assert lengths == {samples_per_rank(n, b, w, last_batch, start)}  # the same on every rank
    seen = interleave(per_rank, b)
    if last_batch == "pad":
        # Exactly once, in the epoch's order; fewer than w padding samples, all at the end.
        assert seen == rest
        pads = sum(int(p.sum()) for _, p in per_rank)
        assert pads < w
        # The filler wraps around from the start of the epoch order.
        filler = [i for idx, pad in per_rank for i in idx[pad].tolist()]
        assert filler == np.resize(order, pads).tolist()
        for _, pad in per_rank:
            assert not pad[: max(len(pad) - b, 0)].any()
        assert expected_batches == batch_count(len(rest), b * w)
    else:
        # Only the incomplete global batch is missing, and nothing is padding.
        kept = len(rest) // (b * w) * (b * w)
        assert seen == rest[:kept]
        assert not any(p.any() for _, p in per_rank)
        assert expected_batches == len(rest) // (b * w)
        for idx, _ in per_rank:
            assert len(idx) == expected_batches * b


@pytest.mark.parametrize("last_batch", ["pad", "drop"])
def test_exhaustive_split(last_batch):
    cases = 0
    for n, b, w in itertools.product(SIZES, BATCHES, WORLDS):
        for start in sorted({0, 1, n // 3, n // 2, n - 1, n} & set(range(n + 1))):
            check_split(n, b, w, last_batch, start)
            cases += 1
    assert cases > 1000


def test_resume_gives_the_same_remainder_on_any_world_size():
    n, b = 37, 3
    order = epoch_order(n, 4, 11).tolist()
    for w_before in WORLDS:
        for k in range(num_batches(n, b, w_before) + 1):
            consumed = samples_consumed(n, b, w_before, k)
            first_part = interleave(all_ranks(n, b, w_before, "pad", epoch=4, seed=11), b)[: min(consumed, n)]
            for w_after in WORLDS:
                rest = interleave(all_ranks(n, b, w_after, "pad", start=consumed, epoch=4, seed=11), b)
                assert first_part + rest == order, (w_before, k, w_after)


def test_samples_consumed_counts_global_batches_and_caps_at_the_epoch():
    assert samples_consumed(10, 2, 2, 0) == 0
    assert samples_consumed(10, 2, 2, 1) == 4
    assert samples_consumed(10, 2, 2, 2) == 8
    assert samples_consumed(10, 2, 2, 3) == 10  # the padded tail completes the epoch
    assert samples_consumed(10, 2, 2, 1, start=3) == 7
    assert samples_consumed(10, 2, 2, 2, last_batch="drop") == 10  # the dropped tail is never read
    with pytest.raises(ValueError, match="batches must be <= 3"):
        samples_consumed(10, 2, 2, 4)


def test_small_dataset_on_a_large_world():
    # N < batch * world: one padded batch per rank, filler wraps around the epoch order.
    per_rank = all_ranks(3, 4, 5, "pad", shuffle=False)
    assert [idx.tolist() for idx, _ in per_rank] == [[0], [1], [2], [0], [1]]
    assert [pad.tolist() for _, pad in per_rank] == [[False], [False], [False], [True], [True]]
    # N < world: the filler is longer than the dataset and cycles.
    per_rank = all_ranks(1, 2, 4, "pad", shuffle=False)
    assert [idx.tolist() for idx, _ in per_rank] == [[0], [0], [0], [0]]
    assert [pad.tolist() for _, pad in per_rank] == [[False], [True], [True], [True]]


def test_drop_with_fewer_samples_than_a_global_batch_is_empty_everywhere():
    for idx, pad in all_ranks(7, 4, 2, "drop"):
        assert len(idx) == 0 and len(pad) == 0
    assert num_batches(7, 4, 2, "drop") == 0


def test_start_at_the_end_is_empty():
    for last_batch in ("pad", "drop"):
        for idx, _ in all_ranks(10, 3, 2, last_batch, start=10):
            assert len(idx) == 0
        assert num_batches(10, 3, 2, last_batch, start=10) == 0


def test_contiguous_slices_of_each_global_batch_without_shuffle():
    per_rank = all_ranks(10, 2, 2, "pad", shuffle=False)
    assert per_rank[0][0].tolist() == [0, 1, 4, 5, 8]
    assert per_rank[1][0].tolist() == [2, 3, 6, 7, 9]
    assert not per_rank[0][1].any() and not per_rank[1][1].any()


def test_epoch_order_is_a_reproducible_permutation_that_changes_with_epoch_and_seed():
    n = 1000
    orders = {(s, e): epoch_order(n, e, s) for s in range(3) for e in range(4)}
    for order in orders.values():
        assert sorted(order.tolist()) == list(range(n))
    assert len({o.tobytes() for o in orders.values()}) == len(orders)
    assert np.array_equal(epoch_order(n, 2, 1), orders[(1, 2)])
    assert epoch_order(n, 2, 1, shuffle=False).tolist() == list(range(n))
    # Pinned: a change of generator would silently change every saved run's data order.
    assert epoch_order(10, 0, 0).tolist() == [4, 6, 2, 7, 3, 5, 9, 0, 8, 1]
    assert epoch_order(10, 1, 0).tolist() == [9, 1, 3, 8, 7, 6, 0, 4, 2, 5]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_samples": 0}, "num_samples must be >= 1"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"rank": 2}, "rank must be < world_size"),
        ({"rank": -1}, "rank must be >= 0"),
        ({"epoch": -1}, "epoch must be >= 0"),
        ({"seed": -3}, "seed must be >= 0"),
        ({"start": 11}, "start must be <= num_samples"),
        ({"start": -1}, "start must be >= 0"),
        ({"last_batch": "partial"}, "last_batch must be one of"),
        ({"batch_size": 2.0}, "batch_size must be an integer"),
        ({"world_size": True}, "world_size must be an integer"),
    ],
)
def test_bad_arguments_raise_value_errors(kwargs, message):
    args = dict(num_samples=10, batch_size=2, rank=0, world_size=2, epoch=0, seed=0, last_batch="pad", start=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        rank_indices(**args)


def test_world_value():
    assert World() == World(0, 1)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        World(3, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        World(0, 1).rank = 1


def test_numpy_integers_are_accepted():
    idx, pad = rank_indices(np.int64(10), np.int32(3), np.int64(1), np.int64(2), np.int64(0), np.uint32(5))
    expected, expected_pad = rank_indices(10, 3, 1, 2, 0, 5)
    assert idx.tolist() == expected.tolist() and pad.tolist() == expected_pad.tolist()


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    b=st.integers(1, 17),
    w=st.integers(1, 9),
    last_batch=st.sampled_from(["pad", "drop"]),
    start_frac=st.floats(0, 1),
    epoch=st.integers(0, 2**31),
    seed=st.integers(0, 2**63),
)
def test_split_properties(n, b, w, last_batch, start_frac, epoch, seed):
    check_split(n, b, w, last_batch, int(start_frac * n), epoch, seed)


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 200),
    b=st.integers(1, 9),
    w_before=st.integers(1, 6),
    w_after=st.integers(1, 6),
    data=st.data(),
)
def test_resume_property(n, b, w_before, w_after, data):
    k = data.draw(st.integers(0, num_batches(n, b, w_before)))
    consumed = samples_consumed(n, b, w_before, k)
    before = interleave(all_ranks(n, b, w_before, "pad"), b)[:consumed]
    after = interleave(all_ranks(n, b, w_after, "pad", start=consumed), b)
    assert before + after == epoch_order(n, 0, 0).tolist()
