"""Folders in the tmpfs (``/dev/shm``) that do not outlive their process, even one killed with SIGKILL.

A tmpfs file is memory until it is deleted, so a folder left by a killed process
holds memory until the machine restarts. Each folder is owned through an
exclusive ``flock`` on its ``.owner.lock``, held for the owner's life: the kernel
releases it when the owner dies, however it dies, and the next folder made with
the same prefix removes every folder whose lock it can take. A lock rather than
a process id: a process in another PID namespace sharing ``/dev/shm`` (a
container with ``--ipc=host``) has ids that look dead from here.

The lock file is created under another name, locked, and only then renamed to
``.owner.lock``: a lock file seen under its final name is always held (until
its owner ends), so a folder being made is never taken for an orphan.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

log = logging.getLogger(__name__)

#: The tmpfs every shared-memory folder of dali-pipes is made in.
TMPFS = "/dev/shm"
#: The lock file its owner holds in each folder.
OWNER_LOCK = ".owner.lock"
#: A folder without a lock file older than this was left by a process killed while making it.
UNLOCKED_GRACE_S = 60.0
_MAKING_LOCK = ".owner.lock.making"


def writable_tmpfs() -> str | None:
    """:data:`TMPFS` when this process may write there, else ``None``."""
    return TMPFS if os.path.isdir(TMPFS) and os.access(TMPFS, os.W_OK) else None


class OwnedFolder:
    """A new folder ``TMPFS/<prefix><pid>-<random>``, removed by :meth:`close`, at exit, or after a kill.

    Folders with the same prefix left by killed processes are removed first.
    A forked child does not remove its parent's folder.
    """

    def __init__(self, prefix: str) -> None:
        remove_orphans(prefix)
        self.path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=TMPFS))
        try:
            lock_fd = _hold_owner_lock(self.path)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _remove_folder, self.path, os.getpid(), lock_fd)

    def close(self) -> None:
        """Remove the folder (readers that still have its files open keep their pages until they close)."""
        self._finalizer()


def _hold_owner_lock(folder: Path) -> int:
    """Create ``folder/.owner.lock`` already locked (made under another name, renamed once locked)."""
    making = folder / _MAKING_LOCK
    fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(making, folder / OWNER_LOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_folder(folder: Path, owner_pid: int, lock_fd: int) -> None:
    # A forked worker inherits the finalizer; only the process that made the folder removes it.
    if os.getpid() == owner_pid:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock_fd)


def remove_orphans(prefix: str) -> None:
    """Remove the folders ``TMPFS/<prefix>*`` whose owner ended without removing them (its lock is free)."""
    try:
        names = [name for name in os.listdir(TMPFS) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        folder = Path(TMPFS) / name
        if _is_orphan(folder):
            log.info("removing %s, left by a process that was killed", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _is_orphan(folder: Path) -> bool:
    try:
        fd = os.open(folder / OWNER_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        # Being made right now (the lock is renamed into place once held), or its maker was killed first.
        try:
            return time.time() - folder.stat().st_mtime > UNLOCKED_GRACE_S
        except OSError:
            return False
    except OSError:
        return False  # not ours to judge (another user's folder)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its owner is alive
    finally:
        os.close(fd)
    return True
