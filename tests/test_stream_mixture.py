"""A streamed mixture's order (dali_pipes/sampling/stream_mixture.py): pure functions, no DALI.

What the loader relies on: every epoch holds exactly each dataset's count over the ranks; each dataset is read in
its own streamed order (its node streams of its own epochs one after the other, so its windows are followed and
every sample of it read once in each of its epochs); the one-number position gives back the rest of each plan;
a saved progress resumes on other ranks per node and batch sizes reading exactly the rest, and is refused on
another node count or other windows.
"""

from __future__ import annotations

import numpy as np
import pytest

from dali_pipes.sampling import NodeLayout, NodeOrder, PartitionedSampling, RankPlace, exact_counts
from dali_pipes.sampling.stream_mixture import MixtureOrder

SIZES = (np.array([7, 9, 8, 8, 5, 9, 8, 8]), np.array([3, 4, 5, 4, 3, 4, 5, 2, 4, 6]))  # two datasets' shards
LENGTHS = [int(s.sum()) for s in SIZES]  # 62 and 40
OFFSETS = [0, LENGTHS[0]]


def mixture(nodes, ranks, batch, total=60, share=(0.7, 0.3), last="pad", windows=(2, 3), shuffle=True):
    """Every rank's MixtureOrder of a 70/30 mixture of ``total`` samples an epoch."""
    layout = NodeLayout(nodes, ranks, batch, last)
    counts = exact_counts(share, total)
    out = []
    for n in range(nodes):
        for j in range(ranks):
            place = RankPlace(layout, n, j)
            # Each dataset's order sized for its share of a batch (the loader's): the mixture's place has the batch.
            own = RankPlace(NodeLayout(nodes, ranks, max(1, batch // 2), last), n, j)
            orders = [
                NodeOrder(PartitionedSampling(s, w, partitions=4, shuffle=shuffle), own, 3, 2 * w)
                for s, w in zip(SIZES, windows)
            ]
            out.append(MixtureOrder(orders, counts, OFFSETS, 3, shuffle, place=place))
    return out


def real(plan):
    return plan[0][~plan[1]]


def owner(indices):
    return (np.asarray(indices) >= LENGTHS[0]).astype(int)


@pytest.mark.parametrize("nodes,ranks,batch", [(1, 1, 4), (1, 3, 5), (2, 2, 3), (4, 1, 2)])
def test_every_epoch_holds_exactly_each_datasets_count_in_equal_batches(nodes, ranks, batch):
    orders = mixture(nodes, ranks, batch)
    for epoch in range(4):
        plans = [o.rank_indices(epoch, 0) for o in orders]
        read = np.concatenate([real(p) for p in plans])
        assert np.bincount(owner(read), minlength=2).tolist() == [42, 18]
        assert len({len(p[0]) for p in plans}) == 1 and {o.batches(epoch, 0) for o in orders} == {
            len(plans[0][0]) // batch + (len(plans[0][0]) % batch > 0)
        }
        assert all(p[0].min() >= 0 and p[0].max() < sum(LENGTHS) for p in plans)


@pytest.mark.parametrize("nodes,ranks,batch", [(1, 1, 4), (2, 2, 3)])
def test_each_dataset_is_read_in_its_own_streamed_order_every_sample_once_per_its_epoch(nodes, ranks, batch):
    orders = [o for o in mixture(nodes, ranks, batch) if o.place.local_rank == 0]  # one rank of each node
    for k, offset in enumerate(OFFSETS):
        seen = {d: [] for d in range(12)}
        for o in orders:
            taken = np.concatenate([o.node_stream(e)[0] for e in range(12)])
            own = taken[owner(taken) == k] - offset
            # The node's epochs of dataset k, one after the other: its windows in order.
            expected = np.concatenate([o.orders[k].node_stream(d) for d in range(12)])
            assert np.array_equal(own, expected[: len(own)])
            for d in range(12):
                stream = o.orders[k].node_stream(d)
                start = sum(len(o.orders[k].node_stream(x)) for x in range(d))
                seen[d] += own[start : start + len(stream)].tolist()
        full = [d for d in seen if len(seen[d]) == LENGTHS[k]]
        assert full, "12 epochs cover some whole epochs of each dataset"
        for d in full:
            assert sorted(seen[d]) == list(range(LENGTHS[k]))


def test_the_ranks_read_the_node_stream_by_steps_and_the_dataset_epochs_are_told():
    orders = mixture(1, 2, 3)
    stream, epochs = orders[0].node_stream(2)
    for o in orders:
        indices, is_pad = o.rank_indices(2, 0)
        mine = np.concatenate([stream[s * 6 + 3 * o.place.local_rank : s * 6 + 3 * o.place.local_rank + 3]
                               for s in range(len(stream) // 6)])  # fmt: skip
        assert np.array_equal(indices[: len(mine)], mine)
        told = o.dataset_epochs(2, 0)
        assert len(told) == len(indices) and np.array_equal(told[: len(mine)], np.concatenate(
            [epochs[s * 6 + 3 * o.place.local_rank : s * 6 + 3 * o.place.local_rank + 3] for s in range(len(stream) // 6)]
        ))  # fmt: skip
    # Epoch 2 takes positions [84, 126) of A's (62 an epoch: its epochs 1 and 2) and [36, 54) of B's (0 and 1).
    a = owner(stream) == 0
    assert set(epochs[a].tolist()) == {1, 2} and set(epochs[~a].tolist()) == {0, 1}


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_the_position_after_some_steps_gives_back_the_rest_of_each_plan(steps):
    orders = mixture(2, 2, 3)
    total = orders[0].batches(1, 0)
    position = orders[0].consumed(1, steps, 0, 60)
    assert {o.consumed(1, steps, 0, 60) for o in orders} == {position}
    for o in orders:
        full, rest = o.rank_indices(1, 0), o.rank_indices(1, position)
        assert o.batches(1, position) == total - steps and o.per_rank(1, position) == len(full[0]) - steps * 3
        assert np.array_equal(rest[0], full[0][steps * 3 :]) and np.array_equal(rest[1], full[1][steps * 3 :])
    assert orders[0].consumed(1, total, 0, 60) == 60


@pytest.mark.parametrize("nodes,before,after", [(1, (1, 4), (3, 2)), (2, (2, 3), (1, 5)), (2, (1, 2), (2, 2))])
def test_progress_resumed_on_other_ranks_and_batches_reads_exactly_the_rest(nodes, before, after):
    saved = mixture(nodes, *before)
    steps = 2
    position = saved[0].consumed(1, steps, 0, 60)
    read = np.concatenate([real(o.rank_indices(1, 0))[: steps * before[1]] for o in saved])
    record = saved[0].progress(1, position).as_dict()
    assert all(o.progress(1, position).as_dict() == record for o in saved)
    resumed = mixture(nodes, *after)
    rest = []
    for o in resumed:
        start = o.restore(o.read_progress(record, 1))
        assert start == position
        rest.append(real(o.rank_indices(1, start)))
    whole = np.concatenate([o.node_stream(1)[0] for o in resumed if o.place.local_rank == 0])
    assert sorted(np.concatenate([read, *rest]).tolist()) == sorted(whole.tolist())
    assert np.bincount(owner(np.concatenate([read, *rest])), minlength=2).tolist() == [42, 18]
    nxt = [o.rank_indices(2, 0) for o in resumed]  # the epoch after reads from its start
    assert np.bincount(owner(np.concatenate([real(p) for p in nxt])), minlength=2).tolist() == [42, 18]


def test_a_progress_of_another_node_count_or_other_windows_is_refused():
    saved = mixture(2, 1, 3)
    record = saved[0].progress(1, saved[0].consumed(1, 2, 0, 60)).as_dict()
    with pytest.raises(ValueError, match="saved part-way on 2 node"):
        mixture(1, 1, 3)[0].restore(saved[0].read_progress(record, 1))
    with pytest.raises(ValueError, match="the cache_limit it was saved with"):
        mixture(2, 1, 3, windows=(1, 3))[0].restore(saved[0].read_progress(record, 1))
    with pytest.raises(ValueError, match="'consumed' must be"):
        saved[0].read_progress({"consumed": [-1], "windows": []}, 1)


def test_without_shuffle_the_datasets_come_one_after_the_other():
    o = mixture(1, 1, 4, total=102, share=LENGTHS, shuffle=False)[0]
    indices, is_pad = o.rank_indices(0, 0)
    read = indices[~is_pad]
    assert sorted(read.tolist()) == list(range(102)) and np.all(np.diff(owner(read)) >= 0)  # A whole, then B


def test_drop_reads_full_batches_only_and_never_a_sample_twice():
    orders = mixture(2, 2, 4, last="drop")
    plans = [o.rank_indices(0, 0) for o in orders]
    read = np.concatenate([real(p) for p in plans])
    assert not any(p[1].any() for p in plans) and len(read) % 16 == 0 and len(read) > 60 - 16
    assert len(set(read.tolist())) == len(read)
