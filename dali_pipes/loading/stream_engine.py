"""The download engine of a stream: shards downloaded in background threads, in the order asked, never by a reader.

A :class:`~dali_pipes.loading.streaming.Streamer` tells the engine which shards it wants and in what order
(:meth:`DownloadEngine.want`: the windows being read first, then those ahead); ``downloads`` threads take them
from the front of that list one shard each, so the downloads of one window overlap those of the next and a slow
shard holds up one thread, not the rest. A reader that needs a shard not yet there asks for it
(:meth:`DownloadEngine.fetch_now`) and waits, holding no lock: the shard goes to the front, and when every thread
is busy (on shards ahead, perhaps a slow one) a thread of its own starts for it, so a read never waits behind a
download it does not need.

Each download is :meth:`ShardCache.fetch(shard, ahead=True) <dali_pipes.staging.stream_cache.ShardCache.fetch>`:
made only while some pin holds the shard (the streamer pins before it asks), and stopped at its next chunk once
the streamer no longer wants it (its windows moved on while it downloaded): so the bytes downloading never pass
what the pins were sized for.

Locks: the engine's condition guards its lists only and is never held across a download or a call out; the
``on_ready`` callback is called with no lock of the engine held (the streamer takes its own there).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Sequence

from dali_pipes.staging.threads import Cancelled

if TYPE_CHECKING:
    from dali_pipes.staging.stream_cache import ShardCache

logger = logging.getLogger(__name__)

__all__ = ["BYTES_IN_FLIGHT", "THREAD_NAME", "DownloadEngine", "default_downloads"]

#: The name of the engine's download threads.
THREAD_NAME = "dali-pipes-stream-download"
#: Bytes the default number of downloads keeps in flight (:func:`default_downloads`): a server's latency (tens of
#: milliseconds to the first byte) is paid for each shard, so the downloads at once must cover it with bytes.
BYTES_IN_FLIGHT = 16 << 20
#: The fewest and the most downloads at once by default.
MIN_DOWNLOADS, MAX_DOWNLOADS = 4, 32


def default_downloads(shard_bytes: Sequence[int]) -> int:
    """Downloads at once for shards of ``shard_bytes``: :data:`BYTES_IN_FLIGHT` of the median shard, between
    :data:`MIN_DOWNLOADS` and :data:`MAX_DOWNLOADS` (1.7 MB shards: 10; 170 KB: 32)."""
    median = max(1, int(sorted(shard_bytes)[len(shard_bytes) // 2]))
    return max(MIN_DOWNLOADS, min(MAX_DOWNLOADS, -(-BYTES_IN_FLIGHT // median)))


#: Seconds an idle download thread sleeps between looks at its list (it is also woken when the list changes).
_IDLE_WAIT_S = 0.05


class DownloadEngine:
    """Downloads ``cache``'s shards in ``downloads`` daemon threads, in the order :meth:`want` gives (see the module
    docstring). ``on_ready(shard, ahead)`` is called in a download thread when a shard asked for is present."""

    def __init__(
        self,
        cache: "ShardCache",
        downloads: int,
        on_ready: Callable[[int, bool], None],
        on_failed: Callable[[int, BaseException], None] = lambda shard, error: None,
    ) -> None:
        self.cache = cache
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._cv = threading.Condition()
        self._queue: list[tuple[int, bool]] = []  # (shard, ahead) not yet started, in order
        self._wanted: dict[int, bool] = {}  # every shard asked for (queued or under way): shard -> ahead
        self._urgent: set[int] = set()  # asked for by a waiting reader
        self._running: set[int] = set()
        self._finished: dict[int, int] = {}  # shard -> downloads of it ended (a waiting reader counts them)
        self._errors: dict[int, BaseException] = {}  # shard -> the error its last download ended with
        self._idle = 0
        self._threads = 0
        self._closed = False
        self._released: Callable[[], None] = lambda: None  # called by the last thread to end after close()
        for _ in range(downloads):
            self._start(None)

    # --- what the streamer asks -------------------------------------------------------------

    def want(self, jobs: list[tuple[int, bool]]) -> None:
        """Download the shards of ``jobs`` (``(shard, ahead)`` in reading order) instead of those asked for before;
        a download under way of a shard no longer wanted stops at its next chunk, one asked for by a waiting
        reader stays first."""
        with self._cv:
            self._wanted = {k: ahead for k, ahead in jobs}
            self._wanted.update({k: False for k in self._urgent})
            first = [(k, False) for k in self._urgent if k not in self._running]
            self._queue = first + [(k, a) for k, a in jobs if k not in self._running and k not in self._urgent]
            self._cv.notify_all()

    def ask(self, shards: list[int]) -> None:
        """Have ``shards`` downloaded first, in this order, without waiting (reader processes wait for them)."""
        with self._cv:
            for shard in reversed(shards):
                self._ask_first(shard, start=shard == shards[0])

    def fetch_now(self, shard: int) -> None:
        """Have ``shard`` downloaded first and wait until it is present (the caller holds a pin on it), or raise the
        error its download ended with. Waits in short slices, so a Ctrl-C ends it at once."""
        with self._cv:
            self._urgent.add(shard)
        try:
            while True:
                with self._cv:
                    seen = self._finished.get(shard, 0)
                    self._ask_first(shard)
                    while self._finished.get(shard, 0) == seen:
                        if self._closed:
                            raise Cancelled(f"{self.cache.folder}: the stream was closed")
                        self._cv.wait(0.1)
                    if shard in self._errors:
                        raise self._errors[shard]
                if self.cache.present(shard):  # a download begun before the caller's pin may have skipped it
                    return
        finally:
            with self._cv:
                self._urgent.discard(shard)

    def _ask_first(self, shard: int, start: bool = True) -> None:
        """``shard`` first in the list, for a waiting reader; with ``start``, a thread of its own when every thread
        is busy (on shards ahead, perhaps a slow one). Called with the condition held."""
        self._wanted[shard] = False
        if shard not in self._running:
            self._queue = [(shard, False)] + [job for job in self._queue if job[0] != shard]
            if start and self._idle == 0:
                self._start(shard)
            self._cv.notify_all()

    def close(self, wait_s: float, released: Callable[[], None]) -> bool:
        """Start no download again; wait up to ``wait_s`` for those under way to end (the cache stops them at their
        next chunk). ``True`` when all ended; else ``released`` is called by the last one to end."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
            while self._threads and time.monotonic() < deadline:
                self._cv.wait(max(deadline - time.monotonic(), 0.0))
            if self._threads:
                self._released = released
                return False
        return True

    @property
    def threads(self) -> int:
        """Download threads running now (0 once :meth:`close` has returned ``True``)."""
        with self._cv:
            return self._threads

    # --- the threads ------------------------------------------------------------------------

    def _start(self, first: int | None) -> None:
        """A daemon thread taking shards from the list (``first``: one shard only, for a waiting reader). Called
        with the condition held."""
        self._threads += 1
        args = (weakref.ref(self), first)
        threading.Thread(target=_download_loop, args=args, name=THREAD_NAME, daemon=True).start()

    def _take(self, only: int | None) -> tuple[int, bool] | None:
        """The next job (``only``: that shard's, if nobody took it meanwhile), ``None`` to look again, raises
        :class:`Cancelled` when the thread should end."""
        with self._cv:
            if self._closed:
                raise Cancelled("closed")
            if only is not None:
                job = next((j for j in self._queue if j[0] == only), None)
                if job is None:
                    raise Cancelled("taken by another thread")
            elif not self._queue:
                self._idle += 1
                self._cv.wait(_IDLE_WAIT_S)
                self._idle -= 1
                return None
            else:
                job = self._queue[0]
            self._queue.remove(job)
            self._running.add(job[0])
            self._errors.pop(job[0], None)
            return job

    def _download(self, shard: int, ahead: bool) -> None:
        """One shard, as long as it is wanted; the outcome recorded for a waiting reader."""
        error: BaseException | None = None
        try:
            # A shard whose tries were just spent is asked for again only by the read that needs it, which raises;
            # the others are told it failed (a reader process waiting for it raises too, not waits for the pause).
            error = None if shard in self._urgent else self.cache.recent_failure(shard)
            if error is not None:
                self._on_failed(shard, error)
            else:
                self.cache.fetch([shard], ahead=True, wanted=lambda: not self._closed and shard in self._wanted)
                self._on_ready(shard, ahead)
        except Cancelled as exc:
            error = exc if self._closed or shard in self._urgent else None  # else: no longer wanted, stopped
        except Exception as exc:  # noqa: BLE001 - handed to the reader that waits for it, or to the next one
            error = exc
            self._on_failed(shard, exc)
            if shard not in self._urgent:
                logger.warning("stream %s: fetching ahead failed, retried when read: %s", self.cache.folder, exc)
        with self._cv:
            self._running.discard(shard)
            self._finished[shard] = self._finished.get(shard, 0) + 1
            if error is not None:
                self._errors[shard] = error
            kind = self._wanted.get(shard)
            if error is None and kind is not None and kind != ahead:
                self._queue.insert(0, (shard, kind))  # wanted to be read while it downloaded as ahead: once more
            elif kind == ahead and shard not in self._urgent:
                del self._wanted[shard]
            self._cv.notify_all()

    def _ended(self) -> None:
        """A thread ends: after close, the last one releases the cache."""
        with self._cv:
            self._threads -= 1
            last = self._closed and self._threads == 0
            self._cv.notify_all()
        if last:
            self._released()


def _download_loop(engine_ref: "weakref.ref[DownloadEngine]", only: int | None) -> None:
    """A download thread: jobs until the engine is closed or collected (it holds the engine only during a job, so a
    loader dropped without ``close()`` is freed, and its pins with it)."""
    engine = engine_ref()
    try:
        while engine is not None:
            job = engine._take(only)
            if job is not None:
                engine._download(*job)
                if only is not None:
                    return
            del engine
            engine = engine_ref()
    except Cancelled:
        return
    finally:
        if engine is not None:
            engine._ended()
