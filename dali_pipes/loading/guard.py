"""The loader's batch stream, guarded: no call hangs on a dead reader process, and every failure names its sample.

:class:`GuardedStream` wraps a :class:`~dali_pipes.loading.streams.BatchStream`. With
reader processes, each call runs on a helper thread while this one watches the
processes (:mod:`dali_pipes.loading.workers`): a process that died raises
:class:`~dali_pipes.loading.errors.WorkerDiedError` instead of a hang. Any failure
is explained by :class:`Diagnosis` (the shard and sample behind it, :mod:`dali_pipes.loading.diagnose`),
stops the workers and is remembered: the loader refuses to go on after it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from dali_pipes.loading.diagnose import explain_failure, worker_died_message
from dali_pipes.loading.errors import LoaderError, WorkerDiedError
from dali_pipes.loading.streams import BatchStream
from dali_pipes.loading.workers import WATCH_INTERVAL, Caller, Workers, on_stream_of_this_thread
from dali_pipes.sampling import World
from dali_pipes.stores import Store

if TYPE_CHECKING:
    from dali_pipes.loading.passes import EpochState

__all__ = ["Diagnosis", "GuardedStream"]

_T = TypeVar("_T")


@dataclass
class Diagnosis:
    """What explaining a failure needs to know about the loader: its data, its workers and where it stands.

    ``source`` gives an epoch's order (``indices(epoch, start)``); ``prefetch`` the batches the
    pipeline prepares ahead, so that the samples it may have been reading can be checked.
    :meth:`watch` names the loader's :class:`~dali_pipes.loading.passes.EpochState` once it exists.
    """

    store: Store
    fields: tuple[str, ...]
    world: World
    workers: Workers
    source: Any
    batch_size: int
    prefetch: int
    _epochs: Callable[[], "EpochState | None"] = field(default=lambda: None, init=False, repr=False)

    def watch(self, epochs: "EpochState") -> None:
        """Say where the loader stands in a failure's message from now on (held weakly: the state holds the
        stream that holds this, and a cycle would keep the pipeline alive until a garbage collection)."""
        self._epochs = weakref.ref(epochs)

    @property
    def epochs(self) -> "EpochState | None":
        """The loader's epoch state, if it is still there."""
        return self._epochs()

    def worker_died(self) -> WorkerDiedError | None:
        """The error for a reader process that died, if one did."""
        dead = self.workers.dead()
        epochs = self.epochs
        current = None if epochs is None else epochs.current
        return None if dead is None else WorkerDiedError(worker_died_message(self.store, self.world, dead, current))

    def explain(self, exc: BaseException) -> BaseException:
        """An exception naming the dataset and, when it can be found, the sample behind ``exc``."""
        if isinstance(exc, LoaderError):
            return exc
        died = self.worker_died()  # DALI's own report of it is "Worker data receiving interrupted" at best
        if died is not None:
            return died
        epochs = self.epochs
        current = None if epochs is None else epochs.current
        if current is None:  # nothing started: no sample to look for
            return LoaderError(f"{self.store.root}: the DALI pipeline failed (rank {self.world.rank}): {exc}")

        def candidates() -> list[int]:
            # The failed batch is the next one or one the pipeline was preparing ahead of it.
            indices = self.source.indices(current.epoch, current.start)[0]
            lo, ahead = current.handed * self.batch_size, (self.prefetch + 2) * self.batch_size
            return [*indices[lo : lo + ahead].tolist(), *epochs.following_indices(ahead)]

        return explain_failure(exc, self.store, self.fields, self.world, current, candidates)


class GuardedStream:
    """A :class:`~dali_pipes.loading.streams.BatchStream` whose calls are watched and whose failures are explained.

    ``caller`` runs the calls on a helper thread (``None`` without reader processes: nothing
    can die); ``device_id`` the GPU whose current stream the calls use; ``stop_workers``
    shuts the reader processes down after a failure. ``failure`` is the message of the
    first failure (``None`` while all is well).
    """

    def __init__(
        self,
        stream: BatchStream,
        diagnosis: Diagnosis,
        caller: Caller | None,
        device_id: int | None,
        stop_workers: Callable[[], None],
    ) -> None:
        self._stream = stream
        self.diagnosis = diagnosis
        self._caller = caller
        self._device_id = device_id
        self._stop_workers = stop_workers
        self.failure: str | None = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` let the stream go."""
        return self._stream is None

    def close(self) -> None:
        """Let the stream (and the pipeline behind it) go; the loader is closed."""
        self._stream = None

    def start_epoch(self) -> None:
        """The stream's next epoch (DALI schedules its first tasks on the workers: a call like a batch's)."""
        self._guarded(self._open_stream().start_epoch)

    def next_batch(self) -> dict[str, Any] | None:
        """The stream's next batch, or ``None`` at the end of its epoch."""
        return self._guarded(self._open_stream().next_batch)

    def _open_stream(self) -> BatchStream:
        if self._stream is None:  # an iterator of the loader kept past close()
            raise LoaderError(f"{self.diagnosis.store.root}: this loader was closed")
        return self._stream

    def _guarded(self, call: Callable[[], _T]) -> _T:
        try:
            return self._watched(call)
        except Exception as exc:  # noqa: BLE001 - every failure is explained and re-raised
            self._fail(self.diagnosis.explain(exc), exc)

    def _watched(self, call: Callable[[], _T]) -> _T:
        """``call()``, raising :class:`WorkerDiedError` instead of hanging on a dead reader process."""
        if self._caller is None:
            return call()

        def check() -> None:
            if self.diagnosis.workers.dead() is not None:
                # Raised where it is made: an error kept in a local would put this frame, and through the
                # caller's the loader and its pipeline, in a cycle with its traceback.
                raise self.diagnosis.worker_died()

        check()
        if self._device_id is not None:
            call = on_stream_of_this_thread(call, self._device_id)
        return self._caller.call(call, check, WATCH_INTERVAL)

    def _fail(self, error: BaseException, cause: BaseException) -> None:
        """Remember the failure, stop the reader processes and raise ``error``."""
        # Keep the message only: the exception's frames hold the pipeline in a reference cycle.
        self.failure = str(error)
        if isinstance(error, WorkerDiedError):
            # DALI cannot recover its pool; its survivors may wait on the dead one's locks.
            self.diagnosis.workers.kill_all()
            if self._caller is not None:
                self._caller.pool_lost = True
        self._stop_workers()  # the pipeline is dead; do not leave its workers waiting
        try:
            raise error from (None if error is cause else cause)
        finally:
            del error, cause  # else this frame (and the loader) is in a cycle with the traceback
