"""Who reads which sample when: epoch order, DDP rank split, padding and resume.

Pure functions over integers and numpy arrays (no DALI, no I/O), so every rule
here can be tested exhaustively in milliseconds.

The rules:

- The global order of epoch ``e`` is a permutation of ``range(N)`` drawn from
  ``(seed, e)`` (:func:`epoch_order`); without shuffling it is ``0..N-1``.
- ``start`` global samples of that order are already consumed (a resume
  offset); the *remainder* ``order[start:]`` is what this pass covers. It does
  not depend on the world size, so a run can resume on another one.
- The remainder is cut into global batches of ``batch_size * world_size``; rank
  ``r`` takes the contiguous slice ``[r * batch_size, (r + 1) * batch_size)`` of
  each, so every rank gets the same number of batches.
- The incomplete last global batch (``T`` samples, ``0 < T < batch_size *
  world_size``): with ``last_batch="pad"`` each rank takes ``ceil(T / world_size)``
  samples (at most ``batch_size``). The ``T`` real ones are dealt out as evenly as
  they go, in order: rank ``r`` takes the next ``T // world_size`` of them, one
  more for the first ``T % world_size`` ranks, so no rank has two real samples
  more than another; each of the other ranks then takes one filler sample,
  wrapped around from the start of the epoch order and flagged in ``is_pad``.
  Every sample of the remainder is then seen exactly once across the ranks,
  fewer than ``world_size`` samples are padding, and a rank's last batch is all
  padding only when ``T < world_size`` (:func:`padding_only_ranks`): an evaluation
  that drops the padding then has real rows on every rank. With
  ``last_batch="drop"`` it is dropped on every rank.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import numpy as np

LastBatch = Literal["pad", "drop"]
#: Where :func:`split_order` takes its filler samples: wrapped around from the order's start, or from its end.
PadFrom = Literal["start", "end"]
LAST_BATCH_POLICIES: tuple[str, ...] = ("pad", "drop")

__all__ = [
    "LAST_BATCH_POLICIES",
    "EpochRules",
    "PadFrom",
    "World",
    "check_int",
    "epoch_order",
    "num_batches",
    "padding_only_ranks",
    "rank_indices",
    "samples_consumed",
    "samples_per_rank",
    "split_order",
]


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an ``int`` of at least ``minimum``; ValueError naming ``name`` for a bool, float or string."""
    # operator.index accepts Python and numpy integers and refuses floats and strings;
    # bools are integers to Python but never a meaningful count here.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_last_batch(last_batch: str) -> str:
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
    return last_batch


@dataclass(frozen=True)
class World:
    """This process's place in a data-parallel job: ``rank`` of ``world_size``."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        world_size = check_int("world_size", self.world_size, 1)
        rank = check_int("rank", self.rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world_size", world_size)


@dataclass(frozen=True)
class EpochRules:
    """What stays fixed, for one loader, of how each epoch is split into this rank's batches: the arguments of
    :func:`rank_indices` other than the epoch and the resume offset. Values are checked by whoever takes them
    from the user (``DALILoader``)."""

    batch_size: int
    world: World = World()
    seed: int = 0
    shuffle: bool = True
    last_batch: str = "pad"


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The global sample order of ``epoch``: an ``int64`` permutation of ``range(num_samples)``.

    Drawn from a PCG64 generator seeded with ``(seed, epoch)``, so it is the same
    in every process and on every world size, and differs between epochs. With
    ``shuffle=False`` it is ``0..num_samples-1``.
    """
    n = check_int("num_samples", num_samples, 1)
    epoch = check_int("epoch", epoch, 0)
    seed = check_int("seed", seed, 0)
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return rng.permutation(n).astype(np.int64, copy=False)


def _layout(remaining: int, batch_size: int, world_size: int, last_batch: str) -> tuple[int, int]:
    """``(full global batches, samples per rank in the tail batch)`` for ``remaining`` samples."""
    global_batch = batch_size * world_size
    full, tail = divmod(remaining, global_batch)
    if tail == 0 or last_batch == "drop":
        return full, 0
    return full, -(-tail // world_size)


def _check_common(
    num_samples: int, batch_size: int, world_size: int, last_batch: str, start: int
) -> tuple[int, int, int, str, int]:
    n = check_int("num_samples", num_samples, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    world_size = check_int("world_size", world_size, 1)
    last_batch = _check_last_batch(last_batch)
    start = check_int("start", start, 0)
    if start > n:
        raise ValueError(f"start must be <= num_samples ({n}), got {start}")
    return n, batch_size, world_size, last_batch, start


def num_batches(
    num_samples: int,
    batch_size: int,
    world_size: int = 1,
    last_batch: LastBatch = "pad",
    start: int = 0,
) -> int:
    """Batches each rank yields for the rest of an epoch (the same on every rank).

    ``ceil((num_samples - start) / (batch_size * world_size))`` with ``"pad"``,
    the floor with ``"drop"``.
    """
    n, batch_size, world_size, last_batch, start = _check_common(num_samples, batch_size, world_size, last_batch, start)
    full, tail_per_rank = _layout(n - start, batch_size, world_size, last_batch)
    return full + (1 if tail_per_rank else 0)


def samples_per_rank(
    num_samples: int,
    batch_size: int,
    world_size: int = 1,
    last_batch: LastBatch = "pad",
    start: int = 0,
) -> int:
    """Samples each rank reads for the rest of an epoch: the length of :func:`rank_indices`."""
    n, batch_size, world_size, last_batch, start = _check_common(num_samples, batch_size, world_size, last_batch, start)
    full, tail_per_rank = _layout(n - start, batch_size, world_size, last_batch)
    return full * batch_size + tail_per_rank


def samples_consumed(
    num_samples: int,
    batch_size: int,
    world_size: int,
    batches: int,
    last_batch: LastBatch = "pad",
    start: int = 0,
) -> int:
    """Global samples of the epoch consumed once every rank has taken ``batches`` batches.

    The resume offset to save: ``start + batches * batch_size * world_size``,
    capped at ``num_samples`` (the padded tail batch completes the epoch). With
    ``"drop"``, taking every batch also completes the epoch: the dropped tail is
    never read, so the result is ``num_samples``.
    """
    n, batch_size, world_size, last_batch, start = _check_common(num_samples, batch_size, world_size, last_batch, start)
    total = num_batches(n, batch_size, world_size, last_batch, start)
    batches = check_int("batches", batches, 0)
    if batches > total:
        raise ValueError(f"batches must be <= {total} (the batches per rank left in this epoch), got {batches}")
    if batches == total:
        return n
    return start + batches * batch_size * world_size


def rank_indices(
    num_samples: int,
    batch_size: int,
    rank: int,
    world_size: int,
    epoch: int,
    seed: int,
    shuffle: bool = True,
    last_batch: LastBatch = "pad",
    start: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's global sample indices for the rest of ``epoch``, and which of them are padding.

    Returns ``(indices, is_pad)``: an ``int64`` array in the order the rank reads
    them and a ``bool`` array of the same length, ``num_batches(...)`` batches
    long where only the last batch may be shorter than ``batch_size``. See the
    module docstring for the rules.
    """
    n, batch_size, world_size, last_batch, start = _check_common(num_samples, batch_size, world_size, last_batch, start)
    return split_order(epoch_order(n, epoch, seed, shuffle), batch_size, rank, world_size, last_batch, start)


def split_order(
    order: np.ndarray,
    batch_size: int,
    rank: int,
    world_size: int,
    last_batch: LastBatch = "pad",
    start: int = 0,
    pad_from: PadFrom = "start",
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`rank_indices` for any global order of an epoch (a permutation, or a weighted draw with repeats).

    ``order`` is the epoch's global sequence of sample indices; the rank split,
    the padding by wrap-around from its start and the resume offset ``start`` are
    those of the module docstring, with ``N = len(order)``. ``pad_from="end"`` takes
    the filler samples backwards from the order's end instead (its last sample, then
    the one before...): samples of the last batches, which a streaming cache still
    holds, where the epoch's start was evicted long ago (:mod:`.windowed`).
    """
    order = np.asarray(order, dtype=np.int64)
    _, batch_size, world_size, last_batch, start = _check_common(len(order), batch_size, world_size, last_batch, start)
    world = World(rank, world_size)
    rest = order[start:]
    full, tail_per_rank = _layout(len(rest), batch_size, world_size, last_batch)

    # Full global batches: a (batch, rank, position) view, this rank's column.
    body = rest[: full * batch_size * world_size].reshape(full, world_size, batch_size)[:, world.rank, :].ravel()
    if not tail_per_rank:
        return np.ascontiguousarray(body), np.zeros(len(body), dtype=bool)

    tail = rest[full * batch_size * world_size :]
    per_rank, extra = divmod(len(tail), world_size)
    # This rank's real samples: the next ``per_rank`` of the tail, one more for the first ``extra`` ranks.
    lo = world.rank * per_rank + min(world.rank, extra)
    real = tail[lo : lo + per_rank + (world.rank < extra)]
    filler = np.empty(0, dtype=np.int64)
    if len(real) < tail_per_rank:
        # One filler sample each for ranks extra.., wrapped around from the epoch's start: np.resize repeats
        # ``order`` cyclically, which covers more ranks than samples.
        filler = np.resize(order if pad_from == "start" else order[::-1], world.rank - extra + 1)[-1:]
    indices = np.concatenate([body, real, filler])
    is_pad = np.zeros(len(indices), dtype=bool)
    is_pad[len(body) + len(real) :] = True
    return indices, is_pad


def padding_only_ranks(
    num_samples: int, batch_size: int, world_size: int, last_batch: LastBatch = "pad", start: int = 0
) -> tuple[int, ...]:
    """The ranks whose last batch of the rest of an epoch holds only padding (none with ``"drop"``).

    With the split of the module docstring, those are the ranks from ``T`` on when
    the last global batch holds ``T < world_size`` samples: fewer samples than
    ranks, so some rank has no real one. Dropping the padding would leave them an
    empty batch.
    """
    n, batch_size, world_size, last_batch, start = _check_common(num_samples, batch_size, world_size, last_batch, start)
    tail = (n - start) % (batch_size * world_size)
    if last_batch == "drop" or tail == 0 or tail >= world_size:
        return ()
    return tuple(range(tail, world_size))
