"""What a stream pins: for each batch, the node's windows it reads and the shards read after them.

A :class:`~dali_pipes.loading.streaming.Streamer` asks :meth:`WindowPlan.for_batch` before each batch. The answer
is a list of shard groups in reading order: the shards of the windows the batch's samples lie in (to pin to
read), then those of the windows after them (to pin as fetched ahead), at most ``ahead`` shards and all within
``budget`` bytes. Nothing here touches the cache or a lock: it is a function of the node's partitioned order
(:meth:`NodeOrder.node_windows <dali_pipes.sampling.node_order.NodeOrder.node_windows>`) and the shards' sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np

from dali_pipes.sampling.windowed import WindowSpan, spans_between

if TYPE_CHECKING:
    from dali_pipes.sampling.node_order import NodeOrder

__all__ = ["WindowPlan"]

#: Where a plan's pins were set: (epoch, first window, last window read) of the batch they were set for.
At = tuple[int, int, int]


class WindowPlan:
    """The shards to pin for each batch of ``order`` (this rank's place in the partitioned order).

    ``shard_bytes``: each shard's bytes in the cache; ``ahead``: shards pinned after the windows being read;
    ``budget``: the bytes all the pins may take; ``read_cap``: the most bytes of windows a batch pins to read
    (:func:`~dali_pipes.loading.stream_setup.open_streaming` says why).
    """

    def __init__(
        self, order: "NodeOrder", shard_bytes: Sequence[int], *, ahead: int, budget: int, read_cap: int
    ) -> None:
        self.order = order
        self.shard_bytes = tuple(shard_bytes)
        self.ahead = ahead
        self.budget = budget
        self.read_cap = read_cap
        self.at: At | None = None  # where the pins were last set (:meth:`applied`)
        self._spans: dict[tuple[int, Any], tuple[WindowSpan, ...]] = {}  # by (epoch, its base)
        self._positions: dict[tuple[int, Any], np.ndarray] = {}  # each sample's position in the node's stream

    def for_batch(
        self, epoch: int, indices: np.ndarray, is_pad: np.ndarray
    ) -> tuple[At, list[list[int]], list[int]] | None:
        """``(where, groups, order)``: the shards to pin for a batch of ``epoch`` reading ``indices`` (the windows
        being read first, then those ahead) and every shard in the order the reads will need them from here on (this
        epoch's and the next one's: the cache evicts the one needed furthest ahead first); ``None`` when the pins set
        last are still the ones (or the batch is all padding, whose reads pin their own shards)."""
        spans, positions = self.epoch_windows(epoch)
        where = positions[np.asarray(indices)[~np.asarray(is_pad, dtype=bool)]]
        where = where[where >= 0]
        if len(where) == 0:
            return None
        hi = int(where.max()) + 1
        touched = spans_between(spans, int(where.min()), hi)
        current = self._within_cap(touched)  # the rest of the batch's windows: fetched ahead, read shard by shard
        at = (epoch, touched[0].window, current[-1].window if current else -1)
        if at == self.at:
            return None
        later = [s.shards for s in touched[len(current) :]]
        later += [s.shards for s in spans[touched[-1].window + 1 :] if s.start >= hi]
        later += list(self._next_epoch(epoch))
        now = [k for s in current for k in s.shards]
        return at, self._wanted(now, later), [*now, *(k for shards in later for k in shards)]

    def applied(self, at: At) -> None:
        """The pins of :meth:`for_batch`'s ``at`` are set."""
        self.at = at

    def _within_cap(self, spans: Sequence[WindowSpan]) -> list[WindowSpan]:
        """The first of ``spans`` whose shards fit in ``read_cap`` bytes together (perhaps none: then every read
        of the batch pins its one shard)."""
        held = 0
        for i, span in enumerate(spans):
            held += sum(self.shard_bytes[k] for k in span.shards)
            if held > self.read_cap:
                return list(spans[:i])
        return list(spans)

    def _next_epoch(self, epoch: int) -> Iterator[tuple[int, ...]]:
        """The shards of the next epoch's windows, in reading order (its plan may not be made yet: from its start)."""
        yield from (span.shards for span in self.epoch_windows(epoch + 1)[0])

    def _wanted(self, current: list[int], later: Iterable[tuple[int, ...]]) -> list[list[int]]:
        """The shards to keep pinned, window by window: the ``current`` window's, then ``ahead`` shards of the
        ``later`` windows in reading order, all within the budget (a shard that would pass it is left out)."""
        groups = [list(current)]
        taken, held, room = set(current), sum(self.shard_bytes[k] for k in current), self.ahead
        for shards in later:
            if room == 0:
                break
            group = []
            for k in shards:
                if room > 0 and k not in taken and held + self.shard_bytes[k] <= self.budget:
                    group.append(k)
                    taken.add(k)
                    held += self.shard_bytes[k]
                    room -= 1
            groups.append(group)
        return groups

    def epoch_windows(self, epoch: int) -> tuple[tuple[WindowSpan, ...], np.ndarray]:
        """The node's windows of ``epoch`` and each sample's position in its stream (:meth:`NodeOrder.node_windows
        <dali_pipes.sampling.node_order.NodeOrder.node_windows>`), kept for it and the epoch before (reads run on
        into the next one)."""
        key = (epoch, self.order.base_of(epoch))  # a resumed epoch's windows begin at its saved progress
        if key not in self._spans:
            if self.at is not None and self.at[0] == epoch:
                self.at = None  # another plan of this epoch: its windows' numbers mean other windows
            for old in [k for k in self._spans if k[0] < epoch - 1 or k[0] == epoch]:
                del self._spans[old], self._positions[old]
            self._spans[key], self._positions[key] = self.order.node_windows(epoch)
        return self._spans[key], self._positions[key]
