"""The padding of a streamed epoch's last batch (issue 54 item 5): taken from the order's end, which the cache
holds, not wrapped around from its start; every real sample still once, every rank agreeing. A streamed loader
reads the partitioned order (:class:`~dali_pipes.sampling.node_order.NodeOrder`): its fillers are its node's
last-read samples; :class:`WindowedSampling`, an order a user may pass, pads from its end as well."""

from __future__ import annotations

import numpy as np
import pytest

from dali_pipes.sampling import WindowedSampling, split_order, window_spans
from dali_pipes.sampling.node_order import NodeOrder, RankPlace
from dali_pipes.sampling.partitioned import NodeLayout, PartitionedSampling


@pytest.mark.parametrize("nodes, ranks, batch", [(2, 2, 8), (4, 1, 4), (1, 3, 4), (2, 3, 5)])
def test_a_streamed_epochs_fillers_are_the_last_samples_its_node_reads(nodes, ranks, batch):
    sizes = [4] * 15 + [1]  # 61 samples: the nodes' shares differ, so some pad
    sampling = PartitionedSampling(sizes, window=2, partitions=4)
    real, padded = [], 0
    for node in range(nodes):
        for rank in range(ranks):
            order = NodeOrder(sampling, RankPlace(NodeLayout(nodes, ranks, batch), node, rank), 3, node_window=4)
            indices, pad = order.rank_indices(0, 0)
            _, positions = order.node_windows(0)
            end = int(positions.max()) + 1  # the node's stream: positions 0 .. end - 1
            real += indices[~pad].tolist()
            filled = positions[indices[pad]]
            # The node's own (position >= 0), read last: the windows the cache holds at the epoch's end.
            assert np.all(filled >= end - ranks * len(filled)), (node, rank, filled.tolist(), end)
            padded += len(filled)
    assert sorted(real) == list(range(61)) and padded > 0


@pytest.mark.parametrize("world_size, batch", [(2, 8), (3, 4), (5, 2), (4, 16)])
def test_fillers_come_from_the_end_of_a_windowed_order(world_size, batch):
    sizes = [4] * 15 + [1]
    sampling = WindowedSampling(sizes, window=2)
    order = sampling.order(61, 0, 3)
    parts = [split_order(order, batch, r, world_size, "pad", 0, sampling.pad_from) for r in range(world_size)]
    real = np.concatenate([indices[~pad] for indices, pad in parts])
    assert sorted(real.tolist()) == list(range(61))
    fillers = np.concatenate([indices[pad] for indices, pad in parts])
    last = window_spans(sizes, 0, 3, 2)[-1]
    assert len(fillers) and set(fillers.tolist()) <= set(order[last.start :].tolist())  # the last window's samples
    # The order's non-streamed padding is unchanged: wrapped around from its start.
    starts = np.concatenate([i[p] for i, p in (split_order(order, batch, r, world_size) for r in range(world_size))])
    assert set(starts.tolist()) <= set(order[:world_size].tolist())
