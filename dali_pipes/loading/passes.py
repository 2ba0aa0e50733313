"""Where a :class:`~dali_pipes.DALILoader` stands in its epochs: one object, :class:`EpochState`, owns it.

A *pass* is one ``iter(loader)``: the rest of one epoch on this rank, from
``start`` (the global samples of the epoch consumed before it; 0 unless resumed).
The batch stream under the loader (:mod:`dali_pipes.loading.streams`) has epochs
of its own: each starts from empty and must refill the pipeline, and one stream
epoch may read several training epochs in a row (:mod:`dali_pipes.loading.epoch_chain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dali_pipes.loading.epoch_chain import EpochChain
from dali_pipes.loading.errors import LoaderError
from dali_pipes.loading.sources import EpochControl
from dali_pipes.loading.streams import BatchStream
from dali_pipes.sampling import EpochRules, check_int, num_batches, samples_consumed, samples_per_rank

__all__ = ["EpochState", "EpochSteps", "Pass"]


@dataclass(frozen=True)
class EpochSteps:
    """How an epoch of ``samples`` (over all ranks) splits into this rank's batches: the sampling rules, bound;
    ``order``: a streamed order that counts its own steps (:class:`~dali_pipes.sampling.node_order.NodeOrder`:
    each node reads its own partitions, so the counts depend on the epoch's partitions)."""

    samples: int
    rules: EpochRules
    order: Any = None

    @property
    def batch_size(self) -> int:
        """Samples in a batch of this rank (the last one may hold fewer real ones)."""
        return self.rules.batch_size

    def batches(self, start: int, epoch: int = 0) -> int:
        """Batches per rank in ``epoch`` after ``start`` samples of it were consumed."""
        if self.order is not None:
            return self.order.batches(epoch, start)
        r = self.rules
        return num_batches(self.samples, r.batch_size, r.world.world_size, r.last_batch, start)

    def per_rank(self, start: int, epoch: int = 0) -> int:
        """This rank's samples, padding included, in ``epoch`` after ``start``."""
        if self.order is not None:
            return self.order.per_rank(epoch, start)
        r = self.rules
        return samples_per_rank(self.samples, r.batch_size, r.world.world_size, r.last_batch, start)

    def consumed(self, handed: int, start: int, epoch: int = 0) -> int:
        """``epoch``'s global samples consumed once every rank has taken ``handed`` batches from ``start``."""
        if self.order is not None:
            return self.order.consumed(epoch, handed, start, self.samples)
        r = self.rules
        return samples_consumed(self.samples, r.batch_size, r.world.world_size, handed, r.last_batch, start)


@dataclass
class Pass:
    """One iteration over (the rest of) an epoch on this rank."""

    epoch: int
    start: int
    batches: int
    samples: int  # this rank's samples, so that the last batch can be trimmed to them
    handed: int = 0  # batches given to the user
    reading: bool = False  # the stream epoch under this pass has not ended (it may read on into the next pass)

    @property
    def under_way(self) -> bool:
        """Started and not finished: batches of it are still to come."""
        return self.handed < self.batches


class EpochState:
    """The loader's position, the pass it will make next, the pass under way and the stream epoch under it.

    The pass (``current``) is in one of these states; ``position`` is ``(epoch, global
    samples consumed)`` after the batches handed so far:

    ==================  ======================================  ==========================================
    pass state          what :meth:`next_pass` gives            how it got there
    ==================  ======================================  ==========================================
    none yet            the position, ``(0, 0)``                a new loader
    begun, none taken   the same pass again                     :meth:`begin`
    part-way            the next epoch, from 0                  :meth:`next_batch`, not to the end
    handed out          the position: the next epoch, from 0    :meth:`next_batch` gave the last batch
    ==================  ======================================  ==========================================

    :meth:`set_epoch` and :meth:`restore` set a *pending* pass in any state, and
    :meth:`next_pass` gives it first; nothing else changes until :meth:`begin`.

    What :meth:`begin` does with the stream:

    =======================================================  ===============================================
    when                                                     then
    =======================================================  ===============================================
    the pass before was handed out, the stream epoch reads   read on (no refill): publish the epoch after
    on into exactly this epoch (:meth:`EpochChain.continues  this one (:meth:`EpochChain.advance`)
    <dali_pipes.loading.epoch_chain.EpochChain.continues>`)
    and the pass starts at 0
    anything else                                            cancel what is left of the stream epoch, drain
                                                             it, publish a new one and start it: a refill
    the pass has no batches (a resumed, finished epoch)      the stream epoch ends as above, none is opened;
                                                             the position moves to the next epoch
    =======================================================  ===============================================

    After the last batch, :meth:`end_pass` collects the stream's end of epoch unless it
    reads on. ``where`` names the loader in the errors that mean a bug here.
    """

    def __init__(
        self, stream: BatchStream, chain: EpochChain, control: EpochControl, steps: EpochSteps, where: str
    ) -> None:
        self._stream = stream
        self._chain = chain
        self._control = control
        self.steps = steps
        self._where = where
        self.position = (0, 0)  # (epoch, global samples consumed) after the batches handed so far
        self._pending: tuple[int, int] | None = None
        self.current: Pass | None = None

    # --- what the user sets ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The next pass covers ``epoch``; a restored pass of this epoch keeps its resume offset."""
        epoch = check_int("epoch", epoch, 0)
        if self._pending is None or self._pending[0] != epoch:
            self._pending = (epoch, 0)

    def restore(self, position: tuple[int, int]) -> None:
        """The next pass resumes at ``position`` (epoch, global samples of it consumed)."""
        self._pending = position

    def saved_position(self) -> tuple[int, int]:
        """``(epoch, consumed)`` as :meth:`DALILoader.state_dict` saves it: the pending pass, else the position."""
        return self._pending if self._pending is not None else self.position

    def next_pass(self) -> tuple[int, int]:
        """``(epoch, start)`` of the pass the next :meth:`begin` makes."""
        if self._pending is not None:
            return self._pending
        current = self.current
        if current is not None and 0 < current.handed < current.batches:
            return current.epoch + 1, 0  # a pass left part-way: the next one starts the next epoch
        return self.position

    def pass_under_way(self) -> Pass | None:
        """The pass under way, if batches of one are still to come."""
        return self.current if self.current is not None and self.current.under_way else None

    @property
    def refills(self) -> int:
        """Stream epochs started so far: each one filled the pipeline from empty."""
        return self._chain.stream_epoch + 1

    # --- iterating ---------------------------------------------------------------------------

    def begin(self) -> Pass:
        """Start the next pass (:meth:`next_pass`), reading on in the open stream epoch or refilling."""
        epoch, start = self.next_pass()
        self._pending = None
        before = self.current
        handed_out = before is not None and before.reading and not before.under_way
        continues = self._chain.continues(epoch, start, handed_out=handed_out)
        if not continues:
            self._finish_stream_epoch()
        current = self.current = Pass(epoch, start, self.steps.batches(start, epoch), self.steps.per_rank(start, epoch))
        self.position = (epoch, start)
        if current.batches == 0:
            self.position = (epoch + 1, 0)
            return current
        if continues:
            current.reading = True  # the stream reads this epoch already, whatever happens next
            self._chain.advance()  # publish the one after it
            return current
        # Publish first (this rank's order, a schedule's size): starting the stream epoch is what
        # schedules the new plan's samples. The stream's first epoch is open from the start.
        if self._chain.open(epoch, start) > 0:
            self._stream.start_epoch()
        current.reading = True
        return current

    def next_batch(self, current: Pass) -> dict[str, Any] | None:
        """The next batch of ``current`` (the last one trimmed to its samples), or ``None`` when it is over
        or a newer pass superseded it."""
        if self.current is not current or not current.under_way:
            return None
        batch = self._read(current)
        if batch is None:
            raise LoaderError(
                f"{self._where}: the batch stream ended epoch {current.epoch} after {current.handed} of "
                f"{current.batches} batches; this is a bug in dali-pipes"
            )
        current.handed += 1
        if current.under_way:
            self.position = (current.epoch, self.steps.consumed(current.handed, current.start, current.epoch))
            return batch
        self.position = (current.epoch + 1, 0)
        last_size = current.samples - (current.batches - 1) * self.steps.batch_size
        if last_size < self.steps.batch_size:
            batch = {name: value[:last_size] for name, value in batch.items()}
        return batch

    def end_pass(self, current: Pass) -> None:
        """After ``current``'s last batch: collect the stream's end of epoch now, so that the next pass can
        start at once, unless the stream reads on into the next epoch."""
        if self.current is not current or self._chain.follows:
            return
        if self._read(current) is not None:
            raise LoaderError(f"{self._where}: the batch stream yielded more batches than planned; this is a bug")

    def following_indices(self, count: int) -> list[int]:
        """The first ``count`` samples of the epoch the stream reads on into (none if it does not)."""
        return self._chain.following_indices(count)

    def _read(self, current: Pass) -> dict[str, Any] | None:
        if not current.reading:
            return None
        batch = self._stream.next_batch()
        if batch is None:
            current.reading = False
        return batch

    def _finish_stream_epoch(self) -> None:
        """Bring the stream to the end of its epoch, cutting short a pass left part-way or one read on from."""
        self._chain.end()
        current = self.current
        if current is None or not current.reading:
            return
        self._control.cancel()  # the samples not read yet end the stream's epoch
        while self._read(current) is not None:
            pass
