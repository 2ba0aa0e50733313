"""Ctrl-C (SIGINT) raised only where the code it lands in can survive it.

Python raises KeyboardInterrupt at whatever bytecode the main thread runs next. Two kinds of code here cannot
take it at an arbitrary bytecode: the process pool's machinery (see :class:`CtrlC`), and h5py's ``fileobj``
driver, which calls :meth:`~converters.writers._h5file.GuardedFile.write` from inside HDF5: a KeyboardInterrupt
raised there is either swallowed (``Exception ignored in: 'h5py._objects.ObjectID.__dealloc__'``, when HDF5
flushes a closing dataset: the Ctrl-C is lost) or turned into a failed write, after which HDF5 crashes the
process with a segmentation fault when the file closes. :func:`held` keeps such code free of it.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class CtrlC:
    """Ctrl-C held by a handler of this module's own, and raised only where it is safe.

    The local engine holds it while its pool runs. Python raises KeyboardInterrupt at whatever bytecode the main
    thread is running, and while a pool runs that is mostly inside ``concurrent.futures`` and
    ``multiprocessing``, which are not written to survive it. Raised just after ``wait()`` took a future's lock (``_AcquireFutures.__enter__``, ``Condition.__enter__``), the lock
    stays held: the pool's manager thread blocks on it for ever, so the workers never get their end-of-work
    sentinel, and the interpreter's exit, which joins that thread, hangs. Raised half-way through reading a
    progress message, it leaves the pipe out of step, and the next read waits for ever for bytes that never
    come (this process holds the pipe's writing end too). The windows are microseconds, but a loaded machine
    preempts the main thread inside them: seen as a Ctrl-C that never ended the job.

    Only the main thread can set a handler, and only the main thread is ever interrupted: a pool run from
    another thread is never cut short half-way, so there this does nothing.
    """

    def __init__(self) -> None:
        self.noted = False
        self._replaced: Any = None  # the handler this one replaced, while it is set

    def hold(self) -> None:
        """From now on a Ctrl-C is only noted (as the handler that was set sees it, when :meth:`deliver` runs)."""
        if self._replaced is not None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if previous is None:  # a handler set outside Python: it could not be put back
            return
        signal.signal(signal.SIGINT, self._note)
        self._replaced = previous

    def release(self) -> None:
        """Put back the handler that was set; a Ctrl-C noted meanwhile stays noted for :meth:`deliver`."""
        if self._replaced is not None:
            signal.signal(signal.SIGINT, self._replaced)
            self._replaced = None

    def deliver(self) -> None:
        """Hand a noted Ctrl-C, here and now, to the handler that was set (which raises KeyboardInterrupt by default)."""
        if not self.noted:
            return
        self.noted = False
        handler = self._replaced
        if handler is None:  # not held any more: to whatever handles SIGINT now
            signal.raise_signal(signal.SIGINT)
        elif callable(handler):  # called while still held, so that a second Ctrl-C cannot cut the stop short
            handler(signal.SIGINT, None)
        elif handler == signal.SIG_DFL:  # the process ends, as it would have
            self.release()
            signal.raise_signal(signal.SIGINT)
        # SIG_IGN: ignored, as it would have been; the run goes on

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """The handler that was set while the caller's code runs (a ``yield``), this one's again afterwards."""
        self.deliver()
        held = self._replaced is not None
        self.release()
        try:
            yield
        finally:
            if held:
                self.hold()

    def _note(self, signum: int, frame: Any) -> None:
        self.noted = True


@contextlib.contextmanager
def held() -> Iterator[CtrlC]:
    """Ctrl-C only noted while the body runs, then raised as usual once it ends without an error.

    The body may raise a noted Ctrl-C at a safe point of its own with ``deliver()`` on the
    :class:`CtrlC` it is given (a long copy between its blocks). Outside the main thread this holds
    nothing (only the main thread is ever interrupted).
    """
    ctrl_c = CtrlC()
    ctrl_c.hold()
    try:
        yield ctrl_c
    finally:
        ctrl_c.release()
    ctrl_c.deliver()


def holds_ctrl_c(function: F) -> F:
    """``function`` run under :func:`held`, so that its locals also die inside (an h5py dataset writes as it closes)."""

    @functools.wraps(function)
    def run_held(*args: Any, **kwargs: Any) -> Any:
        with held():
            return function(*args, **kwargs)

    return run_held  # type: ignore[return-value]
