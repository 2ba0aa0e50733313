"""Downloads run a few at a time in daemon threads, which an interrupted process does not wait for.

A ``ThreadPoolExecutor`` would do the same work, but Python joins its threads at exit, and a caller
interrupted by Ctrl-C waits in its ``shutdown`` for the downloads under way: as long as a slow server
holds them. :func:`run_all` returns at once instead; its calls check a ``stop`` event at each chunk
(:class:`Cancelled`), so what they leave is removed by their own error handling, or, when the process
ends first, reaped by the next cache opened on the folder.
"""

from __future__ import annotations

import threading
from typing import Callable


class Cancelled(BaseException):
    """Raised in a download that was stopped (:meth:`~dali_pipes.staging.stream_cache.ShardCache.cancel`, a Ctrl-C) (a ``BaseException``: no retry or
    ``except Exception`` on the way takes it for the download's own error)."""


def run_all(calls: list[Callable[[], None]], workers: int, stop: threading.Event) -> None:
    """Run ``calls``, ``workers`` at a time, in daemon threads; the first error raised once those under way end.

    Not a ``ThreadPoolExecutor``: Python joins its threads at exit, so an interrupted process waited for
    their downloads (tens of seconds on a slow server). Here a ``KeyboardInterrupt`` in the caller returns at
    once; ``stop`` is then set, and so it is when a call fails: the calls check it at each chunk they
    download (ending there, their temporaries removed and their reservations released), and none starts
    after it. A download that never reaches its next chunk ends with the process, and the next cache opened
    on the folder reaps what it left.

    One call asked for by a thread other than the main one (a stream's download thread) runs in that thread: a
    Ctrl-C reaches the main thread only, so there is nothing to return early from."""
    if len(calls) == 1 and threading.current_thread() is not threading.main_thread():
        try:
            return calls[0]()
        except BaseException:
            stop.set()
            raise
    pending = list(reversed(calls))
    errors: list[BaseException] = []
    done = threading.Condition()
    running = 0

    def work() -> None:
        nonlocal running
        while True:
            with done:
                if errors or not pending:
                    running -= 1
                    done.notify_all()
                    return
                call = pending.pop()
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                stop.set()
                with done:
                    errors.append(exc)

    with done:
        running = min(workers, len(calls))
    for _ in range(running):
        threading.Thread(target=work, name="dali-pipes-cache-download", daemon=True).start()
    try:
        with done:
            while running:
                done.wait()
    except BaseException:
        stop.set()  # interrupted: the downloads under way end at their next chunk, or with the process
        raise
    real = [exc for exc in errors if not isinstance(exc, Cancelled)]
    if real or errors:
        raise (real or errors)[0]


__all__ = ["Cancelled", "run_all"]
