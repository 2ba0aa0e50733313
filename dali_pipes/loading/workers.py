"""Watching DALI's Python worker processes, so that a dead one is an error and not a hang.

DALI 2.4's worker pool notices a death (its observer thread terminates the other
workers), but a training thread that is then putting tasks on the shared queue
waits for ever on a semaphore the dead worker never releases (``ShmQueue.put``
-> ``Condition.notify`` waits for the sleeper it woke; checked with a SIGKILLed
worker). So :class:`~dali_pipes.DALILoader` makes each call into DALI through a
:class:`Caller`: the call runs in one helper thread while the training thread
waits on it with a timeout and asks :class:`Workers` every
:data:`WATCH_INTERVAL` seconds whether a worker died. A call stuck on a dead
worker is abandoned in its (daemon) thread and the training thread raises.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

#: Seconds between checks of the worker processes while a call into DALI is under way.
#: A check is one ``waitpid(WNOHANG)`` per worker; the interval only bounds how
#: long a dead worker can go unnoticed while the training thread waits on DALI.
WATCH_INTERVAL = 0.2

_T = TypeVar("_T")


def close_worker_pool(pool: Any, caller: Caller | None = None) -> None:
    """Close DALI's worker pool (and the loader's helper thread), unless a dead worker makes that unsafe."""
    # ``Pipeline._py_pool`` is DALI's private attribute (DALI 1.x-2.x); without it
    # (no parallel source, or a DALI that renamed it) DALI's own clean-up remains.
    if caller is not None:
        caller.close()
        if caller.pool_lost:
            # After a worker died, pool.close() can wait for ever: on the task queue's lock
            # that a call stuck on the dead worker holds, or on the dead worker's own locks
            # (seen once in ~100 runs of the dead-worker tests). The workers were SIGKILLed
            # already; a stuck call keeps its pipeline's memory until the process exits.
            logger.warning("DALILoader: a worker died, so DALI's worker pool is not closed (it could hang)")
            return
    if pool is not None:
        pool.close()


class Workers:
    """DALI's Python worker processes of one pipeline, and whether one of them died.

    Reads DALI's private ``Pipeline._py_pool.pool._processes`` (the
    ``multiprocessing.Process`` objects, DALI 1.x-2.x); where a DALI version
    lacks it, nothing is watched and DALI's own behaviour remains.
    """

    def __init__(self, pipe: Any) -> None:
        pool = getattr(pipe, "_py_pool", None)
        processes = getattr(getattr(pool, "pool", None), "_processes", None)
        self.processes: list[Any] = list(processes or [])
        if pool is not None and not self.processes:
            logger.warning("DALILoader: cannot find DALI's worker processes; a dead worker may hang the loader")

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        return [proc.pid for proc in self.processes]

    def dead(self) -> str | None:
        """Which worker died and how, or ``None`` while every worker is alive."""
        exited = []
        for number, proc in enumerate(self.processes):
            try:
                code = proc.exitcode  # waitpid(WNOHANG) on our own child: cheap, never blocks
            except (AssertionError, ValueError, OSError):  # not this process's child, or closed
                continue
            if code is not None:
                exited.append((number, proc.pid, code))
        if not exited:
            return None
        # Once one worker exits, DALI's observer terminates the others (SIGTERM): name the first one.
        number, pid, code = min(exited, key=lambda e: e[2] == -signal.SIGTERM)
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            if code == -signal.SIGKILL:
                how += " (usually the kernel's out-of-memory killer or the job scheduler: check dmesg)"
        else:
            how = f"exited with status {code}"
        return f"DALI's Python worker process {pid} (worker {number} of {len(self.processes)}) {how}"

    def kill_all(self) -> None:
        """SIGKILL the workers still running and reap them (only after one died: the pool is lost)."""
        for proc in self.processes:
            try:
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(5)
            except (AssertionError, ValueError, OSError):
                continue


class _Task:
    """One call handed to a :class:`Caller`, with its outcome."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the waiting thread as is
            self.error = exc
        finally:
            self.done.set()


class Caller:
    """Runs calls in one daemon thread while the calling thread waits and checks on the workers.

    One thread for every call keeps DALI's calls in order, as if made directly.
    A daemon thread, so that a call stuck on a dead worker's lock never blocks
    the interpreter's exit; after such a failure the loader makes no more calls.
    """

    def __init__(self, name: str) -> None:
        #: Set by the loader once a worker died: a call given up on may never return, and the pool must not be waited on.
        self.pool_lost = False
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(self._tasks,), name=name, daemon=True)
        self._thread.start()

    @staticmethod
    def _serve(tasks: queue.SimpleQueue) -> None:
        # A static method with the queue as argument: the thread must not keep the caller alive.
        while True:
            task = tasks.get()
            if task is None:
                return
            task.run()
            del task

    def call(self, call: Callable[[], _T], check: Callable[[], None], interval: float) -> _T:
        """``call()`` in the helper thread; ``check()`` every ``interval`` seconds until it returns."""
        task = _Task(call)
        self._tasks.put(task)
        while not task.done.wait(interval):
            check()  # raises to abandon a call that cannot finish (the loader then sets pool_lost)
        error, task.error = task.error, None
        if error is None:
            return task.value
        try:
            raise error
        finally:
            # The traceback holds this frame: a local naming the error would make a reference
            # cycle through every frame of the call, the loader's included, which only the
            # garbage collector could free (and a forked child's collector would hang on it).
            del error, task

    def close(self) -> None:
        """Let the thread end once it finishes its current call."""
        self._tasks.put(None)


def on_stream_of_this_thread(call: Callable[[], _T], device_id: int | None) -> Callable[[], _T]:
    """``call`` made to run on the CUDA stream that is current in *this* thread.

    ``DALIGenericIterator`` hands GPU outputs to torch on torch's current stream,
    which is per thread: DALI 2.4's dynamic executor (the loader's) gives zero-copy
    DLPack views, and ``torch.from_dlpack`` asks DALI to make each one ready on the
    current stream (an older executor copies on that stream instead). The helper
    thread must therefore use the training thread's stream, or the training thread
    could read a batch DALI has not finished writing.
    """
    import torch

    stream = torch.cuda.current_stream(device_id)

    def on_stream() -> _T:
        # The current device is per thread too. Without this the helper thread stays on
        # device 0, and leaving the stream context would switch back to it, creating a
        # CUDA context on GPU 0 in every rank whose device is another one.
        torch.cuda.set_device(stream.device)
        with torch.cuda.stream(stream):
            return call()

    return on_stream
