"""A plain LMDB given by URL, downloaded before it is read: an LMDB is memory-mapped, never opened over the network.

:func:`download_lmdb` copies the LMDB's data file (``data.mdb``; the lock file is not needed, the
LMDB is opened read-only without locking) into a local folder, one per URL:
``$DALI_PIPES_CACHE/lmdb-input-NAME-HASH`` (default cache ``~/.cache/dali-pipes``), or the folder
given. The free space there is checked before the first byte; the bytes go by ranged reads,
retried with backoff (:mod:`dali_pipes.remote.transfer`), to a temporary name that is renamed only
once the count matches the object's listed size. ``download.json`` beside it records that size,
the SHA-256 of the bytes as they arrived and the store's key of the object (fsspec's ``ukey``), so
that a re-run (a conversion killed or failed) uses the copy again only when the object is unchanged
and the local file still hashes to what arrived; otherwise it downloads again. One process
downloads at a time (a lock file): the others wait, then use its copy.
:func:`remove_download` deletes the folder, once the conversion is done.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

from converters.base import ConversionError
from converters.remote_inputs import url_fs
from dali_pipes.dataset.fileio import atomic_write_json, fsync_dir, sha256_file
from dali_pipes.dataset.manifest import human_bytes
from dali_pipes.remote.fs import RemoteError
from dali_pipes.remote.transfer import download_to, retrying
from dali_pipes.remote.urls import join, redact
from dali_pipes.staging.download import default_cache_dir

log = logging.getLogger(__name__)

DATA_NAME = "data.mdb"
RECORD_NAME = "download.json"


def download_folder(url: str, download_dir: str | os.PathLike | None = None) -> Path:
    """The local folder the LMDB at ``url`` is downloaded into (``download_dir``, else one under the cache)."""
    if download_dir is not None:
        return Path(os.path.abspath(download_dir))  # absolute: workers may start in another folder
    cache = default_cache_dir(url)
    return cache.with_name("lmdb-input-" + cache.name)


def download_lmdb(url: str, download_dir: str | os.PathLike | None = None) -> Path:
    """Download the LMDB at ``url`` (its folder, holding ``data.mdb``, or that file); return the local folder.

    Raises :class:`ConversionError` naming the URL (no such object, no access) or the folder (no room).
    """
    fs, path = url_fs(url)
    data_url = url if url.rstrip("/").endswith(".mdb") else join(url, DATA_NAME)
    data_path = path if data_url == url else join(path, DATA_NAME)
    try:
        info = retrying(lambda: fs.info(data_path), data_url, "looking it up")
        ukey = str(retrying(lambda: fs.ukey(data_path), data_url, "looking it up"))
    except RemoteError as exc:
        raise ConversionError(f"{exc}; give the LMDB's folder (holding {DATA_NAME}) or that file") from None
    size = int(info.get("size") or 0)
    folder = download_folder(url, download_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process downloading the same URL: wait, then take its copy
        if _kept(folder, size, ukey):
            log.info("%s: using the copy downloaded before in %s", redact(data_url), folder)
            return folder
        _download(fs, data_path, data_url, folder, size, ukey)
    return folder


def _kept(folder: Path, size: int, ukey: str) -> bool:
    """True when ``folder`` holds a whole earlier download of this very object, its bytes unchanged since."""
    try:
        record = json.loads((folder / RECORD_NAME).read_text())
        local = folder / DATA_NAME
        return (
            record.get("bytes") == size == local.stat().st_size
            and record.get("ukey") == ukey
            and sha256_file(local) == record.get("sha256")
        )
    except (OSError, ValueError):
        return False


def _download(fs, data_path: str, data_url: str, folder: Path, size: int, ukey: str) -> None:
    """Download the data file into ``folder`` through a temporary name, checked by size; record it."""
    shown = redact(data_url)
    for stale in (folder / RECORD_NAME, folder / DATA_NAME):
        stale.unlink(missing_ok=True)
    free = shutil.disk_usage(folder).free
    if size > free:
        raise ConversionError(
            f"{folder}: downloading the LMDB {shown} needs {human_bytes(size)} but only {human_bytes(free)} is free "
            "there; free space, or download it elsewhere (--download-dir, or DALI_PIPES_CACHE)"
        )
    log.info("%s: an LMDB is read from a local copy; downloading %s into %s", shown, human_bytes(size), folder)
    tmp = folder / f".{DATA_NAME}.part-{os.getpid()}"
    try:
        with open(tmp, "wb") as out:
            try:
                got, digest = download_to(fs, data_path, data_url, out, size)
            except RemoteError as exc:
                raise ConversionError(str(exc)) from None
            out.flush()
            os.fsync(out.fileno())
        if got != size:
            raise ConversionError(
                f"{shown}: {got if got < size else f'more than {size}'} bytes arrived but the object was listed with "
                f"{size}: it changed while being downloaded (or is damaged); run the same command again"
            )
        os.replace(tmp, folder / DATA_NAME)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(folder)
    atomic_write_json(folder / RECORD_NAME, {"url": shown, "bytes": size, "sha256": digest, "ukey": ukey})


def remove_download(folder: Path) -> None:
    """Delete what :func:`download_lmdb` wrote in ``folder`` (after the conversion that needed it), and the folder
    when that leaves it empty: a ``--download-dir`` that holds other files keeps them."""
    for name in (DATA_NAME, RECORD_NAME, ".lock"):
        (folder / name).unlink(missing_ok=True)
    for part in folder.glob(f".{DATA_NAME}.part-*"):
        part.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()
    log.info("%s: removed the downloaded LMDB", folder)


__all__ = ["DATA_NAME", "download_folder", "download_lmdb", "remove_download"]
