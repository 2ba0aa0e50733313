"""The batch stream under a :class:`~dali_pipes.DALILoader`: what it asks for batches, epoch by epoch.

Two streams fit the one small interface, :class:`BatchStream`: :class:`DaliStream`,
DALI's PyTorch iterator over the built pipeline, and
:class:`~dali_pipes.loading.direct.DirectStream`, the batch source read in the
loader's process for a spec that needs no DALI graph. A stream's epochs are its
own: the loader publishes each one's plan (:mod:`dali_pipes.loading.epoch_chain`)
before it starts it, and one stream epoch may read several training epochs in a row.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

__all__ = ["BatchStream", "DaliStream"]


class BatchStream(Protocol):
    """Batches of the published plan, one stream epoch at a time.

    The first stream epoch is open from the start; :meth:`start_epoch` opens each
    next one (its plan published first). :meth:`next_batch` returns the next batch
    as a dict of tensors, or ``None`` once the open epoch has ended.
    """

    def start_epoch(self) -> None:
        """Open the next stream epoch."""

    def next_batch(self) -> dict[str, Any] | None:
        """The next batch of the open stream epoch, or ``None`` at its end."""


class DaliStream:
    """:class:`BatchStream` over a built DALI pipeline, through DALI's ``DALIGenericIterator``."""

    def __init__(self, pipe: Any, output_names: Sequence[str]) -> None:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        # size=-1: the source ends each epoch itself (its length changes on resume);
        # nothing is scheduled before the first epoch's plan is published.
        self._iterator = DALIGenericIterator(
            [pipe], list(output_names), size=-1, auto_reset=False, prepare_first_batch=False
        )

    def start_epoch(self) -> None:
        """DALI's ``reset()``: it schedules the new epoch's first batches on the pipeline and its workers."""
        self._iterator.reset()

    def next_batch(self) -> dict[str, Any] | None:
        """The next batch, or ``None`` once the source ended DALI's epoch."""
        try:
            return next(self._iterator)[0]
        except StopIteration:
            return None
