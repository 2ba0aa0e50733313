"""The node-shared bookkeeping of a streaming cache folder: who uses it, what it holds, who pins what.

Every process of a node that uses one cache folder (the DDP ranks, DALI's reader processes) sees the
same state, kept in ``FOLDER/.dali-pipes-cache/``:

- ``lock``: an exclusive ``flock`` taken around every read-modify-write of the state. It is held for
  the time of a bookkeeping step, never while a shard downloads.
- ``state.json``: the shards held and their bytes, when each was last used (a counter, so that the
  least recently used goes first), each holder's pins (those it reads, and those it fetched ahead:
  :mod:`.cache_pins`), and the downloads under way, whose bytes are
  reserved against the limit before their first byte is written. It is rewritten whole and renamed
  into place, so a reader never sees half of it; the shards on disk are the truth it is rebuilt from
  when the first process of a run opens the folder.
- ``holders/<pid>-<random>.lock``: one file per cache opened, ``flock``-ed for its life. The kernel
  drops the lock when its process ends, however it ends (``kill -9`` too), so a holder whose lock can
  be taken is dead: its pins and reservations are dropped. A lock rather than ``kill(pid, 0)``: pids
  are reused, and a process in another pid namespace sharing the folder looks dead from here.
- ``shards/<hash>.lock``: one per shard, held by the process downloading it. A second process that
  wants the same shard waits on it, and takes over (removing what the first left half-written) when
  the first dies. A child forked meanwhile closes its copies of these descriptors (and they are closed
  on ``exec``), so the lock ends with the downloading process, however its children live on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterable, Iterator

from dali_pipes.dataset.manifest import human_bytes
from dali_pipes.staging.checked import TMP_PREFIX, StageError

log = logging.getLogger(__name__)

#: The folder of the bookkeeping, inside the cache folder.
META = ".dali-pipes-cache"
#: Inside :data:`META`: which dataset the folder caches, and the manifest its shards were checked against.
SOURCE_NAME = "source"
MANIFEST_COPY = "index.json"
_STATE = "state.json"
_LOCK = "lock"
_HOLDERS = "holders"
_SHARD_LOCKS = "shards"
#: Errors of a write that found no room: a full disk, a full quota, a file-size limit.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class CacheError(StageError):
    """A streaming cache that cannot do what was asked: pins over its limit, a shard larger than it, a full
    disk, a folder caching another dataset, a shard another process never finished. The message names the
    folder and says what to do."""


@dataclass
class CacheState:
    """What a cache folder holds, node-wide. Keys are shard paths (as the manifest names them)."""

    limit: int
    present: dict[str, int] = field(default_factory=dict)  # complete shards: bytes (with their index)
    used: dict[str, int] = field(default_factory=dict)  # the clock at each shard's last use
    clock: int = 0
    pins: dict[str, dict[str, int]] = field(default_factory=dict)  # holder: {key: count}, shards being read
    ahead: dict[str, list[str]] = field(default_factory=dict)  # holder: keys fetched ahead, given up for room
    reserved: dict[str, list] = field(default_factory=dict)  # key: [holder, bytes] of a download under way
    peak: int = 0
    verified: bool = False

    @property
    def held(self) -> int:
        """Bytes of the complete shards plus those reserved for downloads under way."""
        return sum(self.present.values()) + sum(size for _, size in self.reserved.values())

    def needed(self) -> set[str]:
        """The keys any holder pins to read them (:mod:`.cache_pins`)."""
        return {key for keys in self.pins.values() for key, count in keys.items() if count > 0}

    def pinned(self) -> set[str]:
        """The keys pinned by any holder: to read them, or fetched ahead."""
        return self.needed() | {key for keys in self.ahead.values() for key in keys}

    def touch(self, key: str) -> None:
        """Mark ``key`` used now."""
        self.clock += 1
        self.used[key] = self.clock


class CacheFolder:
    """The bookkeeping files of one cache folder, as one process (and its threads) use them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.meta = root / META
        for sub in (self.meta / _HOLDERS, self.meta / _SHARD_LOCKS):
            sub.mkdir(parents=True, exist_ok=True)
        self._pid = -1
        self._mutex = threading.Lock()
        self._lock_fd: int | None = None
        self._holder: str | None = None
        self._holder_fd: int | None = None
        self._as_read: bytes | None = None  # the state's bytes as this lock's holder read or wrote them
        _FOLDERS.add(self)

    def _this_process(self) -> None:
        """After a fork, start afresh: the parent's lock descriptors would share the parent's locks."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._mutex = threading.Lock()
            self._lock_fd = self._holder = self._holder_fd = None

    def _forget_parent(self) -> None:
        """In a forked child: close the descriptors inherited from the parent.

        An ``flock`` belongs to the open file, which the child shares: kept open, the parent's holder
        lock would outlive the parent (its pins never reaped) for as long as the child lives.
        """
        for fd in (self._holder_fd, self._lock_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._lock_fd = self._holder = self._holder_fd = self._as_read = None

    @property
    def holder(self) -> str | None:
        """This process's holder name, once :meth:`register` made one."""
        self._this_process()
        return self._holder

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the state lock: this process's threads one at a time, and one process of the node."""
        self._this_process()
        with self._mutex:
            if self._lock_fd is None:
                self._lock_fd = os.open(self.meta / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            self._as_read = None  # another process may have written it since this one last held the lock
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def load(self) -> CacheState | None:
        """The state (under :meth:`locked`), or ``None`` when there is none or it is unreadable."""
        try:
            raw = (self.meta / _STATE).read_bytes()
            state = CacheState(**json.loads(raw))
            self._as_read = raw
            return state
        except (OSError, ValueError, TypeError):
            return None

    def save(self, state: CacheState, limit: int) -> None:
        """Write the state whole (under :meth:`locked`): to a temporary name, then renamed over the old one; not at
        all when it is what :meth:`load` read under the same lock (a file made and renamed costs more than the rest of
        most transactions: a look that changed nothing, a shard found missing)."""
        # Its fields as they are (plain dicts and lists): asdict's deep copy cost more than the rest of a download.
        raw = json.dumps({f.name: getattr(state, f.name) for f in fields(state)}, separators=(",", ":")).encode()
        if raw == self._as_read:
            return
        tmp = self.meta / f".{_STATE}.{os.getpid()}-{threading.get_ident()}"
        try:
            tmp.write_bytes(raw)
            os.replace(tmp, self.meta / _STATE)
            self._as_read = raw
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in FULL_ERRNOS:
                raise CacheError(full_disk(self.root, limit, "writing the cache's state", exc)) from exc
            raise CacheError(f"{self.root}: cannot write the cache's state ({exc})") from exc

    # --- holders ---------------------------------------------------------------------------------

    def register(self) -> str:
        """Become a holder (under :meth:`locked`): a lock file held until :meth:`unregister` or this process ends."""
        name = self.holder
        if name is None:
            name = f"{os.getpid()}-{secrets.token_hex(4)}"
            fd = os.open(self.meta / _HOLDERS / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._holder, self._holder_fd = name, fd
        return name

    def unregister(self) -> None:
        """Stop being a holder (under :meth:`locked`)."""
        if self.holder is not None:
            (self.meta / _HOLDERS / f"{self._holder}.lock").unlink(missing_ok=True)
            os.close(self._holder_fd)
        self._holder = self._holder_fd = None

    def close_descriptors(self) -> None:
        """Close this process's descriptors (its holder lock with them: others then see it dead); under the
        threads' lock, so that no other thread of the cache is between opening the state lock and taking it."""
        with self._mutex:
            for fd in (self._holder_fd, self._lock_fd):
                if fd is not None and self._pid == os.getpid():
                    os.close(fd)
            self._holder_fd = self._lock_fd = self._holder = None

    def live_holders(self) -> set[str]:
        """The holders alive now (under :meth:`locked`); the lock files of dead ones are removed."""
        live = set()
        for path in (self.meta / _HOLDERS).glob("*.lock"):
            name = path.name[: -len(".lock")]
            if name == self.holder or _held(path):
                live.add(name)
            else:
                path.unlink(missing_ok=True)
        return live

    def reap(self, state: CacheState, files_of: Callable[[str], list[Path]]) -> set[str]:
        """Drop the pins and reservations of dead holders (under :meth:`locked`); return the live holders.

        What a dead downloader left (temporaries, a shard renamed into place without its index) is removed
        when nobody downloads that shard now; otherwise its new downloader removes it before starting."""
        live = self.live_holders()
        for holder in [h for h in state.pins if h not in live]:
            del state.pins[holder]
        for holder in [h for h in state.ahead if h not in live]:
            del state.ahead[holder]
        for key, (holder, _) in list(state.reserved.items()):
            if holder not in live:
                del state.reserved[key]
                fd = self.try_shard_lock(key)
                if fd is not None:
                    remove_leftovers(files_of(key), keep_final=False)
                    _unlock(fd)
        return live

    # --- one download per shard ------------------------------------------------------------------

    def _shard_lock_path(self, key: str) -> Path:
        return self.meta / _SHARD_LOCKS / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.lock"

    def try_shard_lock(self, key: str) -> int | None:
        """The locked descriptor of ``key``'s download lock, or ``None`` when a download holds it.

        Recorded until :func:`_unlock` (under a lock that a fork waits for), so that a child forked meanwhile
        closes it: the lock then ends with this process, not with the longest-lived of its children."""
        with _SHARD_FDS_LOCK:
            fd = os.open(self._shard_lock_path(key), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            _SHARD_FDS.add(fd)
        return fd

    @contextlib.contextmanager
    def shard_lock(self, key: str, wait_s: float, files: list[Path]) -> Iterator[None]:
        """Hold ``key``'s download lock, waiting while another process downloads it; :class:`CacheError` naming
        the shard when its temporaries have not grown for ``wait_s`` seconds."""
        fd = self.try_shard_lock(key)
        if fd is None:
            log.info("cache %s: another process is downloading %s; waiting for it", self.root, key)
            fd = _wait_for_lock(self, key, wait_s, files)
        try:
            yield
        finally:
            _unlock(fd)


def _unlock(fd: int) -> None:
    """Release a download lock and close it: a forked child sharing the open file would otherwise keep it held."""
    with _SHARD_FDS_LOCK:
        _SHARD_FDS.discard(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _forget_parents() -> None:
    """In a forked child: close the parent's download locks (closed, not unlocked: that would unlock the
    parent's too) and the descriptors of its folders (:meth:`CacheFolder._forget_parent`)."""
    for fd in list(_SHARD_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _SHARD_FDS.clear()
    _SHARD_FDS_LOCK.release()  # taken by the fork (os.register_at_fork's before) in the thread that forked
    for folder in list(_FOLDERS):
        folder._forget_parent()


#: Every CacheFolder of this process, so that a forked child closes what it inherited (:meth:`CacheFolder._forget_parent`).
_FOLDERS: "weakref.WeakSet[CacheFolder]" = weakref.WeakSet()
#: The descriptors of the download locks this process holds, and the lock a fork takes so that none is being
#: opened (and not yet recorded) while it copies the process.
_SHARD_FDS: set[int] = set()
_SHARD_FDS_LOCK = threading.Lock()
os.register_at_fork(
    before=_SHARD_FDS_LOCK.acquire, after_in_parent=_SHARD_FDS_LOCK.release, after_in_child=_forget_parents
)


def _wait_for_lock(folder: CacheFolder, key: str, wait_s: float, files: list[Path]) -> int:
    seen, deadline, pause = -1, time.monotonic() + wait_s, 0.02
    while True:
        fd = folder.try_shard_lock(key)
        if fd is not None:
            return fd
        grown = sum(_size(tmp) for tmp in temporaries(files))
        if grown != seen:  # the other download is moving
            seen, deadline = grown, time.monotonic() + wait_s
        if time.monotonic() > deadline:
            raise CacheError(
                f"{folder.root}: shard {key}: another process of this node has been downloading it for {wait_s:g} s "
                "without progress; check that process (and the storage server), or remove it and run again"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def _held(path: Path) -> bool:
    """True when a live process holds the ``flock`` of ``path``."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def temporaries(files: Iterable[Path]) -> list[Path]:
    """The temporary files of downloads of ``files`` (named by :func:`~dali_pipes.staging.checked.write_checked`)."""
    found = []
    for path in files:
        prefix = f"{TMP_PREFIX}{path.name}-"
        try:
            names = os.listdir(path.parent)
        except OSError:
            continue
        found += [path.parent / n for n in names if n.startswith(prefix) and n[len(prefix) :].count("-") == 1]
    return found


def remove_leftovers(files: list[Path], *, keep_final: bool) -> None:
    """Remove the temporaries of ``files`` and, unless ``keep_final``, the files themselves."""
    for path in temporaries(files) + ([] if keep_final else files):
        path.unlink(missing_ok=True)


def full_disk(root: Path, limit: int, doing: str, exc: BaseException | None = None) -> str:
    """The message of a write that found the disk of the cache folder full."""
    free = shutil.disk_usage(root).free
    why = f" ({os.strerror(exc.errno)})" if isinstance(exc, OSError) and exc.errno else ""
    return (
        f"{root}: the disk is full{why} while {doing}: {human_bytes(free)} free there, and the cache's limit is "
        f"{human_bytes(limit)} ({limit} bytes); free space there, lower the limit to what the disk has free, or give "
        "a cache folder on a larger disk"
    )


__all__ = ["CacheError", "CacheFolder", "CacheState", "META", "full_disk", "remove_leftovers", "temporaries"]
