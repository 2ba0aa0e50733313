"""A weighted draw (:class:`~dali_pipes.sampling.WeightedSampling`) streamed: the staged draw's samples, read in the
order of the dataset's shard windows, as a pure function of ``(seed, epoch)`` and the layout.

Epoch ``e`` draws exactly what the staged loader draws (:func:`~dali_pipes.sampling.weighted.weighted_order` of
``(seed, e)``: ``num_samples`` draws in proportion to the weights, with or without replacement), so every guarantee
of the draw holds as staged: the same samples, each as often, the epoch's length exact. Only the order differs:

- Each draw is read by the node whose partitions hold its sample (:mod:`dali_pipes.sampling.partitioned`), so the
  nodes read different numbers of draws (in proportion to their partitions' weights, not their samples); every rank
  still reads the same number of samples, those of a node with fewer padded from its own last ones.
- A node reads its draws in the order of its stream of the epoch's partitioned order: the stretch of the stream
  between one window's start and the next's taken as a unit (the windows being read then), the draws in it in a
  random order of ``(seed, e, node)`` (a sample drawn twice is not read twice in a row). So the node's cache
  follows its windows as for an unweighted epoch, instead of reading any shard at any time, which a bounded cache
  cannot follow. A window none of whose samples is drawn is not read; it may be downloaded still, fetched ahead.

A state is each node's position in its draws (:mod:`dali_pipes.sampling.node_streams`): it resumes exactly on any
ranks per node and batch size, with the same node count and windows. Tested in ``tests/test_stream_weighted.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dali_pipes.sampling.node_order import NodeOrder
from dali_pipes.sampling.node_streams import NodeStreamOrder
from dali_pipes.sampling.weighted import WeightedSampling

__all__ = ["WeightedStreamOrder"]

# The third word of the within-window order's generator seeds (partitioned.py uses 4, stream_mixture.py 5).
_WEIGHTED = 6


class WeightedStreamOrder(NodeStreamOrder):
    """``draw``'s epochs read in ``order``'s windows by the rank ``order`` is placed at (see the module docstring)."""

    def __init__(self, order: NodeOrder, draw: WeightedSampling) -> None:
        super().__init__(order.place, "the weighted draw")
        self.order, self.draw, self.seed = order, draw, order.seed
        self.windows = ((order.sampling.window, int(order.layout_of(0).together or 0)),)
        self._size = int(order.sampling.shard_sizes.sum())
        self._drawn: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # epoch -> (draws, the node of each)

    def _draws(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._drawn:
            if len(self._drawn) > 2:
                self._drawn.pop(min(self._drawn))
            drawn = self.draw.order(self._size, epoch, self.seed)
            self._drawn[epoch] = (drawn, self.order.sample_nodes(epoch)[drawn])
        return self._drawn[epoch]

    def node_lengths(self, epoch: int) -> np.ndarray:
        """The draws each node's partitions hold in ``epoch``."""
        return np.bincount(self._draws(epoch)[1], minlength=self.place.layout.nodes).astype(np.int64)

    def node_stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """This node's draws of ``epoch`` window by window (the epoch of each: ``epoch``)."""
        drawn, nodes = self._draws(epoch)
        mine = drawn[nodes == self.place.node]
        spans, positions = self.order.node_windows(epoch)
        starts = np.array([span.start for span in spans], dtype=np.int64)
        stretch = np.searchsorted(starts, positions[mine], side="right") - 1  # which windows' stretch it lies in
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch, _WEIGHTED, self.place.node]))
        ordered = mine[np.lexsort((rng.random(len(mine)), stretch))]
        return ordered, np.full(len(ordered), epoch, dtype=np.int64)

    def fillers(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """A node with no draws in ``epoch`` pads with its partitions' samples of the epoch."""
        stream = self.order.node_stream(epoch)
        return stream, np.full(len(stream), epoch, dtype=np.int64)

    def epoch_length(self, dataset_size: int) -> int:
        """Samples per epoch over all ranks: the draw's; refuses weights that do not match the dataset."""
        return self.draw.epoch_length(dataset_size)

    def identity(self) -> dict[str, Any]:
        """What a saved state must agree on: the draw and the dataset's shards and shuffle."""
        return {**self.order.identity(), "weighted": self.draw.identity()}
