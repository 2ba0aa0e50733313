"""Partitioned streamed epochs: each node's ranks read only their node's share of the shards.

Pure functions of ``(seed, epoch, shard sizes, P, W, shuffle)`` and the layout, over integers and numpy
arrays (no I/O, no environment). The contract:

- **Dealing.** The shards are dealt to ``P`` partitions, balanced by samples: taken in a random order
  (of ``seed``, fixed for the run; of ``(seed, epoch)`` with ``redeal=True``; the manifest order without
  ``shuffle``), then largest first, each goes whole to the partition holding the fewest samples so far
  (on a tie, in an order that spreads the shards left over from whole rounds over the nodes of every
  node count dividing ``P``). No shard is split, so each is read by one node an epoch; two partitions
  differ by at most the largest shard's samples, and with shards of one size two nodes by one shard.
  Every partition needs a shard with samples: ``P`` may not pass their count (:func:`default_partitions`).
- **A partition's stream.** Its shards permuted by ``(seed, epoch, p)``, cut into the fewest windows of
  at most ``W`` shards, their shard counts within one of each other (128 shards and ``W = 51``: 43, 43,
  42, not 51, 51, 26), each window's samples shuffled together, the windows read in order. It depends
  on neither the node count, the ranks nor the batch size. Without ``shuffle``: its shards in manifest
  order, their samples in order.
- **Nodes.** ``N`` must divide ``P``; node ``n`` holds partitions ``[n P/N, (n+1) P/N)`` and reads them
  ``together`` at a time (all by default), holding a window of each: the node-wide window, which
  :func:`partition_window` sizes from the node's cache. The partitions read together are merged in
  proportion to what is left of each (sample ``k`` of a partition with ``r`` left at ``(k + 1/2) / r``,
  ties by partition), so every step reads from each, and they advance together: a state resumed on
  more nodes leaves the nodes equal work, within a sample a partition. The node's ``R`` ranks read its
  stream as :func:`~dali_pipes.sampling.rules.split_order` cuts an order: at step ``k`` node positions
  ``[k b R, (k+1) b R)``, rank ``j`` the ``j``-th slice of ``b``, the tail dealt evenly.
- **Padding.** Every rank of the job reads the same number of samples ``L``, so the same batches of the
  same sizes: with ``last_batch="pad"`` the most any node's split needs; a node that needs fewer gets
  ``is_pad`` fillers from its own stream, the last samples it read (its last windows, still cached):
  rank ``j``'s ``m``-th filler is ``stream[-1 - (j + m R) % len(stream)]``; a node with nothing left
  takes them from its partitions' whole stream of the epoch. Fillers never come from another node's
  shards. With ``"drop"``, every rank reads the full batches that every node has; the rest of the
  epoch is not read (about a batch a node and what the partitions' sizes differ by).
- **Progress and resume.** A state is ``(epoch, consumed)``: ``consumed[p]`` is how many samples of
  partition ``p``'s stream are read, always a prefix of it (``None``: none). After ``k`` steps (batches
  every rank has taken; DDP keeps them in lockstep) node ``n`` has read ``min(k b R, S_n)`` of its
  stream of ``S_n`` samples; :func:`partitioned_progress` counts them by partition. A state resumes on
  any ranks per node, batch size and ``together``, and on any ``N'`` dividing ``P``: the rest of each
  partition, ``stream_p[consumed[p]:]``, goes to the node that now holds ``p``, so every sample not yet
  read is read exactly once in the rest of the epoch, none twice. Mid-epoch the streams must be the
  same, so the same :meth:`PartitionedSampling.identity` (keep the state's ``P`` and ``W`` to the epoch's
  end; the next epoch may take new ones). At an epoch's start (all zero) any ``P`` will do. Another
  ``P`` mid-epoch and ``N'`` not dividing ``P`` are refused (``ValueError``, saying what to pass); so is
  ``N > P``, which would make two nodes read a partition's windows and download them twice. ``P = 8`` by
  default: 1, 2, 4 and 8 nodes resume each other's states.

How a loader uses it: each rank takes :func:`partitioned_rank_indices` at an epoch's start, saves
``(epoch, partitioned_progress(..., steps, start))``, and keeps in the node's cache the shards that
:func:`~dali_pipes.sampling.windowed.shards_needed` names over :func:`node_window_spans` for the node
positions of the next steps; :func:`node_bytes` says what each node downloads an epoch.

Against MosaicML Streaming's canonical nodes (``streaming/base/partition/orig.py``, ``shuffle/py1s.py``):
there a canonical node's span of samples may split a shard with its neighbour (two nodes download
it), rows are evened out by repeating samples without a mask, a resume offset not divisible by the
node count is rounded down (samples read twice), and the shuffle is within a shard (``py1s``) or a
block that thrashes a small cache (``py1e``). Here shards are never split, padding is flagged and never
counted, resume is exact, and a node reads a window of each of its partitions, as wide as its cache.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from dali_pipes.sampling.rules import _check_last_batch, check_int, samples_per_rank, split_order
from dali_pipes.sampling.windowed import WindowSpan, checked_shard_sizes

__all__ = [
    "DEFAULT_PARTITIONS",
    "NodeLayout",
    "PartitionedSampling",
    "deal_shards",
    "default_partitions",
    "node_bytes",
    "node_partitions",
    "node_window_spans",
    "partition_stream",
    "partition_window",
    "partitioned_num_batches",
    "partitioned_progress",
    "partitioned_rank_indices",
    "per_rank_length",
    "rank_share",
]

#: Partitions by default: a multiple of 1, 2, 4 and 8, the node counts that resume each other's states.
DEFAULT_PARTITIONS = 8

# The third word of the generators' seeds (rules.py, weighted.py, mixture.py and windowed.py use 1 to 3):
# the fourth is the use: 0 the run's dealing, 1 an epoch's, 2 a partition's shards, 3 a window's samples.
_PARTITIONED = 4


def default_partitions(shard_sizes: Sequence[int] | np.ndarray) -> int:
    """The most of 8, 4, 2 and 1 partitions that the shards with samples allow (one each at least)."""
    nonempty = int(np.count_nonzero(checked_shard_sizes(shard_sizes)))
    return next(p for p in (DEFAULT_PARTITIONS, 4, 2, 1) if p <= nonempty)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


@dataclass(frozen=True, eq=False)
class PartitionedSampling:
    """What stays fixed for a run of the partitioned order (see the module docstring).

    ``shard_sizes``: samples per shard in manifest order; ``window``: ``W``, shards per window of a
    partition (a node holds one of each partition it reads at once: :func:`partition_window` sizes both
    from the node's cache); ``partitions``: ``P``; ``redeal``: deal the shards anew each epoch (by default
    once for the run, so a node whose cache holds its share downloads it once).
    """

    shard_sizes: Any
    window: int
    partitions: int = DEFAULT_PARTITIONS
    shuffle: bool = True
    redeal: bool = False

    def __post_init__(self) -> None:
        sizes = checked_shard_sizes(self.shard_sizes)
        sizes.setflags(write=False)
        object.__setattr__(self, "shard_sizes", sizes)
        object.__setattr__(self, "window", check_int("PartitionedSampling.window", self.window, 1))
        partitions = check_int("PartitionedSampling.partitions", self.partitions, 1)
        nonempty = int(np.count_nonzero(sizes))
        if partitions > nonempty:
            raise ValueError(
                f"PartitionedSampling.partitions={partitions} but only {nonempty} shard(s) hold samples: every "
                f"partition needs one; pass partitions={default_partitions(sizes)}, or write the dataset in more shards"
            )
        object.__setattr__(self, "partitions", partitions)
        object.__setattr__(self, "shuffle", _check_bool("PartitionedSampling.shuffle", self.shuffle))
        object.__setattr__(self, "redeal", _check_bool("PartitionedSampling.redeal", self.redeal))

    def identity(self) -> dict[str, Any]:
        """What a saved state must agree on mid-epoch: the shards' sizes (by digest) and the other fields."""
        digest = hashlib.sha256(self.shard_sizes.tobytes()).hexdigest()[:16]
        return {
            "shard_sizes_sha256": digest,
            "window": self.window,
            "partitions": self.partitions,
            "shuffle": self.shuffle,
            "redeal": self.redeal,
        }


@dataclass(frozen=True)
class NodeLayout:
    """Who reads: ``nodes`` nodes of ``ranks`` ranks each, ``batch_size`` samples a rank's batch; ``together``:
    how many of its partitions a node reads at once, a window of each in its cache (all by default;
    :func:`partition_window` sizes both)."""

    nodes: int = 1
    ranks: int = 1
    batch_size: int = 1
    last_batch: str = "pad"
    together: int | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks", "batch_size"):
            object.__setattr__(self, name, check_int(f"NodeLayout.{name}", getattr(self, name), 1))
        _check_last_batch(self.last_batch)
        if self.together is not None:
            object.__setattr__(self, "together", check_int("NodeLayout.together", self.together, 1))

    @property
    def node_batch(self) -> int:
        """Samples a node's ranks read together in a step."""
        return self.batch_size * self.ranks


def partition_window(node_window: int, partitions: int, nodes: int, window: int | None = None) -> tuple[int, int]:
    """``(W, together)``: shards per window of a partition, and how many partitions a node reads at once, so
    that the windows it holds fill at most ``node_window`` shards (what its cache holds for the windows
    being read, :func:`~dali_pipes.sampling.windowed.choose_window`). ``W`` is fixed for the run (the
    streams depend on it); given the run's ``window``, only ``together`` is chosen, for another node count
    or cache: a node of fewer nodes then reads its partitions in groups."""
    node_window = check_int("node_window", node_window, 1)
    share = len(node_partitions(0, nodes, partitions))
    if window is None:
        window = max(1, node_window // share)
    window = check_int("window", window, 1)
    return window, max(1, min(share, node_window // window))


def node_partitions(node: int, nodes: int, partitions: int) -> range:
    """The partitions node ``node`` of ``nodes`` holds; refuses a node count that does not divide ``partitions``."""
    nodes = check_int("nodes", nodes, 1)
    partitions = check_int("partitions", partitions, 1)
    node = check_int("node", node, 0)
    if partitions % nodes:
        fits = [n for n in range(1, partitions + 1) if partitions % n == 0]
        raise ValueError(
            f"nodes={nodes} does not divide partitions={partitions}: a run of {partitions} partitions runs on "
            f"{', '.join(map(str, fits))} nodes; resume on one of those, or from an epoch's start with "
            f"PartitionedSampling(partitions=...) a multiple of {nodes}"
        )
    if node >= nodes:
        raise ValueError(f"node must be < nodes ({nodes}), got {node}")
    share = partitions // nodes
    return range(node * share, (node + 1) * share)


def deal_shards(sampling: PartitionedSampling, epoch: int, seed: int) -> tuple[np.ndarray, ...]:
    """The shards (manifest ids) of each partition in ``epoch``, in the order they were dealt."""
    sizes, count = sampling.shard_sizes, len(sampling.shard_sizes)
    epoch, seed = check_int("epoch", epoch, 0), check_int("seed", seed, 0)
    if not sampling.shuffle:
        order = np.arange(count)
    else:
        words = [seed, epoch, _PARTITIONED, 1] if sampling.redeal else [seed, 0, _PARTITIONED, 0]
        order = np.random.Generator(np.random.PCG64(words)).permutation(count)
    # Largest first (ties in the random order), each to the least-loaded partition: loads then never differ
    # by more than the largest shard, and shards of one size (most of a converted dataset) deal round-robin,
    # in the order of _even_order among equal loads.
    order = order[np.argsort(-sizes[order], kind="stable")]
    heap = [(0, i, p) for i, p in enumerate(_even_order(sampling.partitions))]
    dealt: list[list[int]] = [[] for _ in range(sampling.partitions)]
    for k in order.tolist():
        load, i, p = heap[0]
        dealt[p].append(k)
        heapq.heapreplace(heap, (load + int(sizes[k]), i, p))
    return tuple(np.array(d, dtype=np.int64) for d in dealt)


@functools.lru_cache(maxsize=16)
def _even_order(partitions: int) -> tuple[int, ...]:
    """The partitions in an order whose every prefix falls on the nodes of each node count dividing
    ``partitions`` as evenly as it can (0, 4, 2, 6, 1, 5, 3, 7 for 8): the shards left over from whole
    rounds of dealing then go to different nodes, whatever the node count, and no node pads for several."""
    divisors = [n for n in range(1, partitions + 1) if partitions % n == 0]
    offsets = np.cumsum([0, *divisors[:-1]])
    # blocks[d, p]: which of the counters below counts partition p's node for the d-th node count.
    blocks = np.array([off + np.arange(partitions) // (partitions // n) for off, n in zip(offsets, divisors)])
    counts = np.zeros(sum(divisors), dtype=np.int64)
    left = np.ones(partitions, dtype=bool)
    out = []
    for _ in range(partitions):
        held = counts[blocks]  # (node counts, partitions)
        excess = (held - np.minimum.reduceat(counts, offsets)[:, None]).max(axis=0)
        # The fewest surplus on any node count, then the least-held nodes, then the lowest partition.
        score = (excess * (partitions + 1) ** 2 + held.sum(axis=0)) * (partitions + 1) + np.arange(partitions)
        p = int(np.argmin(np.where(left, score, np.iinfo(np.int64).max)))
        out.append(p)
        left[p] = False
        counts[blocks[:, p]] += 1
    return tuple(out)


def _windows(sampling: PartitionedSampling, shards: np.ndarray, p: int, epoch: int, seed: int) -> list[np.ndarray]:
    """Partition ``p``'s windows (its ``shards`` as dealt) in reading order: shard ids, ``W`` at most each, as even
    as they go."""
    if sampling.shuffle:
        shards = np.random.Generator(np.random.PCG64([seed, epoch, _PARTITIONED, 2, p])).permutation(shards)
    else:
        shards = np.sort(shards)
    return np.array_split(shards, -(-len(shards) // sampling.window))


def partition_stream(
    sampling: PartitionedSampling, dealt: tuple[np.ndarray, ...], p: int, epoch: int, seed: int
) -> np.ndarray:
    """Partition ``p``'s samples (global indices, int64) in the order the epoch reads them; ``dealt`` as
    :func:`deal_shards` gives it."""
    sizes = sampling.shard_sizes
    firsts = np.cumsum(sizes) - sizes
    parts = []
    for j, shards in enumerate(_windows(sampling, dealt[p], p, epoch, seed)):
        samples = np.concatenate([np.arange(firsts[k], firsts[k] + sizes[k], dtype=np.int64) for k in shards])
        if sampling.shuffle:
            np.random.Generator(np.random.PCG64([seed, epoch, _PARTITIONED, 3, p, j])).shuffle(samples)
        parts.append(samples)
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class _Epoch:
    """One epoch's dealing with a resume state checked against it."""

    dealt: tuple[np.ndarray, ...]
    sizes: np.ndarray  # samples per partition
    start: np.ndarray  # samples of each partition already read

    def left(self, parts: range) -> int:
        return int((self.sizes[parts.start : parts.stop] - self.start[parts.start : parts.stop]).sum())


def _epoch(sampling: PartitionedSampling, epoch: int, seed: int, start: Sequence[int] | None) -> _Epoch:
    dealt = deal_shards(sampling, epoch, seed)
    sizes = np.array([int(sampling.shard_sizes[d].sum()) for d in dealt], dtype=np.int64)
    given = np.zeros(len(sizes), dtype=np.int64) if start is None else np.asarray(start).reshape(-1)
    if given.dtype == bool or given.dtype.kind not in "iu":
        raise ValueError(f"start must hold integers (samples read of each partition), got dtype {given.dtype}")
    if len(given) != len(sizes):
        if not np.any(given):
            given = np.zeros(len(sizes), dtype=np.int64)  # an epoch's start resumes on any partitions
        else:
            raise ValueError(
                f"start holds the progress of {len(given)} partitions but this run has partitions={len(sizes)}: "
                f"resume with PartitionedSampling(partitions={len(given)}) (the state's), or from an epoch's start"
            )
    bad = np.flatnonzero((given < 0) | (given > sizes))
    if len(bad):
        p = int(bad[0])
        raise ValueError(
            f"start[{p}]={int(given[p])} is not within partition {p}'s {int(sizes[p])} samples in epoch {epoch}: "
            "the state is of another dataset, seed or partitioning (compare PartitionedSampling.identity())"
        )
    return _Epoch(dealt, sizes, given.astype(np.int64))


def _per_rank(ep: _Epoch, layout: NodeLayout, partitions: int) -> int:
    """``L``: samples every rank reads in the rest of the epoch (the module docstring's padding rule)."""
    return per_rank_length([ep.left(node_partitions(n, layout.nodes, partitions)) for n in range(layout.nodes)], layout)


def per_rank_length(lefts: Sequence[int], layout: NodeLayout) -> int:
    """``L``: samples every rank reads when node ``n``'s stream holds ``lefts[n]`` samples still to read (the
    module docstring's padding rule: the most any node's split needs, or with ``"drop"`` the full batches every
    node has)."""
    if layout.last_batch == "drop":
        return min(lefts) // layout.node_batch * layout.batch_size
    return max(samples_per_rank(int(s), layout.batch_size, layout.ranks) if s else 0 for s in lefts)


def partitioned_num_batches(
    sampling: PartitionedSampling, layout: NodeLayout, epoch: int, seed: int, start: Sequence[int] | None = None
) -> int:
    """Batches every rank of the job takes in the rest of ``epoch`` from ``start`` (the same on all ranks)."""
    ep = _epoch(sampling, epoch, seed, start)
    return -(-_per_rank(ep, layout, sampling.partitions) // layout.batch_size)


def _node_labels(ep: _Epoch, parts: range, together: int | None, whole: bool = False) -> np.ndarray:
    """The partition each position of a node's stream reads, in reading order (of the whole epoch with
    ``whole``): its partitions in groups of ``together``, one group after another, each group's partitions
    merged in proportion to what is left of them (sample ``k`` of ``r`` at ``(k + 1/2) / r``, then by
    partition), so they advance together."""
    size = len(parts) if together is None else min(together, len(parts))
    out = [np.empty(0, dtype=np.int64)]
    for group in (parts[i : i + size] for i in range(0, len(parts), size)):
        left = {p: int(ep.sizes[p] - (0 if whole else ep.start[p])) for p in group}
        keys = [(2 * np.arange(r) + 1) / (2 * r) for r in left.values() if r]
        labels = [np.full(r, p, dtype=np.int64) for p, r in left.items() if r]
        if labels:
            labels, keys = np.concatenate(labels), np.concatenate(keys)
            out.append(labels[np.lexsort((labels, keys))])
    return np.concatenate(out)


def _node_stream(
    sampling: PartitionedSampling, ep: _Epoch, labels: np.ndarray, epoch: int, seed: int, whole: bool = False
) -> np.ndarray:
    """The samples a node reads at the positions :func:`_node_labels` gives: each partition's, in its order."""
    stream = np.empty(len(labels), dtype=np.int64)
    for p in np.unique(labels).tolist():
        stream[labels == p] = partition_stream(sampling, ep.dealt, p, epoch, seed)[0 if whole else ep.start[p] :]
    return stream


def partitioned_rank_indices(
    sampling: PartitionedSampling,
    layout: NodeLayout,
    node: int,
    rank: int,
    epoch: int,
    seed: int,
    start: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank`` (of ``layout.ranks``) of node ``node``: its global sample indices for the rest of ``epoch``
    and which are padding, as :func:`~dali_pipes.sampling.rules.rank_indices` returns them (int64 and bool
    arrays, :func:`partitioned_num_batches` batches of ``batch_size``, the last one maybe shorter)."""
    epoch, seed = check_int("epoch", epoch, 0), check_int("seed", seed, 0)
    ep = _epoch(sampling, epoch, seed, start)
    parts = node_partitions(node, layout.nodes, sampling.partitions)
    rank = check_int("rank", rank, 0)
    if rank >= layout.ranks:
        raise ValueError(f"rank must be < ranks per node ({layout.ranks}), got {rank}")
    length = _per_rank(ep, layout, sampling.partitions)
    stream = _node_stream(sampling, ep, _node_labels(ep, parts, layout.together), epoch, seed)
    return rank_share(
        stream,
        length,
        layout,
        rank,
        lambda: _node_stream(sampling, ep, _node_labels(ep, parts, layout.together, True), epoch, seed, True),
    )


def rank_share(
    stream: np.ndarray, length: int, layout: NodeLayout, rank: int, whole: Callable[[], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s ``(indices, is_pad)`` of a node's ``stream`` (what it has left to read), ``length`` samples
    (:func:`per_rank_length`): the slices of each step, then fillers from the node's own last samples (from
    ``whole()``, its whole epoch's stream, when nothing is left): the module docstring's rules."""
    b, ranks = layout.batch_size, layout.ranks
    indices, is_pad = np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
    if layout.last_batch == "drop" and length:
        indices, is_pad = split_order(stream[: length * ranks], b, rank, ranks, "drop")
    elif layout.last_batch == "pad" and len(stream):
        indices, is_pad = split_order(stream, b, rank, ranks, "pad")
    extra = length - len(indices)
    indices = np.concatenate([indices, np.zeros(extra, dtype=np.int64)])
    is_pad = np.concatenate([is_pad, np.ones(extra, dtype=bool)])
    pads = np.flatnonzero(is_pad)
    if len(pads):
        # The node's own last-read samples (split_order's wrap-around would reach back to its first window).
        if not len(stream):
            stream = whole()
        indices[pads] = stream[-1 - (rank + np.arange(len(pads)) * ranks) % len(stream)]
    return indices, is_pad


def partitioned_progress(
    sampling: PartitionedSampling,
    layout: NodeLayout,
    epoch: int,
    seed: int,
    steps: int,
    start: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """The state to save once every rank has taken ``steps`` batches of the rest of ``epoch`` from ``start``:
    samples read of each partition's stream. All of each once every batch is taken (with ``"drop"`` too:
    the dropped rest is never read)."""
    epoch, seed = check_int("epoch", epoch, 0), check_int("seed", seed, 0)
    ep = _epoch(sampling, epoch, seed, start)
    total = -(-_per_rank(ep, layout, sampling.partitions) // layout.batch_size)
    steps = check_int("steps", steps, 0)
    if steps > total:
        raise ValueError(f"steps must be <= {total} (the batches per rank left in this epoch), got {steps}")
    if steps == total and steps:  # every batch taken: the whole epoch (none left to take: nothing more read)
        return tuple(int(s) for s in ep.sizes)
    done = ep.start.copy()
    for n in range(layout.nodes):
        labels = _node_labels(ep, node_partitions(n, layout.nodes, sampling.partitions), layout.together)
        done += np.bincount(labels[: steps * layout.node_batch], minlength=sampling.partitions)
    return tuple(int(s) for s in done)


def node_window_spans(
    sampling: PartitionedSampling,
    layout: NodeLayout,
    node: int,
    epoch: int,
    seed: int,
    start: Sequence[int] | None = None,
) -> tuple[WindowSpan, ...]:
    """The windows node ``node`` reads in the rest of ``epoch``, by where they start: their shards and the
    stretch of its stream their samples lie in (what :func:`~dali_pipes.sampling.windowed.shards_needed`
    takes; step ``k`` of its ranks reads positions ``[k b R, (k+1) b R)``). The windows of the partitions a
    node reads together overlap; a window begun before ``start`` covers what is left of it."""
    epoch, seed = check_int("epoch", epoch, 0), check_int("seed", seed, 0)
    ep = _epoch(sampling, epoch, seed, start)
    parts = node_partitions(node, layout.nodes, sampling.partitions)
    labels = _node_labels(ep, parts, layout.together)
    found = []
    for p in parts:
        where = np.flatnonzero(labels == p)  # the node positions of what is left of p, in p's order
        first, begun = 0, int(ep.start[p])
        for shards in _windows(sampling, ep.dealt[p], p, epoch, seed):
            lo, hi = max(first, begun), first + int(sampling.shard_sizes[shards].sum())
            if hi > lo:
                found.append((int(where[lo - begun]), int(where[hi - 1 - begun]) + 1, p, tuple(shards.tolist())))
            first = hi
    found.sort()
    return tuple(WindowSpan(j, shards, lo, hi) for j, (lo, hi, _, shards) in enumerate(found))


def node_bytes(
    sampling: PartitionedSampling, shard_bytes: Sequence[int] | np.ndarray, nodes: int, epoch: int, seed: int
) -> np.ndarray:
    """Bytes each of ``nodes`` nodes reads in ``epoch`` (int64, one per node): its partitions' shards that
    hold samples, each once (its padding comes from them too). They add up to the dataset's bytes in shards
    with samples: what all nodes together download an epoch when each shard stays cached while its window
    is read."""
    sizes = sampling.shard_sizes
    raw = np.asarray(shard_bytes).reshape(-1)
    if len(raw) != len(sizes) or raw.dtype == bool or raw.dtype.kind not in "iu" or np.any(raw < 0):
        raise ValueError(f"shard_bytes must hold {len(sizes)} integers >= 0 (bytes of each shard), got {raw!r}")
    dealt = deal_shards(sampling, epoch, seed)
    read = raw.astype(np.int64) * (sizes > 0)
    out = []
    for n in range(check_int("nodes", nodes, 1)):
        parts = node_partitions(n, nodes, sampling.partitions)
        out.append(sum(int(read[dealt[p]].sum()) for p in parts))
    return np.array(out, dtype=np.int64)
