"""The padding of a streamed epoch's last batch (issue 54 item 5): taken from the order's end, which the cache
holds, not wrapped around from its start; every real sample still once, every rank agreeing."""

from __future__ import annotations

import numpy as np
import pytest

from dali_pipes.sampling import WindowedSampling, split_order, window_spans


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
