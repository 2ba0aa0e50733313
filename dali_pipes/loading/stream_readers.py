"""Reader processes of a stream: they read, by path, the shards the loader's process pinned and downloaded.

With ``RunOptions(py_num_workers=N)`` DALI reads each batch in one of N processes. The loader's process keeps
the pins and the downloads (:mod:`dali_pipes.loading.streaming`), so a node still downloads each shard once and
its cache stays within its limit; the two sides meet on a :class:`~dali_pipes.loading.stream_board.ReadBoard`:

- A reader process, before a batch (:func:`reader_before_read`): posts the batch to its slot, waits until each
  of its shards is ready, takes them as held (:meth:`ReadBoard.hold <dali_pipes.loading.stream_board.ReadBoard.hold>`:
  only if each is still ready, under the board's lock) and closes the readers of shards it no longer needs; after
  the batch (:func:`reader_after_read`: its records are copied out) it says it is done. The loader's process lets
  go of a shard only after clearing its byte and finding no reader holding it (:meth:`ReadBoard.release
  <dali_pipes.loading.stream_board.ReadBoard.release>`), so a shard held is pinned, by the loader's process.
- The loader's process (:class:`ReaderWatch`, a thread): looks at the slots every few milliseconds; for the
  furthest batch posted, it moves the windows' pins as a read in its own process would
  (:meth:`Streamer.before_read <dali_pipes.loading.streaming.Streamer.before_read>`); the shards of any posted
  batch outside them (a batch behind the furthest, the padding) it pins too, and has the engine download all
  of them first. Their bytes go to 1 when downloaded, 2 when the download failed (the reader raises its error).
  Shards still held when their windows move on stay pinned until their readers are done (the next look).

So exactly once and resume are the plan's, as without reader processes; a reader never reads a shard the cache
may evict; a reader process that dies leaves no pin (it never pins in the cache: what it held is let go once its
slot's lock is found free). The price: two short ``flock`` calls a batch, and the windows follow the readers a few
milliseconds late.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from dali_pipes.loading.stream_board import FAILED, READY, ReadBoard
from dali_pipes.sampling.windowed import shard_of
from dali_pipes.stores import StoreError

#: The loader's :class:`~dali_pipes.loading.streaming.Streamer` and :class:`~dali_pipes.loading.streaming.StreamStore`
#: (not imported: that module imports this one).
Streamer = StreamStore = Any

logger = logging.getLogger(__name__)

__all__ = ["READER_SLOTS", "REASK_S", "WATCH_INTERVAL_S", "ReaderWatch", "reader_after_read", "reader_before_read"]

#: Reader processes one streamed loader serves at most (a slot each on the board).
READER_SLOTS = 64
#: Seconds between the loader's looks at the board.
WATCH_INTERVAL_S = 0.001
#: Seconds between the loader's looks for the shards a waiting reader needs when no slot changed.
REASK_S = 0.2
#: Seconds between a reader's looks at a shard's byte (doubling up to four times that while it waits).
_POLL_S = 0.00025


class ReaderWatch:
    """The loader's side (see the module docstring): a daemon thread moving ``streamer``'s pins after the batches
    its reader processes post on ``board``. Holds the streamer weakly: a dropped loader ends it."""

    def __init__(self, streamer: "Streamer", board: ReadBoard) -> None:
        self.board = board
        self._sizes = streamer.sample_counts  # samples a shard (the streamer's array, not a copy)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_watch_loop, args=(weakref.ref(streamer), self), name="dali-pipes-stream-watch", daemon=True
        )
        self._thread.start()

    def look(self, streamer: "Streamer", seen: tuple[int, ...], again: bool = False) -> tuple[int, ...]:
        """One look at the board: when a slot changed (or ``again``, while a batch waits), move the windows to the
        furthest batch posted and hold the shards of the batches still waiting for them; what was seen."""
        now = self.board.seen()
        if now == seen and not (again and any(now[1::2])):
            return now
        posted = self.board.posted()
        if posted:
            # The windows from the earliest batch still waiting to the furthest posted (of the furthest's epoch: a
            # batch of the epoch before, at the turn of epochs, is held shard by shard below).
            furthest = max(posted, key=lambda p: (p.epoch, _last_position(streamer, p.epoch, p.indices, p.is_pad)))
            batches = [p for p in posted if p.epoch == furthest.epoch and (p.waiting or p is furthest)]
            indices, is_pad = np.concatenate([p.indices for p in batches]), np.concatenate([p.is_pad for p in batches])
            streamer.before_read(furthest.epoch, indices, is_pad)
        waiting = [k for p in posted if p.waiting for k in shard_of(p.indices, self._sizes).tolist()]
        streamer.hold_for_readers(list(dict.fromkeys(waiting)))
        return now

    def fail_waiting(self, error: BaseException) -> None:
        """Pinning for the posted batches failed (no room, the cache's state unwritable): the shards they wait for
        fail with ``error``, so their reader processes raise it (as a read in the loader's process would) rather
        than wait for a byte that never comes."""
        for posted in self.board.posted():
            if posted.waiting:
                for k in shard_of(posted.indices, self._sizes).tolist():
                    if self.board.ready(k) != READY:
                        self.board.fail(k, str(error))

    def close(self, wait_s: float = 0.0) -> None:
        """Stop watching, waiting up to ``wait_s`` for a look under way (it may be pinning) to end; the board's file
        is removed by the streamer."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(wait_s)


def _last_position(streamer: "Streamer", epoch: int, indices: np.ndarray, is_pad: np.ndarray) -> int:
    """Where a batch ends in the node's stream of ``epoch`` (-1 for one of padding only)."""
    positions = streamer.plan.epoch_windows(epoch)[1][indices[~is_pad]]
    return int(positions.max()) if len(positions) else -1


def _watch_loop(streamer_ref: "weakref.ref[Streamer]", watch: ReaderWatch) -> None:
    seen: tuple[int, ...] = ()
    last = time.monotonic()
    while not watch._stop.wait(WATCH_INTERVAL_S):
        streamer = streamer_ref()
        if streamer is None:  # the loader was dropped: a reader still waiting raises rather than waits for ever
            watch.board.stop("the streamed loader was dropped while its reader processes read")
            return
        try:
            # Every REASK_S while a reader waits, its shards are asked for again though nothing was posted: a
            # download that ended without its shard (skipped, cancelled) must not leave the reader waiting for ever.
            again = time.monotonic() - last > REASK_S
            last = time.monotonic() if again else last
            seen = watch.look(streamer, seen, again)
        except Exception as exc:  # noqa: BLE001 - told to the readers waiting: they raise it, none waits for ever
            logger.exception("stream %s: moving the pins after the reader processes failed", streamer.cache.folder)
            try:
                watch.fail_waiting(exc)
            except Exception:  # noqa: BLE001 - the board itself unreadable: every reader stops, none hangs
                logger.exception("stream %s: the reader processes' board failed", streamer.cache.folder)
                watch.board.stop(f"the loader's process stopped serving its reader processes: {exc}")
                return
            seen = ()
            time.sleep(0.1)
        del streamer


def reader_before_read(store: "StreamStore", epoch: int, indices: np.ndarray, is_pad: np.ndarray) -> None:
    """A reader process's side before a batch (see the module docstring): posted, waited for, held."""
    board = store.board  # set by StreamStore.serve_readers in the loader's process
    reader_after_read(store)  # a batch whose read failed: done with it now
    indices = np.asarray(indices, dtype=np.int64)
    board.post(epoch, indices, np.asarray(is_pad, dtype=bool))
    shards = [int(k) for k in dict.fromkeys(shard_of(indices, store.sample_counts).tolist())]
    began = time.monotonic()
    while not board.hold(shards):  # one not ready, or let go meanwhile (a look at the board behind this post)
        for k in shards:
            _wait_ready(board, k, store)
    if time.monotonic() - began > _POLL_S:  # waited: counted where the loader's process reads it
        board.waited(time.monotonic() - began)
    store.held = True
    for k in list(store.open_shards):
        if k not in shards and board.ready(k) != READY:
            store.close_shard(k)  # the cache may evict it: an open map would keep its bytes on the disk
            store.open_shards.discard(k)
    store.open_shards.update(shards)


def reader_after_read(store: "StreamStore") -> None:
    """A reader process read its batch (its records copied out): its shards may go, so they hold room only then."""
    if store.held:
        store.board.done()
        store.held = False


def _wait_ready(board: ReadBoard, shard: int, store: "StreamStore") -> None:
    """Wait until the loader's process has ``shard`` ready; raise its download's error, or when it is gone."""
    pause, checked = _POLL_S, time.monotonic()
    while True:
        state = board.ready(shard)
        if state == READY:
            return
        if state == FAILED:
            raise StoreError(f"{store.root}: shard {shard}: {board.error()}")
        if board.stopped():
            raise StoreError(f"{store.root}: {board.error()}")
        time.sleep(pause)
        pause = min(2 * pause, 4 * _POLL_S)
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            try:
                os.kill(board.owner_pid, 0)
            except ProcessLookupError:
                raise StoreError(f"{store.root}: the loader's process ended; this reader stops") from None
