"""Reads run a few at a time in daemon threads, their results taken in order: a large object in parallel ranged
parts (:func:`~dali_pipes.remote.transfer.read_ranges`).

One connection to object storage reads at tens of MB/s; a shard of a GB read range after range would take tens of
seconds, while its ranges asked for a few at once take a fraction of that. The caller consumes the parts in order
(it hashes and writes them as a stream), and at most ``2 * workers`` are read ahead of it, so the memory held is
bounded whatever the object's size. Daemon threads, not a ``ThreadPoolExecutor``, for the reason
:mod:`dali_pipes.staging.threads` gives: an interrupted process must not wait for the reads under way.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Callable, Iterator, TypeVar

_T = TypeVar("_T")

#: Ranges of one object read at once by default.
PARTS = 4


@contextlib.contextmanager
def in_order(reads: list[Callable[[], _T]], workers: int) -> Iterator[Iterator[_T]]:
    """Within the block, an iterator over the results of ``reads``, in their order, ``workers`` of them running at
    once (in this thread when ``workers`` is 1 or there is one read). A read's error is raised where its result
    would be taken. Leaving the block (done, an error, a ``KeyboardInterrupt``) starts no further read; those under
    way end on their own, their results dropped."""
    if workers <= 1 or len(reads) <= 1:
        yield (read() for read in reads)
        return
    parts = _Parts(reads)
    try:
        parts.start(workers)
        yield parts.results()
    finally:
        parts.stop()


class _Parts:
    """The threads and results of one :func:`in_order` block."""

    def __init__(self, reads: list[Callable[[], _T]]) -> None:
        self._reads = reads
        self._ahead = 0
        self._results: dict[int, tuple[bool, object]] = {}
        self._cv = threading.Condition()
        self._next = 0  # the next read to start
        self._taken = 0  # the reads whose results the caller took
        self._stopped = False

    def start(self, workers: int) -> None:
        """``workers`` threads, at most ``2 * workers`` reads ahead of the caller (stopped by :meth:`stop` even when
        starting one failed)."""
        self._ahead = 2 * workers
        for _ in range(min(workers, len(self._reads))):
            # Each thread runs in a copy of the caller's context: a budget of tries (transfer.object_tries) is shared.
            context = contextvars.copy_context()
            threading.Thread(target=context.run, args=(self._work,), name="dali-pipes-part", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and self._next < len(self._reads) and self._next - self._taken >= self._ahead:
                    self._cv.wait()
                if self._stopped or self._next >= len(self._reads):
                    return
                index, self._next = self._next, self._next + 1
            try:
                result: tuple[bool, object] = (True, self._reads[index]())
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread, where it takes this result
                result = (False, exc)
            with self._cv:
                self._results[index] = result
                self._cv.notify_all()

    def results(self) -> Iterator[_T]:
        for index in range(len(self._reads)):
            with self._cv:
                while index not in self._results:
                    self._cv.wait()
                ok, value = self._results.pop(index)
                self._taken = index + 1
                self._cv.notify_all()
            if not ok:
                raise value  # type: ignore[misc]
            yield value  # type: ignore[misc]

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._results.clear()
            self._cv.notify_all()


__all__ = ["PARTS", "in_order"]
