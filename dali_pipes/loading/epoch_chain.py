"""One stream epoch reads training epochs in a row, so that the pipeline does not stop and refill between them.

DALI's iterator ends an epoch when the source raises ``StopIteration``, and the
next one starts with ``reset()``: DALI schedules the first batches again and the
loader waits for the first one to come through the whole pipeline (a reader
process's round trip plus a batch's decode), where ``fn.readers.file`` reads on
into its next epoch and pays nothing. (The bench README has the measured cost.)

So a stream epoch is a chain of *segments*: the pass it was started for, then
whole epochs after it, each published (:meth:`EpochControl.publish_segment
<dali_pipes.loading.sources.EpochControl.publish_segment>`) one epoch before
the stream can reach it. When the user's next pass is the epoch already chained
(the usual ``for epoch in ...: set_epoch(epoch)`` or no ``set_epoch`` at all), the
loader goes on reading without a reset. Any other next pass (``set_epoch`` to
another epoch, ``load_state_dict``, a pass left part-way) cancels the stream epoch,
drains what was read ahead and starts a new one
(:class:`~dali_pipes.loading.passes.EpochState` decides which).

Publishing one epoch ahead is enough only when the stream cannot read further ahead
than an epoch: the chain is used when an epoch has more batches than DALI can
have scheduled beyond the batches handed out (``ahead``); shorter epochs reset
each time.
"""

from __future__ import annotations

import logging
from typing import Any

from dali_pipes.loading.epoch_size import EpochSizes
from dali_pipes.loading.sources import EpochControl

__all__ = ["EpochChain", "read_ahead"]

logger = logging.getLogger(__name__)


def read_ahead(prefetch: int, source_depth: int) -> int:
    """The most batches DALI may have scheduled past those handed out: the pipeline's and the source's queues,
    the batch being run, and one more for safety."""
    return prefetch + source_depth + 2


class EpochChain:
    """Which training epochs the open stream epoch reads, and the plans published for them.

    ``source`` gives each epoch's plan (``indices(epoch, start)``), ``sizes`` its
    output size; ``ahead``: :func:`read_ahead` for a DALI pipeline, 0 for a source
    read only when a batch is asked for (``loading/direct.py``); ``None`` never chains.
    """

    def __init__(
        self, control: EpochControl, source: Any, sizes: EpochSizes, batches_per_epoch: int, ahead: int | None
    ):
        self._control = control
        self._source = source
        self._sizes = sizes
        self.enabled = ahead is not None and batches_per_epoch > ahead
        self.stream_epoch = -1  # the number (DALI's epoch_idx) of the stream epoch last opened
        self._next: tuple[int, int] | None = None  # (segment, epoch) published to follow the current pass
        self._published: set[int] = set()  # the segments (>= 1) whose plan files exist
        self._length = 0  # samples of each chained segment of the open stream epoch

    def open(self, epoch: int, start: int) -> int:
        """Publish a new stream epoch starting at ``epoch`` from ``start``; its number (the stream's first epoch
        is 0 and open from the start; a later one must be started)."""
        number = self.stream_epoch + 1  # counted only once published: a failure here leaves the count as it was
        plan = self._source.indices(epoch, start)  # this rank's order, computed once here rather than in every worker
        size = self._sizes.size(epoch)
        self._drop_segments()  # the last chain's plans
        # The next epoch first: the workers read the control block, and so the chain, only after the reset.
        chained = self.enabled and self._publish(number, 1, epoch + 1)
        self._control.publish(number, epoch, start, plan=plan, size=size, chained=self._length if chained else 0)
        self.stream_epoch = number
        self._next = (1, epoch + 1) if chained else None
        return number

    @property
    def follows(self) -> bool:
        """Whether the open stream epoch reads on past the current pass."""
        return self._next is not None

    def continues(self, epoch: int, start: int, *, handed_out: bool) -> bool:
        """Whether the open stream epoch reads on into the pass ``(epoch, start)``; ``handed_out``: the pass
        before it gave every batch and its stream epoch has not ended."""
        return handed_out and self._next is not None and start == 0 and self._next[1] == epoch

    def advance(self) -> None:
        """The pass of the chained epoch begins: publish the epoch after it and drop the plan before it."""
        segment, epoch = self._next
        self._next = None  # until the next one is published: if that fails, the stream epoch ends after this pass
        if segment - 1 in self._published:
            self._control.drop_segment(segment - 1)  # every batch of it was handed out
            self._published.discard(segment - 1)
        if self._publish(self.stream_epoch, segment + 1, epoch + 1):
            self._next = (segment + 1, epoch + 1)

    def following_indices(self, count: int) -> list[int]:
        """The first ``count`` samples of the epoch the stream reads on into (none if it does not): DALI may have
        read them ahead, so an error from them can surface before the pass that hands them out."""
        if self._next is None:
            return []
        return self._source.indices(self._next[1], 0)[0][:count].tolist()

    def end(self) -> None:
        """The open stream epoch ends (drained or cancelled): nothing follows the current pass in it."""
        self._next = None

    def _publish(self, stream_epoch: int, segment: int, epoch: int) -> bool:
        """Publish the whole of ``epoch`` as ``segment`` of stream epoch ``stream_epoch``; False when it is not chained.

        An epoch is published before the user asks for it, so its plan or size may not exist yet (a size
        schedule that ends with the run): then the chain ends here, and the pass for it, if one comes,
        computes it again as its own stream epoch (and raises there if it must).
        """
        try:
            plan = self._source.indices(epoch, 0)
            size = self._sizes.size(epoch)
        except Exception as exc:  # noqa: BLE001 - read on no further; the pass itself reports it if it comes
            logger.debug("epoch %d is not read on into, its plan or size failed: %r", epoch, exc)
            return False
        length = len(plan[0])
        if segment == 1:
            self._length = length
        elif length != self._length:  # the workers find segment k at first + (k - 1) * length
            return False
        self._control.publish_segment(stream_epoch, segment, epoch, plan, size=size)
        self._published.add(segment)
        return True

    def _drop_segments(self) -> None:
        for segment in self._published:
            self._control.drop_segment(segment)
        self._published.clear()
