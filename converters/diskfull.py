"""Recognising a write refused for want of space, and saying why in words, for the one-line errors.

Shared by the conversion runner (a shard that ran out of space) and ``merge`` (a
merged file that did): both end with one line saying which limit was hit (the
disk, a quota, or a file-size limit) and how much space the output folder has left.
"""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path
from typing import Iterator

from dali_pipes.dataset.manifest import human_bytes

#: errno values that mean "no room for these bytes": a full disk, a full quota, or a file-size limit.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _errors(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors that caused it, outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def disk_full_errno(exc: BaseException) -> int | None:
    """The errno of a write refused for want of space in ``exc`` or its causes, else ``None``.

    Writers wrap OS errors differently (HDF5 and LMDB raise their own types), so besides
    ``errno`` the message is checked for the system's words for these errors.
    """
    for current in _errors(exc):
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current.errno
    for current in _errors(exc):
        for code in DISK_FULL_ERRNOS:
            if os.strerror(code) in str(current):
                return code
    return None


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a write refused for want of space."""
    return disk_full_errno(exc) is not None


def free_space(folder: Path) -> str:
    """``'1.2 GB free on FOLDER'`` (space an unprivileged user may use), or a note that it is unknown."""
    try:
        stats = os.statvfs(folder)
    except OSError as exc:
        return f"free space on {folder} unknown ({exc.strerror})"
    return f"{human_bytes(stats.f_bavail * stats.f_frsize)} free on {folder}"


def disk_full_why(exc: BaseException) -> str:
    """Which limit refused the write of ``exc``, in words: the file-size limit, the quota, or the disk."""
    code = disk_full_errno(exc)
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return f"the file-size limit (ulimit -f) of {human_bytes(limit)} was reached"
        return "the file system's largest file size was reached"
    if code == errno.EDQUOT:
        return "the disk quota is used up"
    return "no space left on the device"


def disk_full_message(final: Path, out: Path, exc: BaseException) -> str:
    """One line for a shard that ran out of space: which shard, why (disk, quota or file-size limit), what is free."""
    todo = "raise the limit (or use smaller shards)" if disk_full_errno(exc) == errno.EFBIG else "free space"
    return (
        f"{final}: disk full while writing this shard ({disk_full_why(exc)}; {free_space(out)}); nothing of it was "
        f"kept. The finished shards are kept: {todo} and run the same command again to continue"
    )
