"""Which filesystem a folder is on, and whether that filesystem is a network one (read from the mount table).

A node's streaming cache (:mod:`dali_pipes.staging.stream_cache`) is shared by the processes of one node through
files and ``flock``; on a network filesystem every node that names the same folder would share one "node" cache
and its locks. ``~/.cache`` is on NFS on many clusters, so the default cache folder is checked here.

The table is Linux's ``/proc/self/mountinfo`` (the mount points as this process sees them, bind mounts and
containers included); ``os.statvfs`` does not say the filesystem's type. :func:`filesystem_type` is a pure
function over the table's text, so it is tested on any table; elsewhere than Linux nothing is known (``None``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["MOUNTINFO", "NETWORK_TYPES", "filesystem_type", "is_network", "network_filesystem"]

#: The mount table this process sees.
MOUNTINFO = "/proc/self/mountinfo"
#: Filesystem types (mountinfo's ``fstype``) whose files live on other machines: shared by the nodes that mount them.
NETWORK_TYPES = frozenset(
    {
        *("nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "9p", "afs", "ncpfs", "coda"),
        *("lustre", "gpfs", "beegfs", "ceph", "cephfs", "glusterfs", "orangefs", "pvfs2", "panfs", "ocfs2", "gfs2"),
        *("wekafs", "quobyte", "vastfs", "davfs", "fuse.davfs"),
    }
)
#: FUSE filesystems (``fuse.NAME``) that keep their files on this machine; any other ``fuse.*`` (s3fs, gcsfuse,
#: sshfs, rclone, juicefs, ...) is taken for a network one.
LOCAL_FUSE = frozenset(
    {"fuse-overlayfs", "lxcfs", "squashfuse", "bindfs", "gvfsd-fuse", "portal", "encfs", "gocryptfs"}
)


def is_network(fstype: str) -> bool:
    """True for a filesystem type whose files are on other machines (:data:`NETWORK_TYPES`, or a remote FUSE)."""
    if fstype in NETWORK_TYPES:
        return True
    kind, _, subtype = fstype.partition(".")
    return kind in ("fuse", "fuseblk") and bool(subtype) and subtype not in LOCAL_FUSE


def _unescape(field: str) -> str:
    # mountinfo writes a space, tab, newline and backslash in a path as \040, \011, \012 and \134.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str | os.PathLike, mountinfo: str) -> tuple[str, str] | None:
    """``(mount point, fstype)`` of the mount that holds the absolute ``path`` in the table ``mountinfo`` (the
    text of ``/proc/self/mountinfo``): the deepest mount point above it, the last one mounted there if several
    are. ``None`` when no line of the table is above it."""
    target = Path(path).parts
    found: tuple[str, str] | None = None
    depth = -1
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue  # not a mountinfo line
        point = _unescape(fields[4])
        fstype = fields[fields.index("-", 6) + 1]
        parts = Path(point).parts
        if target[: len(parts)] == parts and len(parts) >= depth:  # a later mount over the same point hides it
            found, depth = (point, fstype), len(parts)
    return found


def network_filesystem(path: str | os.PathLike) -> str | None:
    """The type of the network filesystem that ``path`` (made absolute, symlinks resolved; it need not exist yet)
    is on, such as ``"nfs4"`` or ``"fuse.s3fs"``; ``None`` on a local one, or where the mount table cannot be read."""
    try:
        table = Path(MOUNTINFO).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    mount = filesystem_type(Path(path).expanduser().resolve(), table)
    return mount[1] if mount is not None and is_network(mount[1]) else None
