"""A bounded cache of a dataset's shards on a node's disk, shared by its processes, that survives crashes.

Training from object storage (or a slow network filesystem) without a full copy: the shards a run
needs soon are brought into a local folder whose size never passes a limit, and the ones not needed
are evicted. :class:`ShardCache` does that for one dataset and one folder:

- :meth:`~ShardCache.fetch` makes shards present, downloading the missing ones a few at a time with
  staging's copier (ranged reads, retried, into a temporary name renamed only when its size and
  SHA-256 match the manifest). Room is made first by evicting shards that no process pins, those
  needed furthest ahead first (:meth:`~ShardCache.plan_reads`); the bytes of a download are reserved against the limit before its first byte is
  written, so the folder's shards and temporaries together never pass the limit.
- :meth:`~ShardCache.pin` / :meth:`~ShardCache.unpin` (or :meth:`~ShardCache.hold`) keep shards from
  eviction while a reader needs them. Pins belong to the process that made them and end with it,
  however it ends. Shards fetched ahead are pinned as such (:meth:`~ShardCache.set_ahead`), and give up
  their room to pins to read (:mod:`.cache_pins`). Pins to read that together need more than the limit
  are refused, with what they need and who holds the room (after a bounded wait when other processes
  hold it).
- The processes of a node (DDP ranks, reader processes) share the folder: each shard is downloaded
  once per node, by whichever process asks first; the others wait for it (:mod:`.cache_folder` has the
  locks and the shared bookkeeping).
- After a crash, ``kill -9`` or Ctrl-C, the next cache opened on the folder removes what was half
  written and keeps the complete shards (their sizes checked, and their hashes with ``verify=True``),
  counted against its limit. The folder records which dataset it caches and refuses another.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from dali_pipes.dataset.manifest import human_bytes
from dali_pipes.dataset.progress import bar_disabled, tqdm
from dali_pipes.remote.fs import RemoteError
from dali_pipes.remote.transfer import object_tries
from dali_pipes.staging.cache_folder import (
    CacheError,
    CacheFolder,
    CacheState,
    full_disk,
    remove_leftovers,
)
from dali_pipes.staging.cache_open import FolderOpening
from dali_pipes.staging.cache_pins import holders, no_room, others_may_move, over_limit, pin_needed, set_ahead
from dali_pipes.staging.cache_plan import (
    CacheEntry,
    full_error,
    plan_entries,
    refuse_oversized,
)
from dali_pipes.staging.cache_tuning import CacheTuning
from dali_pipes.staging.checked import MismatchError
from dali_pipes.staging.stage import SOURCE_RECORD
from dali_pipes.staging.threads import Cancelled, run_all

log = logging.getLogger(__name__)

#: Downloads of a shard whose bytes differ from the manifest before its error is raised (the source itself
#: may be damaged: then every download differs).
MISMATCH_ATTEMPTS = 2
#: Seconds after a shard's download failed (its tries spent) during which :meth:`ShardCache.recent_failure` gives it.
FAILED_PAUSE_S = 60.0
#: Seconds a download to be read now waits for room held by downloads under way and by batches being read.
ROOM_WAIT_S = 5.0


class ShardCache(FolderOpening):
    """The shards of the dataset at ``source`` (a URL, or a dataset folder on a slow filesystem) in ``folder``,
    never more than ``limit_bytes`` of them (a shard's index counts with it).

    ``storage_options`` go to the fsspec backend (credentials, endpoint) and are never written or shown.
    Shards are named by their number in the manifest or by their path. See the module docstring.
    """

    def __init__(
        self,
        source: str | os.PathLike,
        folder: str | os.PathLike,
        limit_bytes: int,
        *,
        storage_options: Mapping[str, Any] | None = None,
        tuning: CacheTuning = CacheTuning(),
    ) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 1:
            raise ValueError(f"limit_bytes must be a positive number of bytes, got {limit_bytes!r}")
        self.folder = Path(folder)
        self.limit_bytes = limit_bytes
        self.tuning = tuning
        self.source, self.manifest, manifest_bytes, entries, self._copy = plan_entries(
            source, self.folder, storage_options
        )
        self._entries = {entry.key: entry for entry in entries}
        self._sizes = {entry.key: entry.bytes for entry in entries}
        self._order = [entry.key for entry in entries]
        refuse_oversized(self.folder, entries, limit_bytes)
        if self.folder.exists() and not self.folder.is_dir():
            raise CacheError(f"{self.folder}: is a file; give a folder for the cache (it is made if missing)")
        if (self.folder / SOURCE_RECORD).exists():
            raise CacheError(
                f"{self.folder}: holds a staged copy (dali-pipes stage); give the streaming cache a folder of its own"
            )
        self._state = CacheFolder(self.folder)
        self._cancel = threading.Event()
        self._next_use: dict[str, int] = {}  # key: its rank in the reading order (plan_reads)
        self._failed: dict[str, tuple[float, Exception]] = {}  # key: (when, error) of its last failed download
        self._finalizer = weakref.finalize(self, self._state.close_descriptors)
        self._open(manifest_bytes)

    # --- what the cache holds ----------------------------------------------------------------------

    @property
    def shard_bytes(self) -> tuple[int, ...]:
        """The bytes each shard takes in the cache (with its index), in manifest order."""
        return tuple(self._entries[key].bytes for key in self._order)

    def path(self, shard: int | str) -> Path:
        """Where ``shard`` is (or will be) in the folder."""
        return self.folder / self._select([shard])[0].key

    def present(self, shard: int | str) -> bool:
        """True when ``shard`` is complete in the folder now (another process may evict it unless pinned)."""
        entry = self._select([shard])[0]
        with self._state.locked():
            return entry.key in self._load().present and all(p.exists() for p in self._files(entry))

    @property
    def bytes_held(self) -> int:
        """Bytes of the complete shards in the folder plus those reserved for downloads under way, node-wide."""
        with self._state.locked():
            return self._load().held

    @property
    def peak_bytes(self) -> int:
        """The most :attr:`bytes_held` has been since the first process of this run opened the folder."""
        with self._state.locked():
            return self._load().peak

    # --- pins ------------------------------------------------------------------------------------

    def pin(self, shards: Iterable[int | str]) -> None:
        """Keep ``shards`` from eviction until :meth:`unpin` (counted: pin twice, unpin twice) or this process ends.

        Shards fetched ahead by any holder of the node are given up to make room (:mod:`.cache_pins`). When
        the shards being read on the node, these included, would still need more than the limit, waits up
        to ``tuning.pin_wait_s`` for other processes' windows to move on, then raises :class:`CacheError`
        naming who holds the room; at once when only this process's pins stand in the way (waiting for them
        would never end). Nothing is pinned then. Pinning downloads nothing (:meth:`fetch` does)."""
        keys = [entry.key for entry in self._select(shards)]
        deadline = time.monotonic() + self.tuning.pin_wait_s
        pause = 0.02
        while True:
            with self._state.locked():
                state = self._load()
                self._state.reap(state, self._files_of)
                need = pin_needed(state, self._state.register(), keys, self._sizes, self.limit_bytes)
                if not need:
                    self._save(state)
                    return
                union = state.needed() | set(keys)
                waits = others_may_move(state) and time.monotonic() < deadline
                held = f"; held by {holders(state, self._sizes)}"
            if not waits:
                raise CacheError(over_limit(self.folder, self.limit_bytes, need, union, keys, held + _PIN_ADVICE))
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    def set_ahead(self, shards: Iterable[int | str]) -> list[int | str]:
        """Pin ``shards`` (in reading order) as fetched ahead, in place of those this cache pinned so before: the
        first of them that fit in the room no other pin uses; returned. They are given up when a pin to read
        needs their room (:mod:`.cache_pins`): :meth:`fetch` with ``ahead=True`` then skips them."""
        asked = list(shards)
        entries = self._select(asked) if asked else []
        with self._state.locked():
            state = self._load()
            kept = set(
                set_ahead(state, self._state.register(), [e.key for e in entries], self._sizes, self.limit_bytes)
            )
            self._save(state)
        return [shard for shard, entry in zip(asked, entries) if entry.key in kept]

    def drop_pins(self) -> None:
        """Unpin every shard this cache pins (to read or ahead): its room goes to the other loaders at once."""
        if self._state.holder is not None:
            with self._state.locked():
                state = self._load()
                state.pins.pop(self._state.holder, None)
                state.ahead.pop(self._state.holder, None)
                self._save(state)

    def unpin(self, shards: Iterable[int | str]) -> None:
        """Let ``shards`` be evicted again (once no other pin holds them); ``ValueError`` for one not pinned here
        (but after :meth:`cancel`, whose close may have dropped the pins already)."""
        entries = self._select(shards)
        with self._state.locked():
            state = self._load()
            mine = state.pins.get(self._state.holder or "", {})
            counts = {entry.key: mine.get(entry.key, 0) - 1 for entry in entries}
            unpinned = sorted(key for key, count in counts.items() if count < 0)
            if unpinned and not self._cancel.is_set():
                raise ValueError(f"{self.folder}: {', '.join(unpinned)}: not pinned by this cache, so not unpinned")
            for key, count in counts.items():
                if count > 0:
                    mine[key] = count
                else:
                    mine.pop(key, None)
            if not mine:
                state.pins.pop(self._state.holder or "", None)
            self._save(state)

    @contextlib.contextmanager
    def hold(self, shards: Iterable[int | str]) -> Iterator[list[Path]]:
        """Pin ``shards``, fetch them, and give their paths; unpinned when the block ends."""
        entries = self._select(shards)
        self.pin([entry.key for entry in entries])
        try:
            yield self.fetch([entry.key for entry in entries])
        finally:
            self.unpin([entry.key for entry in entries])

    # --- fetching --------------------------------------------------------------------------------

    def fetch(
        self, shards: Iterable[int | str], *, ahead: bool = False, wanted: Callable[[], bool] | None = None
    ) -> list[Path]:
        """Make ``shards`` present (downloading the missing ones, evicting others as needed); their paths.

        They are pinned while the call runs, so one does not evict another; afterwards they may be evicted by
        later fetches unless pinned (:meth:`hold`). A download that fails is retried as staging's are, then
        raised naming the object; nothing half-written stays. ``ahead``: only those some pin of the node holds, not
        pinned again (others skipped). ``wanted``: asked at each chunk; the downloads stop once it says no."""
        entries = self._select(shards)
        keys = [entry.key for entry in entries]
        if ahead:
            missing = self._use(entries, ahead=True)
            if missing:
                self._download_all(missing, ahead=True, wanted=wanted)
            return [self.folder / key for key in keys]
        self.pin(keys)
        try:
            missing = self._use(entries)
            if missing:
                self._download_all(missing)
        finally:
            self.unpin(keys)
        return [self.folder / key for key in keys]

    def _use(self, entries: list[CacheEntry], ahead: bool = False) -> list[CacheEntry]:
        """Mark the present ones used now; return the others (with ``ahead``, those still pinned only)."""
        missing = []
        with self._state.locked():
            state = self._load()
            if ahead:
                entries = [entry for entry in entries if entry.key in state.pinned()]
            for entry in entries:
                if entry.key in state.present and not all(p.exists() for p in self._files(entry)):
                    log.warning(
                        "cache %s: %s was removed from the folder; downloading it again", self.folder, entry.key
                    )
                    del state.present[entry.key]
                if entry.key in state.present:
                    state.touch(entry.key)
                else:
                    missing.append(entry)
            self._save(state)
        return missing

    def _download_all(self, missing: list[CacheEntry], ahead: bool = False, wanted: Callable | None = None) -> None:
        """Download ``missing``, a few at a time, in daemon threads (:func:`~dali_pipes.staging.threads.run_all`)."""
        lock, stop = threading.Lock(), threading.Event()
        total = sum(entry.bytes for entry in missing)
        quiet = bar_disabled(self.tuning.progress)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"cache {self.folder}", disable=quiet) as bar:

            def advance(count: int) -> None:
                if self._cancel.is_set() or stop.is_set() or (wanted is not None and not wanted()):
                    raise Cancelled(f"{self.folder}: download stopped")
                with lock:
                    bar.update(count)

            calls = [lambda entry=entry: self._obtain(entry, advance, ahead) for entry in missing]
            run_all(calls, self.tuning.downloads, stop)

    def recent_failure(self, shard: int | str) -> Exception | None:
        """The error of ``shard``'s last download by this cache when it failed within :data:`FAILED_PAUSE_S` (and
        none succeeded since): a reader that asks again so soon raises it instead of downloading it once more."""
        failed = self._failed.get(self._select([shard])[0].key)
        return failed[1] if failed is not None and time.monotonic() - failed[0] < FAILED_PAUSE_S else None

    def cancel(self) -> None:
        """Stop this cache's downloads: those under way end at their next chunk (their temporaries removed, their
        reservations released), none starts; for a Ctrl-C or a close that must not wait for them."""
        self._cancel.set()

    def _obtain(self, entry: CacheEntry, advance: Callable[[int], None], ahead: bool = False) -> None:
        """Download ``entry`` unless another process of the node does (then wait for it); with ``ahead``, only
        while it is pinned (its pin may be given up meanwhile)."""
        with self._state.shard_lock(entry.key, self.tuning.wait_s, self._files(entry)):
            if not self._use([entry], ahead):
                return  # another process brought it while this one waited, or it is no longer pinned
            advance(0)  # stopped meanwhile: not started
            if not self._reserve(entry, ahead):
                return
            try:
                self._download(entry, advance)
            except BaseException as exc:
                self._release(entry)
                full = full_error(exc)
                if full is not None:
                    raise CacheError(
                        full_disk(self.folder, self.limit_bytes, f"downloading {entry.key}", full)
                    ) from exc
                raise
            self._commit(entry)
        log.debug("cache %s: downloaded %s (%s)", self.folder, entry.key, human_bytes(entry.bytes))

    def _download(self, entry: CacheEntry, advance: Callable[[int], None]) -> None:
        """Copy ``entry``'s files, once more when one arrives other than the manifest says (damaged on the way:
        the copier's retries cover failed requests, not a body that arrived whole but wrong).

        The failed requests and the wrong bodies share one budget (:func:`~dali_pipes.remote.transfer.object_tries`):
        the shard's error says how many requests were made, and :meth:`recent_failure` gives it for a while."""
        with object_tries(entry.bytes) as tries:
            try:
                for attempt in range(1, MISMATCH_ATTEMPTS + 1):
                    try:
                        for item in entry.items:
                            self._copy(item, self.folder / item.rel, advance)
                        return
                    except MismatchError as exc:
                        if attempt == MISMATCH_ATTEMPTS or tries.failed():
                            raise
                        log.warning("cache %s: %s; downloading %s once more", self.folder, exc, entry.key)
            except (MismatchError, RemoteError) as exc:
                said = type(exc)(f"{exc} (gave up after {tries.made} request(s) for {entry.key})")
                self._failed[entry.key] = (time.monotonic(), said)
                raise said from exc

    def _reserve(self, entry: CacheEntry, ahead: bool = False) -> bool:
        """Make room for ``entry`` (evicting the unpinned shards read furthest ahead first) and reserve its bytes;
        with ``ahead``, False (nothing reserved) when its pin was given up meanwhile. With no room, the download of
        a shard pinned to be read waits up to :data:`ROOM_WAIT_S` (one fetched ahead fails at once): the downloads
        under way end, the shards a reader process reads are let go once it is done."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while (reserved := self._try_reserve(entry, ahead, wait=time.monotonic() < deadline)) is None:
            if self._cancel.is_set():  # closed, or a Ctrl-C: no waiting for room then
                raise Cancelled(f"{self.folder}: download stopped")
            time.sleep(0.01)
        return reserved

    def _try_reserve(self, entry: CacheEntry, ahead: bool, wait: bool) -> bool | None:
        """:meth:`_reserve` once: ``None`` when there is no room yet and ``wait``."""
        with self._state.locked():
            state = self._load()
            self._state.reap(state, self._files_of)
            if ahead and entry.key not in state.pinned():
                return False
            remove_leftovers(self._files(entry), keep_final=False)  # this process holds its lock: all of it is stale
            present = len(state.present)
            short = self._make_room(state, entry)
            if short > 0 or _free(self.folder) < entry.bytes:
                waits = short > 0 and wait and entry.key in state.needed()
                if len(state.present) < present or not waits:
                    self._save(state)  # what was evicted is gone (saved only then while it waits for room)
                if waits:
                    return None
                raise CacheError(
                    no_room(self.folder, self.limit_bytes, state.held, entry.key, entry.bytes)
                    if short > 0
                    else full_disk(self.folder, self.limit_bytes, f"making room for {entry.key}")
                )
            state.reserved[entry.key] = [self._state.register(), entry.bytes]
            state.peak = max(state.peak, state.held)
            self._save(state)
        return True

    def plan_reads(self, shards: Iterable[int | str]) -> None:
        """Tell the order the shards will be read in from now on (a streamer knows its epochs' orders): room is
        then made by evicting the shard needed furthest ahead (never, first), so that what is read soon stays
        (a rerun reads first what the interrupted run kept). Without it, or for shards not in it, the least
        recently used go first."""
        entries = self._select(list(shards))
        self._next_use = {entry.key: rank for rank, entry in reversed(list(enumerate(entries)))}

    def _make_room(self, state: CacheState, entry: CacheEntry) -> int:
        """Evict unpinned shards until ``entry`` fits, those needed furthest ahead first (:meth:`plan_reads`), else
        the least recently used; the bytes still missing then."""
        short = state.held + entry.bytes - self.limit_bytes
        kept = state.pinned() | set(state.reserved)
        never = len(self._order) * 2

        def last_first(key: str) -> tuple[int, int]:
            return -self._next_use.get(key, never), state.used.get(key, 0)

        for key in sorted((k for k in state.present if k not in kept), key=last_first):
            if short <= 0:
                break
            short -= state.present[key]
            self._evict(state, key)
        return short

    def _evict(self, state: CacheState, key: str) -> None:
        for path in self._files_of(key):
            path.unlink(missing_ok=True)
        log.debug("cache %s: evicted %s (%s)", self.folder, key, human_bytes(state.present[key]))
        del state.present[key]
        state.used.pop(key, None)

    def _commit(self, entry: CacheEntry) -> None:
        with self._state.locked():
            state = self._load()
            state.reserved.pop(entry.key, None)
            state.present[entry.key] = entry.bytes
            self._failed.pop(entry.key, None)
            state.touch(entry.key)
            self._save(state)

    def _release(self, entry: CacheEntry) -> None:
        """After a failed download: its reservation dropped, nothing of it left on disk."""
        try:
            with self._state.locked():
                remove_leftovers(self._files(entry), keep_final=False)
                state = self._load()
                state.reserved.pop(entry.key, None)
                self._save(state)
        except Exception:  # noqa: BLE001 - the download's own error is the one to raise
            log.exception("cache %s: could not release the reservation of %s", self.folder, entry.key)

    # --- helpers ---------------------------------------------------------------------------------

    def _select(self, shards: Iterable[int | str]) -> list[CacheEntry]:
        """The entries of ``shards`` (numbers or paths), each once, in the order given."""
        out: dict[str, CacheEntry] = {}
        for shard in [shards] if isinstance(shards, (int, str)) else shards:
            if isinstance(shard, str) and shard in self._entries:
                key = shard
            elif isinstance(shard, int) and not isinstance(shard, bool) and 0 <= shard < len(self._order):
                key = self._order[shard]
            else:
                raise ValueError(
                    f"{self.source}: no shard {shard!r} (shards are 0..{len(self._order) - 1} or their paths)"
                )
            out.setdefault(key, self._entries[key])
        return list(out.values())

    def _files(self, entry: CacheEntry) -> list[Path]:
        return entry.files(self.folder)

    def _files_of(self, key: str) -> list[Path]:
        return self._files(self._entries[key]) if key in self._entries else []

    def _load(self) -> CacheState:
        state = self._state.load()
        if state is None:
            raise CacheError(
                f"{self.folder}: the cache's state ({self._state.meta}/state.json) is missing or damaged; stop the "
                "processes using the folder and open it again (complete shards are kept)"
            )
        return state

    def _save(self, state: CacheState) -> None:
        self._state.save(state, self.limit_bytes)

    def close(self) -> None:
        """Drop this cache's pins and stop using the folder (the shards stay for the next run)."""
        if self._state.holder is not None:
            with self._state.locked():
                state = self._state.load()
                if state is not None:
                    state.pins.pop(self._state.holder, None)
                    state.ahead.pop(self._state.holder, None)
                    self._save(state)
                self._state.unregister()
        self._finalizer()

    def __enter__(self) -> "ShardCache":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


#: What to do when a pin to read finds no room, said after who holds it.
_PIN_ADVICE = (
    "; close the loaders no longer read (StreamOptions(loaders=N) loaders of one dataset fit on a node, 2 by "
    "default; more do not), or count every loader of the node in StreamOptions(loaders=N)"
)


def _free(folder: Path) -> int:
    return shutil.disk_usage(folder).free


__all__ = ["CacheError", "CacheTuning", "Cancelled", "ShardCache"]
