"""Streaming mode of :class:`~dali_pipes.DALILoader`: shards read through a bounded cache, window by window.

With ``DataOptions(stream=StreamOptions(cache_limit=BYTES))`` the dataset (a URL, or a folder on a slow
filesystem) is never copied whole. A :class:`~dali_pipes.staging.stream_cache.ShardCache` holds at
most ``cache_limit`` bytes of its shards in a folder of the node, and the epoch order is partitioned
(:mod:`dali_pipes.sampling.partitioned`, bound to this rank by :mod:`dali_pipes.sampling.node_order`): the
shards are dealt to partitions, each node reads only its own partitions' shards, a window of each of those
it reads at once, and its ranks read its stream together, in slices of each step. So a node downloads its
share of the dataset an epoch, not all of it, and one download per shard serves all its ranks.

The node's windows are as wide as its cache allows, whatever its ranks (:mod:`dali_pipes.sampling.node_room`):
a loader's reads pin at most two node windows (the reads crossing from one into the next) and a shard, within
``cache_limit // loaders``; the rest holds the shards fetched ahead. The ranks of a ``torch.distributed``
process group step together (DDP), so they read the same windows and a shard pinned by several counts once;
ranks without a process group may be anywhere, so each counts as a loader of its own (the windows are then
narrower). A rank that runs ahead further than that waits for room while the others move on
(:meth:`~dali_pipes.staging.stream_cache.ShardCache.pin`).

Other loaders share the folder too: an evaluation loader of the training set that the same thread reads
between training steps, the single-rank jobs of a sweep, a loader re-made after ``close()``. Each one's reads
fit in ``cache_limit // loaders`` (``StreamOptions(loaders=...)``, 2 by default). Only the windows being read
(and a guarded read) are pinned to be read; the shards fetched ahead are pinned as *ahead*, from the room no
other pin uses, and given up to a window of any loader of the node that needs their room
(:mod:`dali_pipes.staging.cache_pins`), to be downloaded again when their window comes. A loader beyond
``loaders`` is refused when the room runs out, after waiting a while for other processes' windows to move on,
with a message naming what holds the room. ``close()`` unpins at once, though a download under way may end
later.

The windows are a pure function of ``(cache_limit, shard sizes, loaders, fetch_ahead)``, agreed between the
ranks of a process group (:mod:`dali_pipes.loading.stream_setup`). A state saved part-way through an epoch
holds each partition's progress: it resumes on any ranks per node and on any node count that divides the
partitions, the rest of its epoch read with its windows, the epochs after with this run's.

How the pieces meet, one job each:

- :class:`~dali_pipes.loading.stream_plan.WindowPlan` says what to pin for a batch: the node's windows its
  samples lie in (to read) and the shards read after them (``fetch_ahead`` of them, by default a node window),
  told by the external source before each batch (:meth:`StreamStore.before_read`: the batch's epoch and samples,
  placed in the node's stream).
- :class:`Streamer` holds the pins: the windows being read pinned to read, the shards after them as fetched
  ahead, those behind unpinned (the cache may then evict them) and their readers closed.
- :class:`~dali_pipes.loading.stream_engine.DownloadEngine` downloads what the streamer wants, in reading order,
  ``downloads`` shards at once across windows, in background threads: reading never downloads. A read of a shard
  not there yet (a miss, the padding of the last batch, a window the engine has not reached) asks the engine for
  it first and waits for it; the time the reading thread waits so is :attr:`Streamer.blocked_s` (with reader
  processes, their waits for their shards, summed).
- :class:`~dali_pipes.staging.stream_cache.ShardCache` keeps the folder within its limit, shared by the node's
  processes.

The locks: :attr:`Streamer._lock` guards the pins (the sets of shards pinned to read, fetched ahead, ready to
read without a look at the cache) and is held while they change in the cache (``pin``, ``unpin``, ``set_ahead``:
each a short critical section on the folder's own lock), never across a download. The engine's condition guards
its lists only. A read of a shard ready to read takes no lock; a read of another pins it (the streamer's lock,
briefly), then waits for the engine with no lock held. So the reading thread waits only for what it reads.

- :meth:`Streamer.close` stops the downloads under way at their next chunk and does not wait for them past
  :data:`CLOSE_WAIT_S`: the last download thread releases the cache after it. A Ctrl-C never waits for them
  either (their threads are daemons, :mod:`dali_pipes.staging.threads`).
- Nothing refers back from the streamer to its store, and the download threads hold the engine weakly: a loader
  dropped without ``close()`` frees its pins as soon as it is collected.
- :class:`StreamStore` is a :class:`~dali_pipes.stores.Store` over the cache folder whose every shard
  read is guarded: present and pinned while read, its reader closed once the shard may be evicted. The padding
  of an epoch's last batch is taken from the node's own stream, its last samples
  (:mod:`dali_pipes.sampling.partitioned`), so it reads shards the cache holds, not the epoch's first ones, long
  evicted. So a read never finds an evicted shard, and the store never holds open a shard the cache may evict.

Reader processes (``py_num_workers > 0``) read by the pins of the loader's process
(:mod:`dali_pipes.loading.stream_readers`). A :class:`~dali_pipes.Mixture` streams each dataset through a cache
of its own (:mod:`dali_pipes.loading.mixture_stream`), weighted ``sampling=`` draws within the windows
(:mod:`dali_pipes.sampling.stream_weighted`). Refused, by name: per-sample reads (``batch_reads=False``),
``cache="ram"`` and ``stage_to``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from dali_pipes.loading.stream_board import READY, ReadBoard
from dali_pipes.loading.stream_engine import DownloadEngine
from dali_pipes.loading.stream_plan import WindowPlan
from dali_pipes.loading.stream_readers import READER_SLOTS, ReaderWatch, reader_after_read, reader_before_read
from dali_pipes.sampling.windowed import shard_of
from dali_pipes.staging.cache_folder import CacheError
from dali_pipes.stores import Store

if TYPE_CHECKING:
    from dali_pipes.staging.stream_cache import ShardCache

logger = logging.getLogger(__name__)

__all__ = ["CLOSE_WAIT_S", "StreamStore", "Streamer"]

#: Seconds :meth:`Streamer.close` waits for the downloads under way before leaving them to end in the background.
CLOSE_WAIT_S = 0.1


class Streamer:
    """Holds the pins of the windows being read and of the shards ahead; its engine downloads them (see the module
    docstring).

    ``plan``: what to pin for each batch; ``downloads``: shards the engine downloads at once.
    """

    def __init__(self, cache: "ShardCache", plan: WindowPlan, *, downloads: int) -> None:
        self.cache = cache
        self.plan = plan
        self.sampling = plan.order
        self.ahead = plan.ahead
        self._blocked_s = 0.0  # the reading thread's waits for downloads (blocked_s)
        self._blocked_reads = 0
        self._lock = threading.Lock()
        self._pinned: set[int] = set()  # the windows being read, pinned to be read
        self._ahead: set[int] = set()  # pinned as fetched ahead (possibly given up since)
        self._ready: set[int] = set()  # pinned to be read and downloaded: read without a lock
        self._extra: set[int] = set()  # pinned for reader processes' batches outside the windows
        self._fetched_ahead: set[int] = set()  # downloaded while pinned ahead (the pin perhaps given up since)
        self._draining: set[int] = set()  # let go of, still pinned: a reader process reads them (ReadBoard.release)
        # Samples a shard: the one array of them, shared by the store and the board's watch.
        self.sample_counts = np.array([shard.num_samples for shard in cache.manifest.shards], dtype=np.int64)
        self.close_reader = lambda shard: None  # set by the store: close the reader of an unpinned shard
        self.board: ReadBoard | None = None  # with reader processes (serve_readers)
        self._watch: ReaderWatch | None = None
        # The engine calls back weakly, and the finalizer closes the cache: a loader dropped without close()
        # releases its pins when collected, and the download threads then end.
        ready, failed = weakref.WeakMethod(self._downloaded), weakref.WeakMethod(self._failed)
        self.engine = DownloadEngine(
            cache,
            downloads,
            lambda k, ahead: (ready() or _nothing)(k, ahead),
            lambda k, e: (failed() or _nothing)(k, e),
        )
        self._finalizer = weakref.finalize(self, _release, self.engine, cache)

    # --- what the source tells --------------------------------------------------------------

    def before_read(self, epoch: int, indices: np.ndarray, is_pad: np.ndarray) -> None:
        """A batch of ``epoch`` is about to read ``indices``: pin the node's windows its samples lie in (those of
        the partitions read together overlap) and the shards ahead of them, unpin those behind, and have the
        engine download them in reading order."""
        planned = self.plan.for_batch(epoch, indices, is_pad)
        if planned is None:
            return
        at, groups, order = planned
        with self._lock:
            self.cache.plan_reads(order)  # the shard needed furthest ahead (or never) is evicted first
            jobs = self._repin(groups[0], [k for group in groups[1:] for k in group])
            self.plan.applied(at)
        self.engine.want(jobs)

    def _repin(self, current: list[int], ahead: list[int]) -> list[tuple[int, bool]]:
        """Pin ``current`` (the windows being read) to read them and ``ahead`` as fetched ahead, unpin (and close)
        the others; the downloads to make, ``(shard, ahead)`` in reading order. Called with the lock held.

        The shards ahead get only the room no other pin uses, and may be given up for another loader's window
        (:mod:`dali_pipes.staging.cache_pins`): they are not taken as ready until their window is pinned to
        be read. Unpinned first (the old and new pins together may not fit the limit); when pinning the new
        ones fails, what is left pinned is recorded as such, so no read takes an unpinned shard as ready.
        """
        drop = self._pinned - set(current)
        self._pinned -= drop
        self._ready -= drop
        self._let_go(drop - self._extra)
        self.cache.set_ahead([k for k in ahead if k in self._ahead])  # its stale ones go before anyone's
        add = self._to_pin([k for k in current if k not in self._pinned and k not in self._extra])
        if add:
            self.cache.pin(add)
            # Downloaded while pinned ahead and still there: ready now, without a turn of the engine.
            self._ready.update(k for k in add if k in self._fetched_ahead and self.cache.present(k))
        self._fetched_ahead.difference_update(add)
        self._take_back(current)
        self._pinned = set(current)
        self._ahead = set(self.cache.set_ahead(ahead))
        self._fetched_ahead &= self._ahead
        if self.board is not None:
            for k in self._pinned & self._ready:
                self.board.mark(k, READY)
        jobs = [(k, False) for k in current if k not in self._ready] + [(k, True) for k in ahead if k in self._ahead]
        logger.debug(
            "stream %s: %d shard(s) pinned, %d ahead, %d to fetch",
            self.cache.folder, len(current), len(self._ahead), len(jobs),
        )  # fmt: skip
        return jobs

    def _downloaded(self, shard: int, ahead: bool) -> None:
        """The engine brought ``shard``: ready to read without a lock when it is pinned to be read, and present.

        Present is checked under the pin: the engine's download skips a shard no pin held when it began (a pin
        given up, a window moved on and back), so its end does not say the shard is there; a reader process told
        so would read a missing file. A shard so skipped is asked for again by the next look at the board."""
        if ahead:
            with self._lock:
                if shard in self._ahead:
                    self._fetched_ahead.add(shard)
        if not ahead or shard in self._extra:
            with self._lock:
                if (shard in self._pinned or shard in self._extra) and self.cache.present(shard):
                    self._ready.add(shard)
                    if self.board is not None:
                        self.board.mark(shard, READY)

    def _failed(self, shard: int, error: BaseException) -> None:
        """The engine spent ``shard``'s tries: reader processes waiting for it raise ``error``."""
        if self.board is not None and (shard in self._pinned or shard in self._extra):
            self.board.fail(shard, str(error))

    def _let_go(self, shards: Iterable[int]) -> None:
        """Unpin ``shards`` (and close their readers), none of them wanted now; with reader processes, those a reader
        still reads stay pinned (:meth:`ReadBoard.release <dali_pipes.loading.stream_board.ReadBoard.release>`: their
        bytes cleared first) until a later look finds it done. Called with the lock held."""
        shards = sorted(shards)
        if not shards:
            return
        for k in shards:
            self.close_reader(k)
        held = self.board.release(shards, self._shard_of) if self.board is not None else set()
        self._draining.difference_update(shards)
        self._draining.update(held)
        gone = [k for k in shards if k not in held]
        if gone:
            self.cache.unpin(gone)

    def _to_pin(self, shards: list[int]) -> list[int]:
        """Of ``shards`` wanted again, those to pin: not those still pinned while a reader process reads them."""
        return [k for k in shards if k not in self._draining]

    def _take_back(self, shards: Iterable[int]) -> None:
        """``shards`` are wanted again, pinned now (:meth:`_to_pin`): those still pinned while a reader process read
        them keep that pin (ready again if present). Called with the lock held, after the pin succeeded: a pin that
        fails leaves them draining, so no pin is lost."""
        back = self._draining.intersection(shards)
        self._draining -= back
        self._ready.update(k for k in back if self.cache.present(k))

    def _shard_of(self, samples: np.ndarray) -> np.ndarray:
        return shard_of(samples, self.sample_counts)

    # --- reader processes -------------------------------------------------------------------

    def serve_readers(self, capacity: int) -> ReadBoard:
        """The board of this stream's reader processes (made at the first call), each batch of at most ``capacity``
        samples; a thread moves the pins after the batches they post (:mod:`dali_pipes.loading.stream_readers`)."""
        if self.board is None:
            self.board = ReadBoard(len(self.cache.shard_bytes), READER_SLOTS, capacity)
            self._watch = ReaderWatch(self, self.board)
        return self.board

    def hold_for_readers(self, shards: list[int]) -> None:
        """Keep the shards of the reader processes' posted batches pinned (those outside the windows with pins of
        their own) and have the engine download the ones not ready first; let go of those no batch needs now."""
        with self._lock:
            new = self._to_pin([k for k in shards if k not in self._pinned and k not in self._extra])
            if new:
                self.cache.pin(new)
            self._take_back(shards)
            self._extra.update(k for k in shards if k not in self._pinned)
            gone = self._extra - set(shards)
            self._extra -= gone
            self._ready -= gone - self._pinned
            self._let_go(gone - self._pinned)
            self._let_go(self._draining - self._pinned - self._extra)  # those the readers were done with
            if self.board is not None:
                for k in self._ready & (self._pinned | self._extra):
                    self.board.mark(k, READY)
            waiting = [k for k in shards if k not in self._ready]
        if waiting:
            self.engine.ask(waiting)

    # --- reads ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def reading(self, shard: int) -> Iterator[None]:
        """Around a read of ``shard``: present and pinned while the block runs."""
        if shard in self._ready:
            yield
            return
        failed = self.cache.recent_failure(shard)
        if failed is not None:  # the engine (or this read, sample by sample) just spent its tries
            raise failed
        with self._lock:
            own = shard not in self._pinned  # outside the windows (a miss, the padding): a pin of its own
            if own:
                self.cache.pin([shard])
        try:
            began = time.monotonic()
            self.engine.fetch_now(shard)
            self._blocked_s += time.monotonic() - began
            self._blocked_reads += 1
            yield
        finally:
            if own:
                with self._lock:
                    if shard not in self._pinned:
                        self.close_reader(shard)
                    self.cache.unpin([shard])

    # --- the cache's numbers and the end ----------------------------------------------------

    @property
    def blocked_s(self) -> float:
        """Seconds reading waited for downloads: the loader's reading thread's, plus every reader process's (their
        sum: with N processes, up to N times the seconds of the run)."""
        return self._blocked_s + (self.board.waits()[0] if self.board is not None else 0.0)

    @property
    def blocked_reads(self) -> int:
        """The reads (in the loader's thread) and batches (in reader processes) that waited for a download."""
        return self._blocked_reads + (self.board.waits()[1] if self.board is not None else 0)

    @property
    def limit_bytes(self) -> int:
        """The cache's limit."""
        return self.cache.limit_bytes

    @property
    def peak_bytes(self) -> int:
        """The most the cache folder held in this run (node-wide)."""
        return self.cache.peak_bytes

    def close(self) -> None:
        """Stop the downloads and release the cache (its shards stay for the next run).

        Never waits long for the downloads under way (a Ctrl-C must not hang on them): when one still runs after
        :data:`CLOSE_WAIT_S`, the last to end releases the cache.
        """
        self.cache.cancel()  # the downloads under way end at their next chunk
        if self._watch is not None:  # first: a look under way would pin again after drop_pins
            self._watch.close(CLOSE_WAIT_S)
        self.cache.drop_pins()  # their room goes to the node's other loaders now (one re-made at once, too)
        if self.board is not None:
            self.board.stop(f"stream {self.cache.folder}: the loader was closed")  # a reader still waiting raises
            self.board.close()
        if self.engine.close(CLOSE_WAIT_S, released=self._finalizer):
            self._finalizer()
        else:
            logger.info(
                "stream %s: downloads under way end in the background, then the cache is released", self.cache.folder
            )


def _nothing(shard: int, ahead: bool) -> None:
    """The engine's callback once its streamer is gone."""


def _release(engine: DownloadEngine, cache: "ShardCache") -> None:
    """A streamer's end (closed, or collected): no download starts again, and the cache is released now, or by
    the last download thread once it ends."""
    if engine.close(0.0, released=cache.close):
        cache.close()


class StreamStore(Store):
    """A :class:`~dali_pipes.stores.Store` over a streaming cache folder: every shard read guarded by the
    :class:`Streamer` (present and pinned while read; its reader closed once the shard may be evicted).

    In a reader process (forked, or pickled to it) it reads by the pins of the loader's process: before each batch
    it posts the batch, waits until its shards are ready and holds them on the board
    (:mod:`dali_pipes.loading.stream_readers`; :meth:`serve_readers` first, before the processes start).
    """

    def __init__(self, streamer: Streamer) -> None:
        super().__init__(streamer.cache.folder, streamer.cache.manifest)
        self.streamer: Streamer | None = streamer
        self.sampling = streamer.sampling
        self.board: ReadBoard | None = None  # reader processes' side: set by serve_readers
        self.held = False  # a reader process holds its batch's shards (ReadBoard.hold)
        self.open_shards: set[int] = set()  # the shards a reader process may have open
        self.sample_counts = streamer.sample_counts  # samples a shard (the streamer's array)
        self._owner_pid = os.getpid()
        # Held weakly: no reference cycle, so that a dropped loader's streamer is freed at once (its pins with it).
        store = weakref.ref(self)
        streamer.close_reader = lambda shard: store() is not None and store().close_shard(shard)

    def close_shard(self, shard: int) -> None:
        """Close ``shard``'s reader (the cache may evict it: an open map would keep its bytes on the disk)."""
        self._shards[shard].close()

    def readers_refusal(self, depth: int) -> str | None:
        """Why reader processes reading ``depth`` batches at once cannot read this stream, or ``None``.

        Their batches are pinned whole, so the node's windows must hold the batches its ranks read at once (the
        loader's own process reads a larger batch shard by shard)."""
        layout = self.sampling.place.layout
        samples = np.sort(self.sample_counts)
        # Its own share of a batch (a mixture's dataset reads a part of each): its windows were sized for it.
        held, step = int(samples[: self.sampling.node_window].sum()), depth * layout.batch_size * layout.ranks
        if held >= step or self.sampling.node_window >= len(samples):
            return None
        return (
            f"{self.root}: reader processes read {depth} batch(es) of {layout.batch_size} at once on each of the "
            f"node's {layout.ranks} rank(s), {step} samples, but a node window of this cache_limit "
            f"({self.streamer.limit_bytes} bytes) holds as few as {held}: raise StreamOptions(cache_limit=...) until "
            "the windows hold them, use larger shards, or read in the loader's own process (RunOptions(py_num_workers=0))"
        )

    def serve_readers(self, depth: int, batch_size: int | None = None) -> None:
        """Let reader processes read this store, ``depth`` batches at once: the board they post their batches on
        and its watching thread (:meth:`Streamer.serve_readers`), for batches of at most ``batch_size`` samples
        (default: its order's). Called before they start (forked ones inherit the board). Refused
        (:class:`~dali_pipes.staging.stream_cache.CacheError`) when :meth:`readers_refusal` says why."""
        assert self.streamer is not None
        refusal = self.readers_refusal(depth)
        if refusal is not None:
            raise CacheError(refusal)
        self.board = self.streamer.serve_readers(batch_size or self.sampling.place.layout.batch_size)

    @property
    def in_reader(self) -> bool:
        """True in a reader process (forked from the loader's process, or started and given this store)."""
        return os.getpid() != self._owner_pid

    def before_read(self, epoch: int, indices: np.ndarray, is_pad: np.ndarray) -> None:
        """Called by the external source before each batch (see :meth:`Streamer.before_read`)."""
        if self.in_reader:
            reader_before_read(self, epoch, indices, is_pad)
        else:
            self.streamer.before_read(epoch, indices, is_pad)

    def after_read(self) -> None:
        """Called by the external source after each batch: a reader process is done with its shards (the batch's
        records were copied out of them), so they hold room only while a batch is read."""
        if self.in_reader:
            reader_after_read(self)

    def read(self, index: int, fields: Iterable[str] | None = None) -> dict[str, Any]:
        """:meth:`Store.read`, the sample's shard present and pinned meanwhile."""
        index = int(index) + (len(self) if int(index) < 0 else 0)
        shard_no = self.manifest.locate(index)[0] if 0 <= index < len(self) else None
        with self._guard(shard_no):
            return super().read(index, fields)

    def _read_shard_batch(self, shard_no: int, local: np.ndarray, names: tuple[str, ...], arrays: bool) -> Any:
        with self._guard(shard_no):
            return super()._read_shard_batch(shard_no, local, names, arrays)

    def _guard(self, shard_no: int | None) -> Any:
        """The loader's process: :meth:`Streamer.reading`; a reader process holds the batch's shards before it."""
        if shard_no is None or self.in_reader:
            return contextlib.nullcontext()
        return self.streamer.reading(shard_no)

    def __getstate__(self) -> dict[str, Any]:
        """For a reader process started afresh: the board, no streamer and no cache (it reads by the board)."""
        if self.board is None:
            raise TypeError("StreamStore: serve_readers() before the store goes to reader processes")
        return {k: v for k, v in self.__dict__.items() if k not in ("streamer", "sampling")} | {"streamer": None}
