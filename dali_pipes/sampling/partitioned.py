"""Partitioned streamed epochs: each node's ranks read only their node's share of the shards.

Pure functions of ``(seed, epoch, shard sizes, P, W, shuffle)`` and the layout, over integers and numpy
arrays (no I/O, no environment). The contract:

- **Dealing.** The shards are dealt to ``P`` partitions, balanced by samples: taken in a random order
  (of ``seed``, fixed for the run; of ``(seed, epoch)`` with ``redeal=True``; the manifest order without
  ``shuffle``), then largest first, each goes whole to the partition holding the fewest samples so far
  (on a tie, in an order that spreads the shards left over from whole rounds over the nodes of every
  node count dividing ``P``). No shard is split, so each is read by one node an epoch; two partitions
  differ by at most the largest shard's samples, and with shards of one size two nodes by one shard. Every partition gets a shard with samples: ``P`` may not pass the
  shards that have some (:func:`default_partitions`).
- **A partition's stream.** Its shards permuted by ``(seed, epoch, p)``, cut into the fewest
  windows of at most ``W`` shards, of shard counts that differ by one at most (128 shards and ``W = 51``:
  43, 43, 42, not 51, 51, 26: no narrow last window), each window's samples shuffled together, the
  windows read in order.
  It depends on neither the node count, the ranks nor the batch size. Without ``shuffle``: its shards
  in manifest order, their samples in order.
- **Nodes.** ``N`` must divide ``P``; node ``n`` holds partitions ``[n P/N, (n+1) P/N)``. Its stream is
  their windows (what is left of them), one window at a time, interleaved: ordered by where each
  window's middle falls in its partition, as a fraction of it, then by partition. So a node's partitions
  advance together, within about a window of each other, and a state resumed on more nodes leaves them
  about equal work (read one partition after another, the node that held the partitions read first
  would be left with little and the others would pad for the difference). A window is node-wide: its
  ``R`` ranks read it together, as :func:`~dali_pipes.sampling.rules.split_order` cuts an order: at
  step ``k`` they read node positions ``[k b R, (k+1) b R)``, rank ``j`` the ``j``-th slice of ``b``,
  the tail dealt evenly.
- **Padding.** Every rank of the job reads the same number of samples ``L``, so the same batches of the
  same sizes: with ``last_batch="pad"`` the most any node's split needs; a node that needs fewer gets
  ``is_pad`` fillers from its own stream, the last samples it read (the last window, still cached):
  rank ``j``'s ``m``-th filler is ``stream[-1 - (j + m R) % len(stream)]``; a node with nothing left
  takes them from its partitions' whole stream of the epoch. Fillers never come from another node's
  shards. With ``"drop"``, every rank reads the full batches that every node has; the rest of the
  epoch is not read (at most about the largest shard's samples and a batch a node).
- **Progress and resume.** A state is ``(epoch, consumed)``: ``consumed[p]`` is how many samples of
  partition ``p``'s stream are read, always a prefix of it (``None``: none). After ``k`` steps (batches
  every rank has taken; DDP keeps them in lockstep) node ``n`` has read ``min(k b R, S_n)`` of its
  stream of ``S_n`` samples; :func:`partitioned_progress` maps that to the partitions. A state resumes
  on any ranks per node and batch size, and on any ``N'`` dividing ``P``: the rest of each partition,
  ``stream_p[consumed[p]:]``, goes to the node that now holds ``p``, so every sample not yet read is
  read exactly once in the rest of the epoch and none twice. Mid-epoch the streams must be the same:
  the same :meth:`PartitionedSampling.identity` (keep the state's ``P`` and ``W`` to the epoch's end; the
  next epoch may take new ones). At an epoch's start (all zero) any ``P`` will do. Other ``P`` mid-epoch
  and ``N'`` not dividing ``P`` are refused (``ValueError``, saying what to pass); so is ``N > P``, which
  would make nodes share a partition's windows and download them twice. ``P = 8`` by default: 1, 2, 4
  and 8 nodes resume each other's states.

How a loader uses it: each rank takes :func:`partitioned_rank_indices` at an epoch's start, saves
``(epoch, partitioned_progress(..., steps, start))``, and keeps in the node's cache the shards of
:func:`~dali_pipes.sampling.windowed.shards_needed` over :func:`node_window_spans` for the node positions
of the next steps; :func:`node_bytes` says what each node downloads an epoch.

Against MosaicML Streaming's canonical nodes (``streaming/base/partition/orig.py``, ``shuffle/py1s.py``):
there each canonical node's span of samples may split a shard with its neighbour (two nodes download
it), rows are evened out by repeating samples without a mask, a resume offset not divisible by the
node count is rounded down (samples read twice), and a node reads its canonical nodes interleaved,
one span of each at once. Here shards are never split, padding is flagged and never counted, resume
is exact, and a node reads one window at a time. The price: a window lies within one partition, so
it holds at most ``1/P`` of the dataset (a node whose cache holds more could mix wider).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Sequence

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
    "partitioned_num_batches",
    "partitioned_progress",
    "partitioned_rank_indices",
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

    ``shard_sizes``: samples per shard in manifest order; ``window``: shards per node-wide window (the
    caller sizes it from the node's cache); ``partitions``: ``P``; ``redeal``: deal the shards anew each
    epoch (by default once for the run, so a node whose cache holds its share downloads it once).
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
    """Who reads: ``nodes`` nodes of ``ranks`` ranks each, ``batch_size`` samples a rank's batch."""

    nodes: int = 1
    ranks: int = 1
    batch_size: int = 1
    last_batch: str = "pad"

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks", "batch_size"):
            object.__setattr__(self, name, check_int(f"NodeLayout.{name}", getattr(self, name), 1))
        _check_last_batch(self.last_batch)

    @property
    def node_batch(self) -> int:
        """Samples a node's ranks read together in a step."""
        return self.batch_size * self.ranks


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
    lefts = [ep.left(node_partitions(n, layout.nodes, partitions)) for n in range(layout.nodes)]
    if layout.last_batch == "drop":
        return min(lefts) // layout.node_batch * layout.batch_size
    return max(samples_per_rank(s, layout.batch_size, layout.ranks) if s else 0 for s in lefts)


def partitioned_num_batches(
    sampling: PartitionedSampling, layout: NodeLayout, epoch: int, seed: int, start: Sequence[int] | None = None
) -> int:
    """Batches every rank of the job takes in the rest of ``epoch`` from ``start`` (the same on all ranks)."""
    ep = _epoch(sampling, epoch, seed, start)
    return -(-_per_rank(ep, layout, sampling.partitions) // layout.batch_size)


@dataclass(frozen=True)
class _Read:
    """A stretch of a node's stream: positions ``[lo, hi)`` of partition ``p``'s stream, in window ``shards``."""

    p: int
    shards: np.ndarray
    lo: int
    hi: int


def _node_reads(
    sampling: PartitionedSampling, ep: _Epoch, parts: range, epoch: int, seed: int, whole: bool = False
) -> list[_Read]:
    """The windows the node holding ``parts`` reads in the rest of the epoch (the whole epoch with ``whole``),
    in reading order: by where each window's middle falls in its partition, as a fraction of it, then by
    partition. So the node's partitions advance together, a window at a time."""
    keyed = []
    for p in parts:
        first, start = 0, 0 if whole else int(ep.start[p])
        for shards in _windows(sampling, ep.dealt[p], p, epoch, seed):
            length = int(sampling.shard_sizes[shards].sum())
            if first + length > max(first, start):  # not read yet, or partly
                middle = Fraction(2 * first + length, 2 * int(ep.sizes[p]))
                keyed.append((middle, p, _Read(p, shards, max(first, start), first + length)))
            first += length
    return [read for _, _, read in sorted(keyed, key=lambda k: k[:2])]


def _node_stream(sampling: PartitionedSampling, ep: _Epoch, reads: list[_Read], epoch: int, seed: int) -> np.ndarray:
    """The samples of ``reads`` (:func:`_node_reads`) one after the other: what the node's ranks read."""
    streams = {p: partition_stream(sampling, ep.dealt, p, epoch, seed) for p in {r.p for r in reads}}
    return np.concatenate([streams[r.p][r.lo : r.hi] for r in reads] or [np.empty(0, dtype=np.int64)])


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
    stream = _node_stream(sampling, ep, _node_reads(sampling, ep, parts, epoch, seed), epoch, seed)
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
            stream = _node_stream(sampling, ep, _node_reads(sampling, ep, parts, epoch, seed, whole=True), epoch, seed)
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
    if steps == total:
        return tuple(int(s) for s in ep.sizes)
    done = ep.start.copy()
    for n in range(layout.nodes):
        parts = node_partitions(n, layout.nodes, sampling.partitions)
        read = min(steps * layout.node_batch, ep.left(parts))
        for r in _node_reads(sampling, ep, parts, epoch, seed):
            if read <= 0:
                break
            done[r.p] = r.lo + min(read, r.hi - r.lo)
            read -= r.hi - r.lo
    return tuple(int(s) for s in done)


def node_window_spans(
    sampling: PartitionedSampling,
    nodes: int,
    node: int,
    epoch: int,
    seed: int,
    start: Sequence[int] | None = None,
) -> tuple[WindowSpan, ...]:
    """The windows node ``node`` reads in the rest of ``epoch``: their shards and the positions of its stream
    they fill (what :func:`~dali_pipes.sampling.windowed.shards_needed` takes; a step ``k`` of its ranks reads
    positions ``[k b R, (k+1) b R)``). A window begun before ``start`` fills only what is left of it."""
    epoch, seed = check_int("epoch", epoch, 0), check_int("seed", seed, 0)
    ep = _epoch(sampling, epoch, seed, start)
    spans: list[WindowSpan] = []
    at = 0  # where the next window starts in the node's stream
    for r in _node_reads(sampling, ep, node_partitions(node, nodes, sampling.partitions), epoch, seed):
        spans.append(WindowSpan(len(spans), tuple(r.shards.tolist()), at, at + r.hi - r.lo))
        at += r.hi - r.lo
    return tuple(spans)


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
