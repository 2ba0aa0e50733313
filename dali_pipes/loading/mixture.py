"""Several converted datasets read as one: ``DALILoader(Mixture({...}, proportions=...), spec, ...)``.

:class:`Mixture` says which datasets and in what shares. The store joins them
(:class:`~dali_pipes.stores.mixed.MixedStore`: one global index, dataset ``k``'s
sample ``i`` at ``offsets[k] + i``; fields reconciled by name, labels kept or
offset), and :class:`~dali_pipes.sampling.MixtureSampling` draws each epoch from
them (:mod:`dali_pipes.sampling.mixture`: per sample, exact counts per epoch).
:class:`MixtureStore` is that store with its mixture, so that the loader can
ask it for the epoch draw.
"""

from __future__ import annotations

import logging
import numbers
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from dali_pipes.sampling.mixture import MixtureSampling
from dali_pipes.sampling.rules import check_int
from dali_pipes.stores import Store
from dali_pipes.stores.mixed import LABEL_POLICIES, MixedStore

logger = logging.getLogger(__name__)

__all__ = ["LABEL_POLICIES", "Mixture", "MixtureStore", "check_in_order"]


@dataclass(frozen=True)
class Mixture:
    """Several converted datasets read by one loader, each a given share of every epoch.

    ``datasets``: name -> dataset folder or URL (as ``DALILoader`` takes). ``proportions``:
    name -> share of each epoch's samples (any positive numbers; they are
    normalised); by default each dataset's size, which reads every sample of
    every dataset once per epoch (a plain concatenation). ``num_samples``: samples
    per epoch over all ranks (default: all the datasets' samples). ``labels``:
    ``"keep"`` or ``"offset"`` (see :mod:`dali_pipes.stores.mixed`).
    """

    datasets: Mapping[str, str | os.PathLike]
    proportions: Mapping[str, float] | None = None
    num_samples: int | None = None
    labels: str | None = None
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.datasets, Mapping) or len(self.datasets) < 2:
            raise ValueError("Mixture needs a dict of at least two datasets, name -> path or URL")
        object.__setattr__(self, "names", tuple(str(name) for name in self.datasets))
        if self.proportions is not None:
            unknown = set(self.proportions) - set(self.names)
            missing = [name for name in self.names if name not in self.proportions]
            if unknown or missing:
                raise ValueError(
                    f"Mixture.proportions must name each dataset once: {self.names}; "
                    f"missing {missing}, unknown {sorted(unknown)}"
                )
            for name, share in self.proportions.items():
                if not isinstance(share, numbers.Real) or not np.isfinite(share) or share < 0:
                    raise ValueError(f"Mixture.proportions[{name!r}] must be a number >= 0, got {share!r}")
            if not any(self.proportions.values()):
                raise ValueError("Mixture.proportions are all 0: at least one dataset must be drawn")
        if self.num_samples is not None:
            check_int("Mixture.num_samples", self.num_samples, 1)
        if self.labels is not None and self.labels not in LABEL_POLICIES:
            raise ValueError(f"Mixture.labels must be one of {LABEL_POLICIES} (or None), got {self.labels!r}")

    def sampling(self, sizes: Sequence[int]) -> MixtureSampling:
        """The epoch draw over datasets of these ``sizes`` (in :attr:`names` order)."""
        shares = sizes if self.proportions is None else [self.proportions[name] for name in self.names]
        return MixtureSampling(
            self.names, tuple(int(s) for s in sizes), tuple(float(p) for p in shares), self.num_samples
        )


class MixtureStore(MixedStore):
    """The datasets of a :class:`Mixture` joined into one store, with the mixture and its epoch draw.

    Reads, fields and shards are :class:`~dali_pipes.stores.mixed.MixedStore`'s;
    this adds what only the loading side knows: ``mixture`` (the user's
    description, whose proportions decide whether reading in order is allowed)
    and ``sampling``, the draw made from the datasets' sizes.
    """

    def __init__(self, stores: Mapping[str, Store], mixture: Mixture) -> None:
        super().__init__(stores, labels=mixture.labels)
        self.mixture = mixture
        self.sampling = mixture.sampling(self.sizes)
        logger.info("%s: %s samples per epoch", self.root, self.sampling.counts(len(self)))


def check_in_order(mixture: Mixture) -> None:
    """Refuse reading ``mixture`` in order (``shuffle=False``) when it is a random draw (proportions or its own
    epoch length): only a plain concatenation reads every sample once, in order."""
    if mixture.proportions is not None or mixture.num_samples is not None:
        raise ValueError(
            "shuffle=False: a Mixture with proportions or num_samples is a random draw; read the datasets in "
            "order with Mixture(datasets) alone (every sample once), or each with its own loader"
        )
