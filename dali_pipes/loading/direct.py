"""Batches with no DALI graph: plain feature rows at the speed of the memory they are read from.

A :class:`~dali_pipes.Features` spec with neither normalisation nor cast asks
DALI for nothing but the copies: its pipeline only moves each batch through an
external source, DALI's buffers and the iterator's torch conversion. For 16
float32 per row (64 bytes) that harness was the whole cost, about 3 ms a batch
of 1,024 rows (issue 38: 232,000-253,000 rows/s on 2 cores, where memory moves
hundreds of times more). :class:`DirectIterator` takes its place: it asks the
loader's own batch source for batch ``i`` of the epoch, exactly as DALI would
(:class:`~dali_pipes.loading.batch_source.BatchStoreSource`: the shared epoch
plan, padding to whole batches, ``is_pad``, the global ``index``, record CRCs
checked, ``StopIteration`` at the end), and hands the arrays over as tensors,
on the loader's device. Everything above it (epochs, resume, per-rank counts,
``state_dict``) is the loader's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["DirectIterator", "runs_without_dali"]


@dataclass(frozen=True)
class _BatchInfo:
    """What DALI's ``BatchInfo`` tells a batch source: the batch's number and the pipeline's epoch."""

    iteration: int
    epoch_idx: int


def runs_without_dali(spec: Any, *, batch_reads: bool, workers: int) -> bool:
    """Whether ``spec`` needs no DALI graph (its ``runs_without_dali``) and the loader reads batches in its process."""
    return bool(getattr(spec, "runs_without_dali", False)) and batch_reads and workers == 0


class DirectIterator:
    """The part of ``DALIGenericIterator`` the loader uses (``next()`` -> ``[batch]``, ``reset()``), without DALI.

    ``names`` are the source's outputs in order (the fields, ``is_pad``, then
    ``index`` when asked for); ``device_id`` the GPU to copy to (``None``: the CPU).
    """

    def __init__(self, source: Any, names: Sequence[str], device_id: int | None) -> None:
        self._source = source
        self._names = tuple(names)
        self._device = None if device_id is None else f"cuda:{device_id}"
        self._epoch = 0  # DALI's epoch_idx: 0 for the first epoch, one more after each reset
        self._iteration = 0

    def reset(self) -> None:
        """Start the next epoch (the loader has published its plan first, as for DALI)."""
        self._epoch += 1
        self._iteration = 0

    def __next__(self) -> list[dict[str, Any]]:
        import torch

        outputs = self._source(_BatchInfo(self._iteration, self._epoch))  # StopIteration at the end
        self._iteration += 1
        batch = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in zip(self._names, outputs)}
        if self._device is not None:
            # Pinned first, so that the copy to the GPU does not wait for the host.
            batch = {name: t.pin_memory().to(self._device, non_blocking=True) for name, t in batch.items()}
        return [batch]

    def __iter__(self) -> DirectIterator:
        return self
