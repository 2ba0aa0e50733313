"""Orders in which each node reads a stream of its own drawn from a dataset's partitioned order, each epoch's
stream a pure function of ``(seed, epoch)`` and the layout: the base of :class:`~dali_pipes.sampling.
stream_mixture.MixtureOrder` and :class:`~dali_pipes.sampling.stream_weighted.WeightedStreamOrder`.

A subclass says what node ``n`` reads in an epoch (:meth:`NodeStreamOrder.node_stream`: this rank's node's samples
in reading order, and the epoch of its dataset's own partitioned order each is read in) and how many each node
reads (:meth:`NodeStreamOrder.node_lengths`). The rest is the partitioned order's rules
(:mod:`dali_pipes.sampling.partitioned`), written once there and in :mod:`~dali_pipes.sampling.node_order`: the
node's ranks read its stream by steps, every rank the same number of samples, fillers from the node's own last
samples; the one-number position; and a state, each node's position in its stream (:class:`StreamPosition`), that
resumes exactly on any ranks per node and batch size, on the same node count and windows (refused otherwise,
saying what to keep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dali_pipes.sampling.node_order import RankPlace, StepCounts, step_counts
from dali_pipes.sampling.partitioned import rank_share

__all__ = ["NodeStreamOrder", "StreamPosition"]


@dataclass(frozen=True)
class StreamPosition:
    """A position inside ``epoch`` of a :class:`NodeStreamOrder`: ``consumed[n]`` positions of node ``n``'s stream
    read, each dataset's windows ``windows[k]`` (``(W, together)``) as the streams were read with."""

    epoch: int
    consumed: tuple[int, ...]
    windows: tuple[tuple[int, int], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The state's record of it (plain ints and lists)."""
        return {
            "nodes": len(self.consumed),
            "consumed": list(self.consumed),
            "windows": [list(w) for w in self.windows],
        }


class NodeStreamOrder(StepCounts):
    """The rank at ``place`` reading its node's stream (see the module docstring); ``what`` names the order in
    messages. A subclass sets ``windows`` (each dataset's ``(W, together)``) and gives :meth:`node_stream`,
    :meth:`node_lengths` and :meth:`fillers`."""

    windows: tuple[tuple[int, int], ...]

    def __init__(self, place: RankPlace, what: str) -> None:
        self.place, self.what = place, what
        self.resumed: StreamPosition | None = None
        self._plans: dict[tuple[int, int], np.ndarray] = {}  # (epoch, start) -> dataset epoch of each rank sample

    def node_stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's node's samples of ``epoch`` in reading order, and the dataset epoch each is read in."""
        raise NotImplementedError

    def node_lengths(self, epoch: int) -> np.ndarray:
        """The samples each node reads in ``epoch``."""
        raise NotImplementedError

    def fillers(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """What a node that reads nothing in ``epoch`` pads with (as :meth:`node_stream`)."""
        raise NotImplementedError

    def _count(self, epoch: int, base: tuple[int, ...] | None) -> Any:
        done = np.zeros(self.place.layout.nodes, dtype=np.int64) if base is None else np.asarray(base)
        return step_counts(self.node_lengths(epoch) - done, self.place.layout, int(done.sum()))

    # --- what the loader reads --------------------------------------------------------------

    def rank_indices(self, epoch: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's ``(indices, is_pad)`` for the rest of ``epoch`` from ``start``."""
        base = self._base(epoch, start)
        if base is None and self.resumed is not None and self.resumed.epoch == epoch:
            self.resumed = None  # the resumed epoch read again from its start: the saved progress is spent
        counts = self._count(epoch, base)
        samples, epochs = self.node_stream(epoch)
        first = 0 if base is None else base[self.place.node]
        if not len(samples):  # nothing to read on this node: padding only, from its fillers
            samples, epochs = self.fillers(epoch)
            first = len(samples)
        positions = np.arange(len(samples), dtype=np.int64)
        where, is_pad = rank_share(positions[first:], counts.length, self.place.layout, self.place.local_rank,
                                   lambda: positions)  # fmt: skip
        skip = self.steps_at(epoch, start) * self.place.layout.batch_size
        for old in [key for key in self._plans if key[0] < epoch - 1]:
            del self._plans[old]
        self._plans[(epoch, start)] = epochs[where[skip:]]
        return samples[where[skip:]], is_pad[skip:]

    def dataset_epochs(self, epoch: int, start: int) -> np.ndarray:
        """The epoch of its dataset's own order each sample of :meth:`rank_indices` ``(epoch, start)`` is read in."""
        if (epoch, start) not in self._plans:
            self.rank_indices(epoch, start)
        return self._plans[(epoch, start)]

    def progress(self, epoch: int, start: int) -> StreamPosition:
        """Each node's position in its stream at ``start`` of ``epoch``: what a saved state keeps."""
        base = self._base(epoch, start)
        counts = self._count(epoch, base)
        steps = self.steps_at(epoch, start)
        read = (
            np.minimum(steps * self.place.layout.node_batch, counts.lefts) if steps < counts.batches else counts.lefts
        )
        done = read + (0 if base is None else np.asarray(base))
        return StreamPosition(epoch, tuple(int(n) for n in done), self.windows)

    @staticmethod
    def read_progress(record: Any, epoch: int) -> StreamPosition:
        """A state's ``"stream"`` record as a :class:`StreamPosition` of ``epoch``; ValueError saying what is wrong."""
        if not isinstance(record, dict) or not {"consumed", "windows"} <= set(record):
            raise ValueError(f"'stream' must be the record state_dict() wrote, got {record!r}")
        consumed, windows = record["consumed"], record["windows"]
        if not isinstance(consumed, (list, tuple)) or not all(isinstance(c, int) and c >= 0 for c in consumed):
            raise ValueError(f"'consumed' must be a list of counts >= 0, got {consumed!r}")
        if not isinstance(windows, (list, tuple)) or not all(isinstance(w, (list, tuple)) for w in windows):
            raise ValueError(f"'windows' must be a list of [window, together] pairs, got {windows!r}")
        return StreamPosition(epoch, tuple(consumed), tuple(tuple(int(v) for v in w) for w in windows))

    def restore(self, progress: Any) -> int:
        """Resume at ``progress`` (checked against this run); the one-number position to start from."""
        if not any(progress.consumed):
            self.resumed = None
            return 0
        nodes = self.place.layout.nodes
        if len(progress.consumed) != nodes:
            raise ValueError(
                f"epoch {progress.epoch} of {self.what} was saved part-way on {len(progress.consumed)} node(s) and "
                f"this run has {nodes}: resume it on {len(progress.consumed)} node(s), or from the epoch's start "
                "(set_epoch without load_state_dict)"
            )
        if tuple(progress.windows) != self.windows:
            raise ValueError(
                f"epoch {progress.epoch} of {self.what} was saved part-way reading in windows "
                f"{[list(w) for w in progress.windows]} ([shards, partitions at once] each), and this run's caches "
                f"give {[list(w) for w in self.windows]}: resume it with the cache_limit it was saved with, or from "
                "the epoch's start (set_epoch without load_state_dict)"
            )
        lengths = self.node_lengths(progress.epoch)
        if any(c > int(m) for c, m in zip(progress.consumed, lengths)):
            raise ValueError(
                f"the saved progress {list(progress.consumed)} passes the nodes' {lengths.tolist()} samples of "
                f"epoch {progress.epoch}: the state is of another dataset, draw or seed"
            )
        self.resumed = StreamPosition(progress.epoch, tuple(progress.consumed), self.windows)
        return sum(progress.consumed)
