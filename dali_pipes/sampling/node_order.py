"""The partitioned order as one rank of a loader reads it: its place on its node, and its position as one number.

:mod:`dali_pipes.sampling.partitioned` says what each rank reads given every partition's progress. A
loader counts its position in one number, the epoch's samples consumed, which its passes, its epoch chain
and its saved state carry; :class:`NodeOrder` maps between the two. After ``k`` steps from ``base`` (the
per-partition progress a resumed epoch began at; none otherwise) the nodes have read ``sum(base) +
sum_n min(k b R, left_n)`` samples, ``left_n`` being node ``n``'s samples after ``base``. That grows with
``k`` until the epoch's last step (which, as everywhere, counts the whole epoch), so the number gives ``k``
back, and ``k`` gives :func:`~dali_pipes.sampling.partitioned.partitioned_progress`: what a state saves, and
what resumes on any layout (:class:`StreamProgress`).

A resumed epoch keeps the window of the run that saved it (its streams depend on it); the epochs after it
take this run's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

# The epoch's dealing, the padding rule and a node's stream, written once in partitioned.py.
from dali_pipes.sampling.partitioned import (
    NodeLayout,
    PartitionedSampling,
    _epoch,
    _node_labels,
    _node_stream,
    deal_shards,
    node_partitions,
    node_window_spans,
    partitioned_progress,
    partitioned_rank_indices,
    per_rank_length,
)
from dali_pipes.sampling.rules import check_int
from dali_pipes.sampling.windowed import WindowSpan

__all__ = ["NodeOrder", "RankPlace", "StepCounts", "StreamProgress", "check_progress"]


@dataclass(frozen=True)
class RankPlace:
    """Where a rank reads: node ``node`` of ``layout.nodes``, rank ``local_rank`` of its ``layout.ranks``."""

    layout: NodeLayout
    node: int
    local_rank: int

    def __post_init__(self) -> None:
        if not 0 <= check_int("node", self.node, 0) < self.layout.nodes:
            raise ValueError(f"node must be < nodes ({self.layout.nodes}), got {self.node}")
        if not 0 <= check_int("local_rank", self.local_rank, 0) < self.layout.ranks:
            raise ValueError(f"local_rank must be < ranks per node ({self.layout.ranks}), got {self.local_rank}")


@dataclass(frozen=True)
class StreamProgress:
    """A position inside ``epoch`` of the partitioned order: ``consumed[p]`` samples of partition ``p`` read, its
    partitions cut into windows of ``window`` shards (what a saved state holds besides the epoch)."""

    epoch: int
    consumed: tuple[int, ...]
    window: int

    def as_dict(self) -> dict[str, Any]:
        """The state's record of it (plain ints and lists)."""
        return {"partitions": len(self.consumed), "window": self.window, "consumed": list(self.consumed)}


@dataclass(frozen=True)
class _Counts:
    lefts: np.ndarray  # samples left per node after the base
    batches: int  # batches per rank from the base
    length: int  # samples per rank (padding included) from the base
    done: int  # samples read of the epoch at the base


class StepCounts:
    """The one-number position of an order in which each node reads a stream of its own, its ranks slicing each
    step of it (:class:`NodeOrder`, :class:`~dali_pipes.sampling.stream_mixture.MixtureOrder`): the steps, batches
    and samples from ``start``, given ``_count(epoch, base)`` (each node's samples left after ``base``, the resumed
    progress ``start`` lies after: :meth:`_base`)."""

    place: RankPlace
    resumed: Any  # the saved progress being resumed (its ``epoch`` and each node's ``consumed``), or None

    def _count(self, epoch: int, base: Any) -> _Counts:
        raise NotImplementedError

    def _base(self, epoch: int, start: int) -> tuple[int, ...] | None:
        """The resumed progress ``start`` of ``epoch`` lies after, or ``None`` (the epoch from its start)."""
        r = self.resumed
        if r is not None and r.epoch == epoch and start >= sum(r.consumed) > 0:
            return r.consumed
        return None

    # --- the one-number position ------------------------------------------------------------

    def steps_at(self, epoch: int, start: int) -> int:
        """The steps taken since the epoch's base when ``start`` of its samples are consumed."""
        counts = self._count(epoch, self._base(epoch, start))
        want = start - counts.done
        node_batch = self.place.layout.node_batch
        lo, hi = 0, max(counts.batches - 1, 0)
        while lo < hi:  # the read count grows strictly with the steps before the last one
            mid = (lo + hi) // 2
            if int(np.minimum(mid * node_batch, counts.lefts).sum()) < want:
                lo = mid + 1
            else:
                hi = mid
        if int(np.minimum(lo * node_batch, counts.lefts).sum()) != want:
            raise ValueError(
                f"{start} samples consumed of epoch {epoch} is not a step of this layout ({self.place.layout.nodes} "
                f"node(s) of {self.place.layout.ranks} rank(s), batch {self.place.layout.batch_size}): restore a "
                "state through the loader's load_state_dict, which keeps each partition's progress"
            )
        return lo

    def batches(self, epoch: int, start: int) -> int:
        """Batches every rank takes in the rest of ``epoch`` from ``start``."""
        return self._count(epoch, self._base(epoch, start)).batches - self.steps_at(epoch, start)

    def per_rank(self, epoch: int, start: int) -> int:
        """This rank's samples, padding included, in the rest of ``epoch`` from ``start``."""
        counts = self._count(epoch, self._base(epoch, start))
        return counts.length - self.steps_at(epoch, start) * self.place.layout.batch_size

    def consumed(self, epoch: int, handed: int, start: int, total: int) -> int:
        """The samples of ``epoch`` (``total`` of them) consumed once every rank has taken ``handed`` batches from
        ``start``: all of them after the last batch."""
        counts = self._count(epoch, self._base(epoch, start))
        steps = self.steps_at(epoch, start) + check_int("handed", handed, 0)
        if steps >= counts.batches:
            return total
        return counts.done + int(np.minimum(steps * self.place.layout.node_batch, counts.lefts).sum())


def step_counts(lefts: np.ndarray, layout: NodeLayout, done: int) -> _Counts:
    """The counts of an epoch whose nodes have ``lefts`` samples left after ``done`` were read."""
    length = per_rank_length(lefts.tolist(), layout)
    return _Counts(lefts, -(-length // layout.batch_size), length, done)


class NodeOrder(StepCounts):
    """The partitioned order of ``sampling`` read by the rank at ``place`` with ``seed``, its node's windows
    ``node_window`` shards wide (:func:`~dali_pipes.sampling.node_room.node_window`), in the shape the loader's
    other orders have: ``epoch_length``, ``identity``, and the counts by the one-number position ``start``."""

    def __init__(self, sampling: PartitionedSampling, place: RankPlace, seed: int, node_window: int) -> None:
        self.sampling, self.place = sampling, place
        self.seed = check_int("seed", seed, 0)
        self.node_window = check_int("node_window", node_window, 1)
        self.resumed: StreamProgress | None = None
        self._counts: dict[tuple[int, Any], _Counts] = {}
        self._bases: dict[int, tuple[int, ...] | None] = {}  # the base each epoch's plan was last made from

    # --- what an epoch reads with -----------------------------------------------------------

    def sampling_of(self, epoch: int) -> PartitionedSampling:
        """The order's fixed part in ``epoch``: a resumed epoch's window is the saved one."""
        r = self.resumed
        if r is not None and r.epoch == epoch and r.window != self.sampling.window:
            return dataclasses.replace(self.sampling, window=r.window)
        return self.sampling

    def layout_of(self, epoch: int) -> NodeLayout:
        """The layout in ``epoch``: a node reads as many partitions at once as its window holds."""
        window = self.sampling_of(epoch).window
        share = len(node_partitions(0, self.place.layout.nodes, self.sampling.partitions))
        together = share if self.holds_all else max(1, min(share, self.node_window // window))
        return dataclasses.replace(self.place.layout, together=together)

    @property
    def holds_all(self) -> bool:
        """Whether a node window holds every shard: each partition is then one window, all read at once."""
        return self.node_window >= len(self.sampling.shard_sizes)

    def _count(self, epoch: int, base: tuple[int, ...] | None) -> _Counts:
        key = (epoch, base)
        counts = self._counts.get(key)  # read once: the streamer's thread may clear the dict meanwhile
        if counts is None:
            if len(self._counts) > 8:
                self._counts.clear()
            sampling, layout = self.sampling_of(epoch), self.layout_of(epoch)
            ep = _epoch(sampling, epoch, self.seed, base)
            nodes = layout.nodes
            lefts = np.array([ep.left(node_partitions(n, nodes, sampling.partitions)) for n in range(nodes)])
            counts = self._counts[key] = step_counts(lefts, layout, 0 if base is None else sum(base))
        return counts

    def progress(self, epoch: int, start: int) -> StreamProgress:
        """Each partition's progress at ``start`` of ``epoch``: what a saved state keeps."""
        base = self._base(epoch, start)
        sampling = self.sampling_of(epoch)
        steps = self.steps_at(epoch, start)
        done = partitioned_progress(sampling, self.layout_of(epoch), epoch, self.seed, steps, base)
        return StreamProgress(epoch, done, sampling.window)

    @staticmethod
    def read_progress(record: Any, epoch: int) -> StreamProgress:
        """A state's ``"stream"`` record of this order (:func:`check_progress`)."""
        return check_progress(record, epoch)

    def restore(self, progress: StreamProgress) -> int:
        """Resume at ``progress`` (checked against the dataset's partitions); the one-number position to start from."""
        if not any(progress.consumed):
            self.resumed = None
            return 0
        check_int("window", progress.window, 1)
        saved, mine, nodes = len(progress.consumed), self.sampling.partitions, self.place.layout.nodes
        if saved != mine:
            fits = ", ".join(str(n) for n in range(1, saved + 1) if saved % n == 0)
            raise ValueError(
                f"epoch {progress.epoch} was saved part-way in {saved} partitions, and this run of {nodes} node(s) "
                f"has {mine}: resume it on {fits} node(s) with StreamOptions(partitions={saved}), or from the "
                "epoch's start (set_epoch without load_state_dict)"
            )
        if progress.window > self.node_window and not self.holds_all:
            raise ValueError(
                f"epoch {progress.epoch} was saved part-way reading windows of {progress.window} shard(s) a "
                f"partition, and this run's cache holds windows of {self.node_window} shard(s) a node: resume it with "
                "the cache_limit it was saved with (or more), or from the epoch's start (set_epoch without "
                "load_state_dict)"
            )
        sampling = dataclasses.replace(self.sampling, window=progress.window)
        _epoch(sampling, progress.epoch, self.seed, progress.consumed)  # refuses another partitioning, by name
        self.resumed = progress
        self._counts.clear()
        return sum(progress.consumed)

    # --- what the loader reads --------------------------------------------------------------

    def rank_indices(self, epoch: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's ``(indices, is_pad)`` for the rest of ``epoch`` from ``start``."""
        base = self._base(epoch, start)
        if base is None and self.resumed is not None and self.resumed.epoch == epoch:
            self.resumed = None  # the resumed epoch read again from its start: the saved progress is spent
            self._counts.clear()
        skip = self.steps_at(epoch, start) * self.place.layout.batch_size
        place = self.place
        indices, is_pad = partitioned_rank_indices(
            self.sampling_of(epoch), self.layout_of(epoch), place.node, place.local_rank, epoch, self.seed, base
        )
        self._bases[epoch] = base
        for old in [e for e in self._bases if e < epoch - 1]:
            del self._bases[old]
        return indices[skip:], is_pad[skip:]

    def base_of(self, epoch: int) -> tuple[int, ...] | None:
        """The progress ``epoch``'s plan was last made from (``None``: its start)."""
        return self._bases.get(epoch)

    def node_windows(self, epoch: int) -> tuple[tuple[WindowSpan, ...], np.ndarray]:
        """The windows this rank's node reads in ``epoch`` from where its plan began (by their start in the node's
        stream), and each sample's position in that stream (``-1``: another node's)."""
        base = self._bases.get(epoch)
        sampling, layout = self.sampling_of(epoch), self.layout_of(epoch)
        spans = node_window_spans(sampling, layout, self.place.node, epoch, self.seed, base)
        stream = self.node_stream(epoch, base)
        total = int(sampling.shard_sizes.sum())
        dtype = np.int32 if total < 2**31 else np.int64  # held per epoch by the streamer: 4 bytes a sample
        positions = np.full(total, -1, dtype=dtype)
        positions[stream] = np.arange(len(stream), dtype=dtype)
        return spans, positions

    def node_stream(self, epoch: int, base: tuple[int, ...] | None = None) -> np.ndarray:
        """The samples this rank's node reads in ``epoch`` after ``base`` (from its start by default), in order."""
        sampling, layout = self.sampling_of(epoch), self.layout_of(epoch)
        ep = _epoch(sampling, epoch, self.seed, base)
        labels = _node_labels(ep, node_partitions(self.place.node, layout.nodes, sampling.partitions), layout.together)
        return _node_stream(sampling, ep, labels, epoch, self.seed)

    def sample_nodes(self, epoch: int) -> np.ndarray:
        """The node that reads each sample in ``epoch`` (its shard's partition's), one int64 per sample."""
        sampling = self.sampling_of(epoch)
        share = sampling.partitions // self.place.layout.nodes
        shard_node = np.zeros(len(sampling.shard_sizes), dtype=np.int64)
        for p, shards in enumerate(deal_shards(sampling, epoch, self.seed)):
            shard_node[shards] = p // share
        return np.repeat(shard_node, sampling.shard_sizes)

    def node_samples(self, epoch: int) -> np.ndarray:
        """The samples each node reads in the whole of ``epoch`` (int64, one per node)."""
        return self._count(epoch, None).lefts

    def epoch_length(self, dataset_size: int) -> int:
        """Samples per epoch over all ranks: the dataset's; refuses shard sizes that do not add up to it."""
        total = int(self.sampling.shard_sizes.sum())
        if total != dataset_size:
            raise ValueError(f"the stream's shards hold {total} samples but the dataset has {dataset_size}")
        return total

    def identity(self) -> dict[str, Any]:
        """What a saved state must agree on: the shards (by digest) and the shuffle; the partitions and the window
        are the saved progress's (:meth:`restore` checks them)."""
        ident = self.sampling.identity()
        return {"order": "partitioned", **{k: ident[k] for k in ("shard_sizes_sha256", "shuffle", "redeal")}}


def check_progress(record: Any, epoch: int) -> StreamProgress:
    """A state's ``"stream"`` record as a :class:`StreamProgress` of ``epoch``; ValueError saying what is wrong."""
    if not isinstance(record, dict) or not {"window", "consumed"} <= set(record):
        raise ValueError(f"'stream' must be the record state_dict() wrote, got {record!r}")
    consumed: Sequence[Any] = record["consumed"]
    if not isinstance(consumed, (list, tuple)) or not all(isinstance(c, int) and c >= 0 for c in consumed):
        raise ValueError(f"'consumed' must be a list of counts >= 0, got {consumed!r}")
    return StreamProgress(epoch, tuple(int(c) for c in consumed), check_int("window", record["window"], 1))
