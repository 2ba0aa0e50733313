"""Shard-windowed epochs: an order a bounded cache can follow, as a pure function of ``(seed, epoch)``.

A random order over all samples reads from every shard at once, so streaming it
from object storage needs the whole dataset in the cache. The windowed order
reads a few shards at a time instead:

- The shards are permuted by ``(seed, epoch)``; the permuted list is cut into
  consecutive *windows* of ``window`` shards (the last one may hold fewer).
- The samples of each window are shuffled together, by ``(seed, epoch, window
  number)``, and the windows are read one after the other.

The result is a permutation of all samples that does not depend on the world
size, so :func:`~dali_pipes.sampling.rules.split_order` cuts it into per-rank
batches exactly as it cuts :func:`~dali_pipes.sampling.rules.epoch_order`:
exactly once, equal batch counts, ``is_pad``, resume from ``start`` on another
world size. While the ranks read window ``j``, the cache needs only its shards
plus those of window ``j + 1`` being prefetched (:func:`window_spans` says which
global positions each window covers, :func:`choose_window` sizes it).

A global batch of ``b`` consecutive positions reads from at most two
consecutive windows when ``b`` is at most a window's samples. The price is
shuffle quality: a batch mixes only the samples of ``window`` shards, so on a
dataset written class by class it sees few classes; :func:`batch_mixing` and
:func:`compare_mixing` measure it against a global permutation.

With ``shuffle=False`` the order is the manifest's (``0..N-1``). With
``window`` at least the number of shards there is one window: a uniform
random permutation of all samples, but drawn from other random numbers than
:func:`~dali_pipes.sampling.rules.epoch_order`'s, so not the same permutation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from dali_pipes.sampling.rules import check_int, epoch_order

__all__ = [
    "BatchMixing",
    "WindowSpan",
    "WindowedSampling",
    "batch_mixing",
    "checked_shard_sizes",
    "choose_window",
    "window_and_ahead",
    "compare_mixing",
    "shard_of",
    "shards_needed",
    "spans_between",
    "window_spans",
    "windowed_order",
]

# The third word of the generators' seeds: apart from epoch_order's ([seed, epoch]), weighted draws' (1) and
# mixtures' (2). The shard permutation ends in 1, window j's shuffle in (2, j): never the same seed words.
_STREAM = 3


def checked_shard_sizes(shard_sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """``shard_sizes`` (samples per shard, in manifest order) as int64, refused when empty, negative or not integers."""
    sizes = np.asarray(shard_sizes).reshape(-1)
    if len(sizes) == 0:
        raise ValueError("shard_sizes is empty: give the number of samples of each shard")
    if sizes.dtype == bool or sizes.dtype.kind not in "iu":
        raise ValueError(f"shard_sizes must be integers (samples per shard), got dtype {sizes.dtype}")
    sizes = sizes.astype(np.int64)
    if np.any(sizes < 0):
        bad = int(np.flatnonzero(sizes < 0)[0])
        raise ValueError(f"shard_sizes must be >= 0; shard {bad} has {int(sizes[bad])}")
    if sizes.sum() == 0:
        raise ValueError(f"shard_sizes are all 0 ({len(sizes)} shards): the dataset has no samples")
    return sizes


def _check_args(
    shard_sizes: Sequence[int] | np.ndarray, epoch: int, seed: int, window: int
) -> tuple[np.ndarray, int, int, int]:
    sizes = checked_shard_sizes(shard_sizes)
    return sizes, check_int("epoch", epoch, 0), check_int("seed", seed, 0), check_int("window", window, 1)


def _shard_order(num_shards: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """The shards in the order the epoch reads them."""
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch, _STREAM, 1]))
    return rng.permutation(num_shards).astype(np.int64, copy=False)


def _window_bounds(lengths: np.ndarray, window: int) -> np.ndarray:
    """Global positions where each window starts, then the epoch's length: ``len = windows + 1``."""
    ends = np.concatenate([[0], np.cumsum(lengths)])
    return ends[np.append(np.arange(0, len(lengths), window), len(lengths))]


def windowed_order(
    shard_sizes: Sequence[int] | np.ndarray, epoch: int, seed: int, window: int, shuffle: bool = True
) -> np.ndarray:
    """The global sample order of ``epoch``: an int64 permutation of all samples, read window by window.

    Shard ``k`` holds the global samples ``sum(shard_sizes[:k]) ..`` (manifest
    order). The shards are permuted by ``(seed, epoch)``, cut into windows of
    ``window`` shards, and each window's samples shuffled together (see the module
    docstring). Feed it where :func:`~dali_pipes.sampling.rules.epoch_order`'s
    permutation goes: :func:`~dali_pipes.sampling.rules.split_order`.
    """
    sizes, epoch, seed, window = _check_args(shard_sizes, epoch, seed, window)
    total = int(sizes.sum())
    if not shuffle:
        return np.arange(total, dtype=np.int64)
    shards = _shard_order(len(sizes), epoch, seed, shuffle)
    lengths = sizes[shards]
    firsts = (np.cumsum(sizes) - sizes)[shards]  # each shard's first global sample
    # Position p of the concatenated shards holds firsts[k] + (p - where shard k starts in that concatenation).
    order = np.arange(total, dtype=np.int64) + np.repeat(firsts - (np.cumsum(lengths) - lengths), lengths)
    bounds = _window_bounds(lengths, window)
    for j, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        np.random.Generator(np.random.PCG64([seed, epoch, _STREAM, 2, j])).shuffle(order[lo:hi])
    return order


@dataclass(frozen=True)
class WindowSpan:
    """Window ``window`` of an epoch: its ``shards`` (manifest ids, in reading order) fill positions ``[start, stop)``."""

    window: int
    shards: tuple[int, ...]
    start: int
    stop: int


def window_spans(
    shard_sizes: Sequence[int] | np.ndarray, epoch: int, seed: int, window: int, shuffle: bool = True
) -> tuple[WindowSpan, ...]:
    """Each window of :func:`windowed_order` (same arguments): which shards it reads, which positions it fills.

    What a cache prefetcher needs: the shards of the windows that the next
    batches' global positions fall in (:func:`shards_needed`), without computing
    the order itself.
    """
    sizes, epoch, seed, window = _check_args(shard_sizes, epoch, seed, window)
    shards = _shard_order(len(sizes), epoch, seed, shuffle)
    bounds = _window_bounds(sizes[shards], window).tolist()
    return tuple(
        WindowSpan(j, tuple(shards[j * window : (j + 1) * window].tolist()), bounds[j], bounds[j + 1])
        for j in range(len(bounds) - 1)
    )


def spans_between(spans: Iterable[WindowSpan], start: int, stop: int) -> tuple[WindowSpan, ...]:
    """The windows that global positions ``[start, stop)`` read from, in order (windows without samples never)."""
    start = check_int("start", start, 0)
    stop = check_int("stop", stop, start)
    return tuple(s for s in spans if s.start < stop and s.stop > start and s.stop > s.start)


def shards_needed(spans: Iterable[WindowSpan], start: int, stop: int) -> tuple[int, ...]:
    """The shards (manifest ids, in reading order) to have in the cache for global positions ``[start, stop)``.

    Whole windows: a window's samples are shuffled together, so any batch of it
    may read any of its shards. For the next ``k`` batches of every rank from
    ``consumed`` global samples, ask for ``[consumed, consumed + k * batch_size * world_size)``.
    """
    return tuple(k for s in spans_between(spans, start, stop) for k in s.shards)


def shard_of(indices: Sequence[int] | np.ndarray, shard_sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """The shard (manifest id) holding each global sample index in ``indices``."""
    ends = np.cumsum(checked_shard_sizes(shard_sizes))
    indices = np.asarray(indices, dtype=np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= ends[-1]):
        raise ValueError(f"indices must lie in [0, {int(ends[-1])}), the dataset's samples")
    return np.searchsorted(ends, indices, side="right").astype(np.int64)


def choose_window(cache_limit_bytes: int, shard_bytes: Sequence[int] | np.ndarray, *, windows: int = 2) -> int:
    """The most shards per window such that ``windows`` windows fit in ``cache_limit_bytes``; at least 1.

    Two windows by default: the one the ranks read and the next, prefetched while
    they read, so the GPU never waits for a window's first download. Which shards
    share a window changes every epoch, so the bound takes the largest shards:
    any ``windows * W`` of them fit. A dataset that fits whole is one window (a
    global shuffle, nothing evicted). When not even ``windows`` single shards fit
    the result is still 1: the cache then needs more than its limit, which the
    caller should refuse or report.
    """
    limit = check_int("cache_limit_bytes", cache_limit_bytes, 1)
    windows = check_int("windows", windows, 1)
    sizes = checked_shard_sizes(shard_bytes)
    if int(sizes.sum()) <= limit:
        return len(sizes)
    return max(1, _largest_that_fit(limit, sizes) // windows)


def _largest_that_fit(budget: int, sizes: np.ndarray) -> int:
    """How many of the largest shards fit in ``budget`` bytes together (any that many shards then fit)."""
    return int(np.searchsorted(np.cumsum(np.sort(sizes)[::-1]), budget, side="right"))


def window_and_ahead(
    budget_bytes: int, shard_bytes: Sequence[int] | np.ndarray, fetch_ahead: int | None = None
) -> tuple[int, int]:
    """``(W, ahead)``: shards per window and shards fetched ahead of the window being read, all within ``budget_bytes``.

    ``fetch_ahead=None`` splits the room between the window and a whole next window (:func:`choose_window`),
    the rest going to the shards ahead; a number ``N`` fetches ``N`` ahead and gives the window the rest.
    Counted in the largest shards, as :func:`choose_window` does. A dataset that fits whole is one window
    with nothing to fetch ahead. Refuses (``ValueError``) a ``fetch_ahead`` that leaves no shard for a window.
    """
    budget = check_int("budget_bytes", budget_bytes, 1)
    sizes = checked_shard_sizes(shard_bytes)
    if int(sizes.sum()) <= budget:
        return len(sizes), 0
    fitting = _largest_that_fit(budget, sizes)
    if fetch_ahead is None:
        window = choose_window(budget, sizes)
        return window, max(0, fitting - window)
    ahead = check_int("fetch_ahead", fetch_ahead, 0)
    if fitting - ahead < 1:
        raise ValueError(
            f"fetch_ahead={ahead} leaves no room for a window: {budget} bytes hold {fitting} of the largest shards "
            f"({int(sizes.max())} bytes); fetch at most {max(0, fitting - 1)} ahead, or raise the cache's limit"
        )
    return fitting - ahead, ahead


@dataclass(frozen=True)
class BatchMixing:
    """How well an order mixes labels within batches: means over its full batches.

    ``distinct_classes``: labels per batch that differ; ``entropy_bits``: the
    entropy of a batch's label histogram, in bits (``log2(batch_size)`` at most,
    reached when every label differs).
    """

    distinct_classes: float
    entropy_bits: float
    batches: int


def batch_mixing(labels: Sequence[int] | np.ndarray, order: Sequence[int] | np.ndarray, batch_size: int) -> BatchMixing:
    """The label mixing of ``order`` cut into batches of ``batch_size`` consecutive samples.

    ``labels[i]`` is global sample ``i``'s label. Pass the per-rank batch size:
    a rank's batch is ``batch_size`` consecutive positions of the global order,
    and it is what batch statistics (BatchNorm) see. Only full batches count; a
    shorter order is one batch.
    """
    labels = np.asarray(labels).reshape(-1)
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    batch_size = check_int("batch_size", batch_size, 1)
    if len(order) == 0:
        raise ValueError("order is empty")
    if order.min() < 0 or order.max() >= len(labels):
        raise ValueError(f"order must index labels ({len(labels)} of them)")
    size = min(batch_size, len(order))
    rows = np.sort(labels[order[: len(order) // size * size]].reshape(-1, size), axis=1)
    # Runs of equal labels in each sorted row: their count is the distinct labels, their lengths the histogram.
    starts = np.ones(rows.shape, dtype=bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    run_id = np.cumsum(starts.ravel()) - 1
    run_lengths = np.bincount(run_id)
    run_batch = np.flatnonzero(starts.ravel()) // size
    p = run_lengths / size
    entropy = np.bincount(run_batch, weights=-p * np.log2(p), minlength=len(rows))
    return BatchMixing(float(starts.sum(axis=1).mean()), float(entropy.mean()), len(rows))


def compare_mixing(
    labels: Sequence[int] | np.ndarray,
    shard_sizes: Sequence[int] | np.ndarray,
    batch_size: int,
    windows: Iterable[int],
    *,
    epoch: int = 0,
    seed: int = 0,
) -> dict[str, BatchMixing]:
    """:func:`batch_mixing` of the windowed order for each window size, and of a global permutation.

    Keys ``"window=W"`` in the order given, then ``"global"`` (the permutation of
    :func:`~dali_pipes.sampling.rules.epoch_order`, what an unbounded cache
    allows): on labels written class by class, what each window size costs.
    """
    sizes = checked_shard_sizes(shard_sizes)
    if len(labels) != int(sizes.sum()):
        raise ValueError(f"{len(labels)} labels but the shards hold {int(sizes.sum())} samples")
    out = {f"window={w}": batch_mixing(labels, windowed_order(sizes, epoch, seed, w), batch_size) for w in windows}
    out["global"] = batch_mixing(labels, epoch_order(len(labels), epoch, seed), batch_size)
    return out


@dataclass(frozen=True, eq=False)
class WindowedSampling:
    """The epoch order of :func:`windowed_order`, in the shape the loader's other orders have.

    ``shard_sizes``: samples per shard in manifest order; ``window``: shards per
    window (:func:`choose_window`). ``order``/``epoch_length``/``identity`` as
    :class:`~dali_pipes.sampling.weighted.WeightedSampling`'s.
    """

    shard_sizes: Any
    window: int
    shuffle: bool = True
    #: The padding of an epoch's last batch is taken from the order's end (:func:`~dali_pipes.sampling.rules.split_order`):
    #: a stream's cache holds those shards still, not the epoch's first ones.
    pad_from: ClassVar[str] = "end"

    def __post_init__(self) -> None:
        sizes = checked_shard_sizes(self.shard_sizes)
        sizes.setflags(write=False)
        object.__setattr__(self, "shard_sizes", sizes)
        object.__setattr__(self, "window", check_int("WindowedSampling.window", self.window, 1))
        if not isinstance(self.shuffle, (bool, np.bool_)):
            raise ValueError(f"WindowedSampling.shuffle must be True or False, got {self.shuffle!r}")
        object.__setattr__(self, "shuffle", bool(self.shuffle))

    def epoch_length(self, dataset_size: int) -> int:
        """Samples per epoch over all ranks (the dataset's); refuses shard sizes that do not add up to it."""
        total = int(self.shard_sizes.sum())
        if total != dataset_size:
            raise ValueError(f"WindowedSampling's shards hold {total} samples but the dataset has {dataset_size}")
        return total

    def order(self, dataset_size: int, epoch: int, seed: int) -> np.ndarray:
        """The global order of ``epoch``."""
        self.epoch_length(dataset_size)
        return windowed_order(self.shard_sizes, epoch, seed, self.window, self.shuffle)

    def identity(self) -> dict[str, Any]:
        """What a saved loader state must agree on: the shards' sizes (by digest), the window and the shuffle."""
        digest = hashlib.sha256(self.shard_sizes.tobytes()).hexdigest()[:16]
        return {"shard_sizes_sha256": digest, "window": self.window, "shuffle": self.shuffle}
