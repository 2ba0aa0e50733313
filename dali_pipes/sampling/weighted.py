"""Weighted epochs: an epoch's global order drawn from weights, as a pure function of ``(seed, epoch)``.

Each function returns the epoch's global sequence of sample indices, which
:func:`~dali_pipes.sampling.rules.split_order` cuts into equal per-rank batches
with ``is_pad`` and a resume offset exactly as it cuts a permutation. Nothing
here reads a file or starts a process: every rule is tested exhaustively in
milliseconds (``tests/test_weighted_sampling.py``).

- :func:`weighted_order`: ``num_samples`` draws with probability proportional to
  ``weights``, with replacement (as ``WeightedRandomSampler``) or without (each
  sample at most once: Efraimidis-Spirakis keys ``log(u) / w``, the largest kept,
  in key order).
- :func:`class_balanced_weights`: ``1 / count`` of each sample's label, so that
  every class is drawn equally often.

Mixtures of datasets are drawn by :mod:`dali_pipes.sampling.mixture`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from dali_pipes.sampling.rules import check_int

__all__ = ["WeightedSampling", "checked_weights", "class_balanced_weights", "epoch_rng", "weighted_order"]


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The random numbers of ``(seed, epoch)`` for one use (``stream``), apart from those of a permutation."""
    # Its own stream of (seed, epoch): a weighted draw never repeats a permutation's numbers.
    return np.random.Generator(np.random.PCG64([check_int("seed", seed, 0), check_int("epoch", epoch, 0), 1, stream]))


def checked_weights(weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """``weights`` as float64, refused (naming the first bad one) when empty, negative, not finite, or all 0."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if len(w) == 0:
        raise ValueError("weights is empty: give one weight per sample")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        bad = int(np.flatnonzero(~np.isfinite(w) | (w < 0))[0])
        raise ValueError(f"weights must be finite and >= 0; sample {bad} has {w[bad]!r}")
    if not np.any(w > 0):
        raise ValueError("weights are all 0: at least one sample must be drawable")
    return w


def weighted_order(
    weights: Sequence[float] | np.ndarray, num_samples: int, epoch: int, seed: int, *, replacement: bool = True
) -> np.ndarray:
    """``num_samples`` sample indices drawn with probability proportional to ``weights``, for ``epoch``.

    With ``replacement`` (as ``torch.utils.data.WeightedRandomSampler``) a sample
    may come several times; without, each at most once, so ``num_samples`` may not
    exceed the samples of non-zero weight. The same ``(weights, num_samples,
    seed, epoch)`` always gives the same order, on every rank and world size.
    """
    w = checked_weights(weights)
    n = check_int("num_samples", num_samples, 1)
    rng = epoch_rng(seed, epoch)
    if replacement:
        # How often each sample comes (one multinomial draw), in a random order: the same distribution as n
        # independent draws, without n binary searches that miss the cache (slow for millions of samples).
        counts = rng.multinomial(n, w / w.sum())
        return rng.permutation(np.repeat(np.arange(len(w), dtype=np.int64), counts))
    positive = int(np.count_nonzero(w))
    if n > positive:
        raise ValueError(
            f"num_samples={n} without replacement, but only {positive} samples have a weight above 0; "
            "draw fewer, or with replacement"
        )
    with np.errstate(divide="ignore"):
        keys = np.log(rng.random(len(w))) / w  # -inf for weight 0: never among the largest
    top = np.argpartition(keys, len(w) - n)[len(w) - n :]
    return top[np.argsort(-keys[top], kind="stable")].astype(np.int64)


def class_balanced_weights(labels: Sequence[int] | np.ndarray) -> np.ndarray:
    """One weight per sample, ``1 / (samples of its label)``: every class is drawn equally often."""
    labels = np.asarray(labels).reshape(-1)
    if len(labels) == 0:
        raise ValueError("labels is empty")
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    return 1.0 / counts[inverse]


@dataclass(frozen=True, eq=False)
class WeightedSampling:
    """``DALILoader(..., sampling=WeightedSampling(weights))``: each epoch a weighted draw, as ``WeightedRandomSampler``.

    ``weights``: one per sample of the dataset (``class_balanced_weights(labels)``
    balances classes). ``num_samples``: the epoch's length (default: the dataset's).
    ``replacement``: as in :func:`weighted_order`. The draw of epoch ``e`` is
    :func:`weighted_order` of ``(seed, e)``, split over the ranks by
    :func:`~dali_pipes.sampling.rules.split_order`: every guarantee of a shuffled
    epoch holds (equal batch counts per rank, ``is_pad``, resume on another world size).
    """

    weights: Any
    num_samples: int | None = None
    replacement: bool = True
    _digest: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        weights = checked_weights(self.weights)
        weights.setflags(write=False)
        object.__setattr__(self, "weights", weights)
        if self.num_samples is not None:
            object.__setattr__(self, "num_samples", check_int("WeightedSampling.num_samples", self.num_samples, 1))
        if not isinstance(self.replacement, (bool, np.bool_)):
            raise ValueError(f"WeightedSampling.replacement must be True or False, got {self.replacement!r}")
        object.__setattr__(self, "replacement", bool(self.replacement))
        self._check_drawable(weights)
        object.__setattr__(self, "_digest", hashlib.sha256(weights.tobytes()).hexdigest()[:16])

    def _check_drawable(self, weights: np.ndarray) -> None:
        # Without replacement each sample comes at most once: refused here, not at the first epoch's draw.
        # The epoch's length is known already: num_samples, else one per weight (epoch_length insists on it).
        wanted = self.num_samples or len(weights)
        positive = int(np.count_nonzero(weights))
        if self.replacement or wanted <= positive:
            return
        asked = (
            f"num_samples={wanted}" if self.num_samples else f"an epoch of {wanted} (num_samples unset: one per weight)"
        )
        raise ValueError(
            f"WeightedSampling(replacement=False) draws each sample at most once, but {asked} needs {wanted} samples "
            f"of weight above 0 and only {positive} of the {len(weights)} have one: pass num_samples={positive} or "
            "fewer, or replacement=True"
        )

    def epoch_length(self, dataset_size: int) -> int:
        """Samples per epoch over all ranks; refuses weights that do not match the dataset."""
        if len(self.weights) != dataset_size:
            raise ValueError(
                f"WeightedSampling has {len(self.weights)} weights but the dataset has {dataset_size} samples: "
                "give one weight per sample"
            )
        return self.num_samples or dataset_size

    def order(self, dataset_size: int, epoch: int, seed: int) -> np.ndarray:
        """The global draw of ``epoch``."""
        n = self.epoch_length(dataset_size)
        return weighted_order(self.weights, n, epoch, seed, replacement=self.replacement)

    def identity(self) -> dict[str, Any]:
        """What a saved loader state must agree on: the weights (by digest), the length and the replacement."""
        return {"weights_sha256": self._digest, "num_samples": self.num_samples, "replacement": self.replacement}
