"""Mixtures of datasets: each epoch a fixed share of samples from each, as a pure function of ``(seed, epoch)``.

The datasets sit one after the other in one global index space: dataset ``k``'s
sample ``i`` is ``offsets[k] + i``. An epoch of ``num_samples`` takes exactly
``counts[k]`` samples from dataset ``k`` (the proportions times
``num_samples``, rounded by largest remainders so that they add up), and
interleaves them at random.

- **Per sample, not per batch.** The epoch's samples of all datasets are
  shuffled together, so each position's dataset is drawn at random (with the exact counts), so every batch, and every rank's
  share, mixes the datasets in the epoch's proportions on average; per-batch
  mixing (whole batches from one dataset) would give a rank a run of batches from
  one source and make batch statistics (BatchNorm) jump between datasets.
- **Each dataset walks its own stream of permutations across epochs.** Dataset
  ``k``'s samples come from an endless sequence of permutations of it (round
  ``r`` drawn from ``(seed, k, r)``); epoch ``e`` takes the positions
  ``[e * counts[k], (e + 1) * counts[k])`` of that sequence. So no sample of a
  dataset repeats before every sample of it was drawn, also when a small
  share of a large dataset is drawn each epoch (``repeat``/``choose`` in
  MosaicML Streaming's terms, without a separate knob).

Nothing here reads a file: tested exhaustively in ``tests/test_weighted_sampling.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dali_pipes.sampling.rules import check_int
from dali_pipes.sampling.weighted import checked_weights, epoch_rng

__all__ = ["MixtureSampling", "exact_counts", "mixture_order"]


def exact_counts(proportions: Sequence[float] | np.ndarray, total: int) -> np.ndarray:
    """Counts proportional to ``proportions`` adding up to ``total`` (largest remainders, ties by position)."""
    p = checked_weights(proportions)
    share = p / p.sum() * total
    counts = np.floor(share).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(share - counts), kind="stable")[:short]] += 1
    return counts


def _stream(size: int, start: int, count: int, seed: int, dataset: int) -> np.ndarray:
    """The samples at positions ``[start, start + count)`` of dataset ``dataset``'s endless sequence of permutations.

    As a set, in no particular order: the caller shuffles the whole epoch. So a
    round the window covers whole is just ``range(size)``; only a round cut by
    the window needs its permutation, to know which of its samples fall inside.
    """
    parts = []
    for r in range(start // size, (start + count - 1) // size + 1 if count else 0):
        lo, hi = max(start - r * size, 0), min(start + count - r * size, size)
        if lo == 0 and hi == size:
            parts.append(np.arange(size, dtype=np.int64))
        else:  # round r of dataset k: its own numbers, apart from epoch_rng's (third key 2, not 1)
            parts.append(np.random.Generator(np.random.PCG64([seed, r, 2, dataset])).permutation(size)[lo:hi])
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def mixture_order(
    sizes: Sequence[int], proportions: Sequence[float], num_samples: int, epoch: int, seed: int
) -> np.ndarray:
    """The global order of an epoch of ``num_samples`` from datasets of ``sizes`` in ``proportions``.

    Dataset ``k``'s sample ``i`` has the global index ``sum(sizes[:k]) + i``;
    each epoch holds exactly :func:`exact_counts` samples of each dataset (see the
    module docstring for the order within a dataset and across epochs).
    """
    sizes_a = np.array([check_int("sizes[]", s, 1) for s in sizes], dtype=np.int64)
    if len(proportions) != len(sizes_a):
        raise ValueError(f"{len(sizes_a)} datasets but {len(proportions)} proportions")
    n = check_int("num_samples", num_samples, 1)
    seed, epoch = check_int("seed", seed, 0), check_int("epoch", epoch, 0)
    counts = exact_counts(proportions, n)
    offsets = np.concatenate([[0], np.cumsum(sizes_a)[:-1]])
    order = np.concatenate(
        [
            _stream(size, epoch * count, count, seed, k) + offsets[k]
            for k, (size, count) in enumerate(zip(sizes_a.tolist(), counts.tolist()))
        ]
    )
    # One shuffle of the whole epoch interleaves the datasets: each position's dataset is drawn with the
    # exact counts, and within a dataset its samples come in random order.
    epoch_rng(seed, epoch, stream=1).shuffle(order)
    return order


@dataclass(frozen=True)
class MixtureSampling:
    """The epoch draw of a mixture of datasets (made by :class:`~dali_pipes.Mixture`; see the module docstring).

    ``names`` and ``sizes`` are the datasets' in index order, ``proportions`` their
    shares of each epoch, ``num_samples`` the epoch's length over all ranks
    (default: the datasets' total).
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    proportions: tuple[float, ...]
    num_samples: int | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.sizes) == len(self.proportions):
            raise ValueError(
                f"a mixture needs as many proportions as datasets: {len(self.names)} names, "
                f"{len(self.sizes)} sizes, {len(self.proportions)} proportions"
            )
        checked_weights(self.proportions)
        if self.num_samples is not None:
            check_int("Mixture.num_samples", self.num_samples, 1)

    def epoch_length(self, dataset_size: int) -> int:
        """Samples per epoch over all ranks; refuses a store that is not this mixture's."""
        if dataset_size != sum(self.sizes):
            raise ValueError(f"the mixture has {sum(self.sizes)} samples, but the store given has {dataset_size}")
        return self.num_samples or dataset_size

    def counts(self, dataset_size: int) -> dict[str, int]:
        """Samples of each dataset per epoch."""
        return dict(zip(self.names, exact_counts(self.proportions, self.epoch_length(dataset_size)).tolist()))

    def order(self, dataset_size: int, epoch: int, seed: int) -> np.ndarray:
        """The global draw of ``epoch``."""
        return mixture_order(self.sizes, self.proportions, self.epoch_length(dataset_size), epoch, seed)

    def identity(self) -> dict[str, Any]:
        """What a saved loader state must agree on: the datasets, their sizes and shares, and the epoch length."""
        return {
            "mixture": list(self.names),
            "sizes": list(self.sizes),
            "proportions": list(self.proportions),
            "num_samples": self.num_samples,
        }
