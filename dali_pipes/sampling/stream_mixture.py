"""A :class:`~dali_pipes.Mixture` streamed: each dataset read in its own partitioned order, the mixture's epochs
drawn from those orders with exact counts, as a pure function of ``(seed, epoch)`` and the layout.

Each dataset ``k`` is streamed through a cache of its own, read in its own :class:`~dali_pipes.sampling.node_order.
NodeOrder` (its node's windows, :mod:`dali_pipes.sampling.partitioned`). An epoch of the mixture takes exactly
``counts[k]`` samples of dataset ``k`` (:func:`~dali_pipes.sampling.mixture.exact_counts` of the proportions), and:

- **Each dataset in its own streamed order.** Node ``n`` takes ``c[k, n]`` of them, its share of ``counts[k]``
  (in proportion to the samples of ``k`` its partitions hold, by largest remainders, so that the node shares add
  up to ``counts[k]``), from the endless sequence of its streams of ``k``'s epochs one after the other: mixture
  epoch ``e`` takes positions ``[e c[k, n], (e + 1) c[k, n])`` of it. So the node reads each dataset's windows in
  order, as a loader of that dataset alone would (its cache follows them: a bounded cache per dataset holds
  what is read), every sample of a dataset is read once in each of the dataset's own epochs before any is read
  again, and a small share of a large dataset walks on through it epoch after epoch (as
  :mod:`dali_pipes.sampling.mixture` does when staged).
- **Interleaved per sample.** Node ``n``'s stream of mixture epoch ``e`` is ``sum_k c[k, n]`` positions, each
  position's dataset drawn at random with the exact counts (a permutation of ``(seed, e, n)``; without
  ``shuffle``, the datasets one after the other), dataset ``k``'s positions taking its samples in its order.
- **Ranks and padding** as in the partitioned order: step ``j`` of the node's ranks reads node positions
  ``[j b R, (j+1) b R)``, rank ``r`` the ``r``-th slice of ``b`` (:func:`~dali_pipes.sampling.partitioned.
  rank_share`), every rank the same number of samples, fillers from the node's own last samples.
- **Progress and resume.** A state is each node's position in its stream of the epoch (:class:`MixtureProgress`):
  it resumes exactly on any ranks per node and batch size, on the same node count, with the same windows of each
  dataset (the streams depend on them: the same ``cache_limit``); the others are refused, naming what to keep.
  A resumed epoch's rest is read from each node's saved position; the epochs after it read from their start.

Differs from the staged mixture's draw (:func:`~dali_pipes.sampling.mixture.mixture_order`), which it keeps the
counts of: within a dataset the samples come window by window, not as one permutation of the whole dataset.
Tested exhaustively in ``tests/test_stream_mixture.py``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dali_pipes.sampling.mixture import exact_counts
from dali_pipes.sampling.node_order import NodeOrder, RankPlace
from dali_pipes.sampling.node_streams import NodeStreamOrder
from dali_pipes.sampling.rules import check_int

__all__ = ["MixtureOrder"]

# The third word of the interleaving's generator seeds (partitioned.py uses 4).
_MIXED = 5


class MixtureOrder(NodeStreamOrder):
    """The streamed order of a mixture read by one rank (see the module docstring).

    ``orders``: each dataset's :class:`NodeOrder` (the same rank and layout, their batch sizes aside), in index order;
    ``counts``: each dataset's samples per epoch over all ranks; ``offsets``: each dataset's first global index;
    ``identity``: the mixture's own (:meth:`~dali_pipes.sampling.mixture.MixtureSampling.identity`), kept in a saved
    state; ``place``: where this rank reads the mixture, its batch size (default: the first order's).
    """

    def __init__(
        self,
        orders: Sequence[NodeOrder],
        counts: Sequence[int],
        offsets: Sequence[int],
        seed: int,
        shuffle: bool = True,
        identity: dict[str, Any] | None = None,
        place: RankPlace | None = None,
    ) -> None:
        if not len(orders) == len(counts) == len(offsets) or not orders:
            raise ValueError(f"{len(orders)} orders, {len(counts)} counts and {len(offsets)} offsets: one each")
        self.orders = tuple(orders)
        self.place = place or self.orders[0].place
        here = (self.place.node, self.place.local_rank, self.place.layout.nodes, self.place.layout.ranks)
        if any((o.place.node, o.place.local_rank, o.place.layout.nodes, o.place.layout.ranks) != here for o in orders):
            raise ValueError("the datasets' orders must be read by the same rank of the same layout")
        self.counts = np.array([check_int("counts[]", c, 0) for c in counts], dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.seed, self.shuffle = check_int("seed", seed, 0), bool(shuffle)
        super().__init__(self.place, "the mixture")
        self._identity = dict(identity or {})
        #: ``c[k, n]``: samples of dataset ``k`` node ``n`` reads an epoch.
        self.node_counts = np.stack(
            [exact_counts(o.node_samples(0), int(c)) if c else np.zeros(self.place.layout.nodes, np.int64)
             for o, c in zip(self.orders, self.counts)]
        )  # fmt: skip
        self.windows = tuple((o.sampling.window, int(o.layout_of(0).together or 0)) for o in self.orders)
        self._ends: list[list[int]] = [[0] for _ in self.orders]  # where each dataset epoch ends in its sequence
        self._streams: dict[tuple[int, int], np.ndarray] = {}  # (dataset, its epoch) -> this node's stream

    # --- the node's stream ------------------------------------------------------------------

    def node_stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's node's stream of ``epoch`` from its start: global sample indices, and the dataset epoch each
        is read in (of its dataset's own order)."""
        node = self.place.node
        shares = self.node_counts[:, node]
        labels = np.repeat(np.arange(len(self.orders)), shares)
        if self.shuffle:
            labels = np.random.Generator(np.random.PCG64([self.seed, epoch, _MIXED, node])).permutation(labels)
        samples = np.empty(len(labels), dtype=np.int64)
        epochs = np.empty(len(labels), dtype=np.int64)
        for k, share in enumerate(shares.tolist()):
            where = np.flatnonzero(labels == k)
            d, pos = self._locate(k, epoch * share + np.arange(share, dtype=np.int64))
            epochs[where] = d
            for own in np.unique(d).tolist():
                took = d == own
                samples[where[took]] = self._stream(k, own)[pos[took]] + self.offsets[k]
        return samples, epochs

    def node_lengths(self, epoch: int) -> np.ndarray:
        """Each node's samples of an epoch: its shares of the datasets' counts."""
        return self.node_counts.sum(axis=0)

    def fillers(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """A node that draws nothing an epoch pads with its stream of the first dataset's first epoch."""
        return self._stream(0, 0) + self.offsets[0], np.zeros(len(self._stream(0, 0)), dtype=np.int64)

    def _locate(self, k: int, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(its epoch, position in that epoch's stream)`` of positions ``q`` of dataset ``k``'s endless sequence."""
        ends = self._ends[k]
        order = self.orders[k]
        if len(q) and not order.sampling.redeal:  # every epoch of it as long: no walk through them
            size = int(order.node_samples(0)[self.place.node])
            return q // size, q % size
        while len(q) and ends[-1] <= int(q.max()):
            ends.append(ends[-1] + int(order.node_samples(len(ends) - 1)[self.place.node]))
        d = np.searchsorted(np.asarray(ends), q, side="right") - 1
        return d, q - np.asarray(ends)[d]

    def _stream(self, k: int, epoch: int) -> np.ndarray:
        key = (k, epoch)
        if key not in self._streams:
            if len(self._streams) > 4 * len(self.orders):
                self._streams.pop(next(iter(self._streams)))
            self._streams[key] = self.orders[k].node_stream(epoch)
        return self._streams[key]

    def epoch_length(self, dataset_size: int) -> int:
        """Samples per epoch over all ranks; refuses a store that is not this mixture's."""
        sizes = sum(int(o.sampling.shard_sizes.sum()) for o in self.orders)
        if sizes != dataset_size:
            raise ValueError(f"the mixture has {sizes} samples, but the store given has {dataset_size}")
        return int(self.counts.sum())

    def identity(self) -> dict[str, Any]:
        """What a saved state must agree on: the mixture, and each dataset's shards and shuffle."""
        return {**self._identity, "order": "partitioned", "datasets": [o.identity() for o in self.orders]}
