"""Batches with no DALI graph: plain feature rows at the speed of the memory they are read from.

A :class:`~dali_pipes.Features` spec with neither normalisation nor cast asks
DALI for nothing but copies: its pipeline would only move each batch through an
external source, DALI's buffers and the iterator's torch conversion, and for
narrow rows that harness is the whole cost. :class:`DirectStream` takes its place:
it asks the loader's own batch source for batch ``i`` of the epoch, exactly as DALI
would (:class:`~dali_pipes.loading.batch_source.BatchStoreSource`: the shared epoch
plan, padding to whole batches, ``is_pad``, the global ``index``, record CRCs
checked, ``StopIteration`` at the end), and hands the arrays over as tensors, on
the loader's device. Everything above it (epochs, resume, per-rank counts,
``state_dict``) is the loader's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["DirectStream", "runs_without_dali"]


@dataclass(frozen=True)
class _BatchInfo:
    """What DALI's ``BatchInfo`` tells a batch source: the batch's number and the pipeline's epoch."""

    iteration: int
    epoch_idx: int


def runs_without_dali(spec: Any, *, batch_reads: bool, workers: int) -> bool:
    """Whether ``spec`` needs no DALI graph (its ``runs_without_dali``) and the loader reads batches in its process."""
    return bool(getattr(spec, "runs_without_dali", False)) and batch_reads and workers == 0


class DirectStream:
    """A :class:`~dali_pipes.loading.streams.BatchStream` without DALI: the batch source read in this process.

    ``names`` are the source's outputs in order (the fields, ``is_pad``, then
    ``index`` when asked for); ``device_id`` the GPU to copy to (``None``: the CPU).
    """

    def __init__(self, source: Any, names: Sequence[str], device_id: int | None) -> None:
        self._source = source
        self._names = tuple(names)
        self._device = None if device_id is None else f"cuda:{device_id}"
        self._epoch = 0  # the source's epoch_idx, as DALI numbers its epochs: 0 first, one more at each start
        self._iteration = 0

    def start_epoch(self) -> None:
        """Open the next epoch (the loader has published its plan first)."""
        self._epoch += 1
        self._iteration = 0

    def next_batch(self) -> dict[str, Any] | None:
        """The source's next batch as tensors on the loader's device, or ``None`` at the end of the epoch."""
        import torch

        try:
            outputs = self._source(_BatchInfo(self._iteration, self._epoch))
        except StopIteration:
            return None
        self._iteration += 1
        batch = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in zip(self._names, outputs)}
        if self._device is not None:
            # Pinned first, so that the copy to the GPU does not wait for the host.
            batch = {name: t.pin_memory().to(self._device, non_blocking=True) for name, t in batch.items()}
        return batch
