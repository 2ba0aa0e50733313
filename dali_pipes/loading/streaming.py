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

How the pieces meet (one reading thread, in the loader's own process: ``py_num_workers=0``):

- :class:`Streamer` keeps the shards of the node's windows being read and those read after them (``fetch_ahead``
  of them, by default a node window) pinned, and a background thread downloads them in reading
  order, in groups of at most ``downloads`` shards: the windows being read first, then the
  ones ahead (a slow shard ahead never holds up the window being read). :meth:`Streamer.close` stops
  the downloads under way at their next chunk and does not wait for one past :data:`CLOSE_WAIT_S`: the
  thread releases the cache after it. A Ctrl-C never waits for them either (their threads are daemons,
  :mod:`dali_pipes.staging.threads`).
  The windows being read are told by the external source before each batch
  (:meth:`StreamStore.before_read`: the batch's epoch and samples, placed in the node's stream); when they
  move on, the shards of the windows behind are unpinned (the cache may then evict them) and their readers closed.
- Nothing refers back from the streamer to its store, and its thread holds it weakly: a loader dropped
  without ``close()`` frees its pins as soon as it is collected.
- :class:`StreamStore` is a :class:`~dali_pipes.stores.Store` over the cache folder whose every shard
  read is guarded: a shard not yet downloaded (or outside the pinned window) is pinned, fetched and
  read on the spot, its reader closed afterwards. The padding of an epoch's last batch is taken from the
  node's own stream, its last samples (:mod:`dali_pipes.sampling.partitioned`), so it reads shards the cache holds, not the epoch's first
  ones, long evicted. So a read never finds an evicted shard, and the store never holds open a
  shard the cache may evict.

Refused for now, by name: reader processes (``py_num_workers > 0``), per-sample reads
(``batch_reads=False``), a :class:`~dali_pipes.Mixture`, weighted ``sampling=``, ``cache="ram"`` and
``stage_to``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from dali_pipes.sampling.windowed import WindowSpan
from dali_pipes.staging.stream_cache import Cancelled
from dali_pipes.stores import Store

if TYPE_CHECKING:
    from dali_pipes.sampling.node_order import NodeOrder
    from dali_pipes.staging.stream_cache import ShardCache

logger = logging.getLogger(__name__)

__all__ = ["CLOSE_WAIT_S", "StreamStore", "Streamer"]

#: Seconds :meth:`Streamer.close` waits for the downloads under way before leaving them to end in the background.
CLOSE_WAIT_S = 0.5


class Streamer:
    """Keeps the windows being read pinned and downloaded ahead, in a background thread (see the module docstring).

    ``order``: this rank's place in the partitioned order (its node's windows); ``ahead``: the shards read after
    the windows being read that are pinned and downloaded meanwhile; ``budget``: the bytes the pinned shards
    may take (the cache's limit less one shard, the room a read outside them needs); ``read_cap``: the most
    bytes of windows a batch pins to read (:func:`~dali_pipes.loading.stream_setup.open_streaming` says why);
    ``downloads``: shards the background thread downloads at once.
    """

    def __init__(
        self, cache: "ShardCache", order: "NodeOrder", *, ahead: int, budget: int, read_cap: int, downloads: int
    ) -> None:
        self.cache = cache
        self.ahead = ahead
        self.budget = budget
        self.read_cap = read_cap
        self.downloads = downloads
        self.sampling = order
        self._bytes = cache.shard_bytes
        self._spans: dict[tuple[int, Any], tuple[WindowSpan, ...]] = {}  # by (epoch, its base)
        self._positions: dict[tuple[int, Any], np.ndarray] = {}  # each sample's position in the node's stream
        self._cond = threading.Condition(threading.RLock())
        self._urgent = threading.Event()  # the reading thread waits for the lock: the fetcher steps aside
        self._at: tuple[int, int, int] | None = None  # (epoch, first, last window) the pins were set for
        self._pinned: set[int] = set()  # the windows being read, pinned to be read
        self._ahead: set[int] = set()  # pinned as fetched ahead (possibly given up since)
        self._ready: set[int] = set()  # pinned to be read and downloaded: read without the lock
        self._queue: list[tuple[bool, list[int]]] = []  # (ahead, shards of one window) to download
        self._closed = False
        self.close_reader = lambda shard: None  # set by the store: close the reader of an unpinned shard
        # The thread holds the streamer weakly and the finalizer closes the cache: a loader dropped without
        # close() releases its pins when collected, and the thread then ends.
        self._finalizer = weakref.finalize(self, cache.close)
        self._thread = threading.Thread(
            target=_fetch_loop, args=(weakref.ref(self),), name="dali-pipes-stream-fetch", daemon=True
        )
        self._thread.start()

    # --- what the source tells --------------------------------------------------------------

    def before_read(self, epoch: int, indices: np.ndarray, is_pad: np.ndarray) -> None:
        """A batch of ``epoch`` is about to read ``indices``: pin the node's windows its samples lie in (those of
        the partitions read together overlap) and the shards ahead of them, unpin those behind."""
        spans, positions = self._epoch_windows(epoch)
        where = positions[np.asarray(indices)[~np.asarray(is_pad, dtype=bool)]]
        where = where[where >= 0]
        if len(where) == 0:
            return  # all padding: the guarded reads bring its shards
        lo, hi = int(where.min()), int(where.max()) + 1
        touched = [s for s in spans if s.start < hi and s.stop > lo]
        current = self._within_cap(touched)  # the rest of the batch's windows: fetched ahead, read shard by shard
        at = (epoch, touched[0].window, current[-1].window if current else -1)
        if at == self._at:
            return
        later = [s.shards for s in touched[len(current) :]]
        later += [s.shards for s in spans[touched[-1].window + 1 :] if s.start >= hi]
        groups = self._wanted([k for s in current for k in s.shards], [*later, *self._next_epoch(epoch)])
        with self._locked():
            self.cache.plan_reads([k for group in groups for k in group])  # needed furthest ahead: evicted first
            self._repin(groups)
            self._at = at

    def _within_cap(self, spans: list[WindowSpan]) -> list[WindowSpan]:
        """The first of ``spans`` whose shards fit in ``read_cap`` bytes together (perhaps none: then every read
        of the batch pins its one shard)."""
        held = 0
        for i, span in enumerate(spans):
            held += sum(self._bytes[k] for k in span.shards)
            if held > self.read_cap:
                return spans[:i]
        return spans

    def _next_epoch(self, epoch: int) -> Iterator[tuple[int, ...]]:
        """The shards of the next epoch's windows, in reading order (its plan may not be made yet: from its start)."""
        yield from (span.shards for span in self._epoch_windows(epoch + 1)[0])

    def _wanted(self, current: tuple[int, ...], later: Iterable[tuple[int, ...]]) -> list[list[int]]:
        """The shards to keep pinned, window by window: the ``current`` window's, then ``ahead`` shards of the
        ``later`` windows in reading order, all within the budget (a shard that would pass it is left out)."""
        groups = [list(current)]
        taken, held, room = set(current), sum(self._bytes[k] for k in current), self.ahead
        for shards in later:
            if room == 0:
                break
            group = []
            for k in shards:
                if room > 0 and k not in taken and held + self._bytes[k] <= self.budget:
                    group.append(k)
                    taken.add(k)
                    held += self._bytes[k]
                    room -= 1
            groups.append(group)
        return groups

    def _repin(self, groups: list[list[int]]) -> None:
        """Pin the window being read (``groups[0]``) to read it and the shards after it as fetched ahead, unpin
        (and close) the others, and queue the downloads in reading order, in groups of at most ``downloads``
        shards of one window each (so that a slow download of a shard ahead never holds up one of the window
        being read).

        The shards ahead get only the room no other pin uses, and may be given up for another loader's window
        (:mod:`dali_pipes.staging.cache_pins`): they are not taken as ready until their window is pinned to
        be read. Unpinned first (the old and new pins together may not fit the limit); when pinning the new
        ones fails, what is left pinned is recorded as such, so no read takes an unpinned shard as ready.
        """
        current, ahead = groups[0], [k for group in groups[1:] for k in group]
        drop = self._pinned - set(current)
        for k in drop:
            self.close_reader(k)
        if drop:
            self.cache.unpin(sorted(drop))
            self._pinned -= drop
            self._ready -= drop
        self.cache.set_ahead([k for k in ahead if k in self._ahead])  # its stale ones go before anyone's
        add = [k for k in current if k not in self._pinned]
        if add:
            self.cache.pin(add)
        self._pinned = set(current)
        self._ahead = set(self.cache.set_ahead(ahead))
        self._queue = [
            (i > 0, chunk[j : j + self.downloads])
            for i, group in enumerate(groups)
            for chunk in [[k for k in group if k not in self._ready and (i == 0 or k in self._ahead)]]
            for j in range(0, len(chunk), self.downloads)
        ]
        logger.debug(
            "stream %s: %d shard(s) pinned, %d ahead, %d group(s) to fetch",
            self.cache.folder, len(current), len(self._ahead), len(self._queue),
        )  # fmt: skip
        self._cond.notify_all()

    # --- reads ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def reading(self, shard: int) -> Iterator[None]:
        """Around a read of ``shard``: present and pinned while the block runs."""
        if shard in self._ready:
            yield
            return
        failed = self.cache.recent_failure(shard)
        if failed is not None:  # the fetch ahead (or this read, sample by sample) just spent its tries
            raise failed
        with self._locked():
            failed = self.cache.recent_failure(shard)  # again: the fetch thread may have spent its tries meanwhile
            if failed is not None:
                raise failed
            self.cache.pin([shard])
            try:
                self.cache.fetch([shard])
                if shard in self._pinned:
                    self._ready.add(shard)
                yield
            finally:
                if shard not in self._pinned:
                    self.close_reader(shard)
                self.cache.unpin([shard])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._urgent.set()
        try:
            with self._cond:
                self._urgent.clear()
                yield
                self._cond.notify_all()
        finally:
            self._urgent.clear()

    def fetch_next(self) -> bool:
        """One turn of the background thread: download the next queued group (shards of one window, each pinned
        already), or wait a moment for one; ``False`` once closed.

        The lock is held while downloading, so that no shard is unpinned mid-download: an unpinned
        download would take room beyond the pins that the rank's share was sized for. The reading thread
        waits for at most one such group, and only when it repins or reads a shard not yet ready.
        """
        with self._cond:
            if not self._closed and (not self._queue or self._urgent.is_set()):
                self._cond.wait(0.05)
            if self._closed:
                return False
            if not self._queue or self._urgent.is_set():
                return True
            ahead, chunk = self._queue.pop(0)
            # A shard whose tries were just spent is asked for again only by the read that needs it, which raises.
            chunk = [k for k in chunk if self.cache.recent_failure(k) is None]
            try:
                self.cache.fetch(chunk, ahead=ahead)
                if not ahead:
                    self._ready.update(chunk)
            except Cancelled:
                return False  # closed meanwhile
            except Exception as exc:  # noqa: BLE001 - the read that needs it fetches again and raises
                logger.warning("stream %s: fetching ahead failed, retried when read: %s", self.cache.folder, exc)
            return True

    # --- the epoch's windows ----------------------------------------------------------------

    def _epoch_windows(self, epoch: int) -> tuple[tuple[WindowSpan, ...], np.ndarray]:
        """The node's windows of ``epoch`` and each sample's position in its stream (:meth:`NodeOrder.node_windows
        <dali_pipes.sampling.node_order.NodeOrder.node_windows>`), kept for it and the epoch before (reads run on
        into the next one)."""
        key = (epoch, self.sampling.base_of(epoch))  # a resumed epoch's windows begin at its saved progress
        if key not in self._spans:
            if self._at is not None and self._at[0] == epoch:
                self._at = None  # another plan of this epoch: its windows' numbers mean other windows
            for old in [k for k in self._spans if k[0] < epoch - 1 or k[0] == epoch]:
                del self._spans[old], self._positions[old]
            self._spans[key], self._positions[key] = self.sampling.node_windows(epoch)
        return self._spans[key], self._positions[key]

    # --- the cache's numbers and the end ----------------------------------------------------

    @property
    def limit_bytes(self) -> int:
        """The cache's limit."""
        return self.cache.limit_bytes

    @property
    def peak_bytes(self) -> int:
        """The most the cache folder held in this run (node-wide)."""
        return self.cache.peak_bytes

    def close(self) -> None:
        """Stop fetching ahead and release the cache (its shards stay for the next run).

        Never waits long for a group of downloads under way (a Ctrl-C must not hang on them): when the
        thread is still downloading after :data:`CLOSE_WAIT_S`, it releases the cache itself once done.
        """
        self._closed = True  # set without the lock, which a download under way holds; read between downloads
        self.cache.cancel()  # the downloads under way end at their next chunk
        self.cache.drop_pins()  # their room goes to the node's other loaders now (one re-made at once, too)
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout=CLOSE_WAIT_S)
            if self._thread.is_alive():
                logger.info(
                    "stream %s: downloads under way end in the background, then the cache is released",
                    self.cache.folder,
                )
                return
        self._finalizer()


def _fetch_loop(streamer_ref: "weakref.ref[Streamer]") -> None:
    """The background thread of a :class:`Streamer`: its turns, until it is closed (the cache then released,
    in case :meth:`Streamer.close` did not wait for the last downloads) or collected."""
    while True:
        streamer = streamer_ref()
        if streamer is None:
            return
        if not streamer.fetch_next():
            streamer._finalizer()
            return
        del streamer  # between turns the thread keeps nothing alive


class StreamStore(Store):
    """A :class:`~dali_pipes.stores.Store` over a streaming cache folder: every shard read guarded by the
    :class:`Streamer` (present and pinned while read; its reader closed once the shard may be evicted)."""

    def __init__(self, streamer: Streamer) -> None:
        super().__init__(streamer.cache.folder, streamer.cache.manifest)
        self.streamer = streamer
        self.sampling = streamer.sampling
        # Held weakly: no reference cycle, so that a dropped loader's streamer is freed at once (its pins with it).
        store = weakref.ref(self)
        streamer.close_reader = lambda shard: store() is not None and store()._shards[shard].close()

    def before_read(self, epoch: int, indices: np.ndarray, is_pad: np.ndarray) -> None:
        """Called by the external source before each batch (see :meth:`Streamer.before_read`)."""
        self.streamer.before_read(epoch, indices, is_pad)

    def read(self, index: int, fields: Iterable[str] | None = None) -> dict[str, Any]:
        """:meth:`Store.read`, the sample's shard present and pinned meanwhile."""
        index = int(index) + (len(self) if int(index) < 0 else 0)
        shard_no = self.manifest.locate(index)[0] if 0 <= index < len(self) else None
        guard = self.streamer.reading(shard_no) if shard_no is not None else contextlib.nullcontext()
        with guard:
            return super().read(index, fields)

    def _read_shard_batch(self, shard_no: int, local: np.ndarray, names: tuple[str, ...], arrays: bool) -> Any:
        with self.streamer.reading(shard_no):
            return super()._read_shard_batch(shard_no, local, names, arrays)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a streamed store is read in the loader's own process only (py_num_workers=0)")
