"""Small file helpers shared by writers, readers and reports: atomic writes and hashing."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

_HASH_CHUNK = 8 << 20


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one.

    The bytes go to a temporary name in the same folder (same filesystem, so the
    rename is atomic), are flushed to disk, and only then renamed over ``path``.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON at ``path`` (its folder made if needed), atomically; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(data, indent=1) + "\n").encode())
    return path


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries, so that a rename inside it survives a power cut."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on folders; the rename still happened
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's contents, read in large chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
