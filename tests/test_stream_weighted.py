"""A weighted draw streamed (dali_pipes/sampling/stream_weighted.py): pure functions, no DALI.

What the loader relies on: each epoch's draws over all ranks are exactly the staged draw's (so the epoch's length
and each sample's share over epochs are the staged guarantees); each node reads the draws of its own partitions,
window by window; every rank the same number of samples; a saved progress resumes on other ranks per node and
batch sizes reading exactly the rest.
"""

from __future__ import annotations

import numpy as np
import pytest

from dali_pipes.sampling import NodeLayout, NodeOrder, PartitionedSampling, RankPlace, WeightedSampling
from dali_pipes.sampling.stream_weighted import WeightedStreamOrder

SIZES = np.array([7, 9, 8, 8, 5, 9, 8, 8, 6, 8, 8, 3, 8, 8, 7, 8])  # 16 shards of uneven samples
N = int(SIZES.sum())
WEIGHTS = np.where(np.arange(N) % 5 == 0, 4.0, 1.0)  # one class of five drawn four times as often


def weighted(nodes, ranks, batch, draw=None, last="pad", window=2):
    layout = NodeLayout(nodes, ranks, batch, last)
    draw = draw or WeightedSampling(WEIGHTS, num_samples=100)
    sampling = PartitionedSampling(SIZES, window, partitions=8)
    return [
        WeightedStreamOrder(NodeOrder(sampling, RankPlace(layout, n, j), 5, 2 * window), draw)
        for n in range(nodes)
        for j in range(ranks)
    ]


def real(plan):
    return plan[0][~plan[1]]


@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.parametrize("nodes,ranks,batch", [(1, 1, 4), (2, 2, 3), (4, 1, 5)])
def test_each_epoch_reads_exactly_the_staged_draw_in_equal_batches(nodes, ranks, batch, replacement):
    draw = WeightedSampling(WEIGHTS, num_samples=100, replacement=replacement)
    orders = weighted(nodes, ranks, batch, draw)
    for epoch in range(3):
        plans = [o.rank_indices(epoch, 0) for o in orders]
        read = np.concatenate([real(p) for p in plans])
        assert sorted(read.tolist()) == sorted(draw.order(N, epoch, 5).tolist())
        assert len({len(p[0]) for p in plans}) == 1
        for o, plan in zip(orders, plans):  # a node reads its own partitions' samples, padding too
            assert set(o.order.sample_nodes(epoch)[plan[0]].tolist()) <= {o.place.node}


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_node_reads_its_draws_window_by_window(nodes):
    for o in weighted(nodes, 1, 4, window=1):
        samples, _ = o.node_stream(1)
        spans, positions = o.order.node_windows(1)
        starts = [span.start for span in spans]
        stretch = np.searchsorted(starts, positions[samples], side="right") - 1
        assert np.all(np.diff(stretch) >= 0) and len(set(stretch.tolist())) > 3
        shard_of = np.repeat(np.arange(len(SIZES)), SIZES)
        for j in set(stretch.tolist()):  # each stretch's draws from the windows open at its start
            open_ = {k for span in spans if span.start <= starts[j] < span.stop for k in span.shards}
            assert set(shard_of[samples[stretch == j]].tolist()) <= open_


@pytest.mark.parametrize("nodes,before,after", [(1, (1, 4), (3, 2)), (2, (2, 3), (1, 5))])
def test_progress_resumed_on_other_ranks_and_batches_reads_exactly_the_rest(nodes, before, after):
    saved = weighted(nodes, *before)
    position = saved[0].consumed(2, 3, 0, 100)
    read = np.concatenate([real(o.rank_indices(2, 0))[: 3 * before[1]] for o in saved])
    record = saved[0].progress(2, position).as_dict()
    rest = []
    for o in weighted(nodes, *after):
        start = o.restore(o.read_progress(record, 2))
        assert start == position
        rest.append(real(o.rank_indices(2, start)))
    assert sorted(np.concatenate([read, *rest]).tolist()) == sorted(saved[0].draw.order(N, 2, 5).tolist())


def test_a_node_that_draws_nothing_pads_from_its_own_samples():
    orders = weighted(2, 1, 4)
    mine = orders[0].order.sample_nodes(0) == 0
    draw = WeightedSampling(np.where(mine, 1.0, 0.0), num_samples=40)  # node 1's samples never drawn
    orders = weighted(2, 1, 4, draw)
    idle = orders[1].rank_indices(0, 0)
    assert idle[1].all() and len(idle[0]) == len(orders[0].rank_indices(0, 0)[0])
    assert set(orders[1].order.sample_nodes(0)[idle[0]].tolist()) == {1}
