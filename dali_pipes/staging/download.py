"""The plan and the copier of a dataset at a URL: its files, and how one is downloaded into a local folder.

:func:`~dali_pipes.staging.stage.stage_dataset` plans and copies; this module gives it the plan of a
remote dataset (its manifest read over the network, every shard and index named with its size and
hash) and the copier that downloads one file by ranged reads, retrying dropped connections and
throttling with backoff (:mod:`dali_pipes.remote.transfer`), into a temporary name renamed only when
its size and SHA-256 match the manifest. LMDB, HDF5 and TFRecord shards are then read locally: no
shard is ever opened over the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from dali_pipes.dataset.manifest import ERRORS_NAME, MANIFEST_NAME, resolve_inside
from dali_pipes.remote.dataset import load_remote_manifest
from dali_pipes.remote.fs import FIRST_CONTACT, filesystem
from dali_pipes.remote.transfer import download_to, retrying
from dali_pipes.remote.urls import join, redact
from dali_pipes.staging.checked import StageError, StageItem, write_checked

log = logging.getLogger(__name__)

#: Where datasets given by URL are staged when no folder is named: ``$DALI_PIPES_CACHE``, else
#: ``$XDG_CACHE_HOME/dali-pipes``, else ``~/.cache/dali-pipes``; one sub-folder per URL.
CACHE_ENV = "DALI_PIPES_CACHE"


def default_cache_dir(url: str) -> Path:
    """The local folder a dataset at ``url`` is staged into when no ``stage_to`` is given."""
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dali-pipes"
    )
    clean = redact(url).rstrip("/")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", clean.split("://", 1)[-1])[-80:].strip("_")
    return Path(base) / f"{readable}-{hashlib.sha256(clean.encode()).hexdigest()[:10]}"


def plan_remote(
    url: str, dest: Path, storage_options: Mapping[str, Any] | None = None
) -> tuple[list[StageItem], tuple[Path, bytes], Path, str, Callable]:
    """``(items, (marker path, marker bytes), path to open, origin, copier)`` for the dataset at ``url``."""
    url = url.rstrip("/")
    shown = redact(url, storage_options)
    if url.endswith((".h5", ".hdf5")):
        raise StageError(
            f"{shown}: a merged .h5 file is staged from a local path only; stage the dataset folder's URL instead"
        )
    fs, root = filesystem(url, storage_options)
    # The first request, with a person waiting: a server that is down is said within seconds, as inspect says it.
    manifest, marker_bytes = load_remote_manifest(url, storage_options, FIRST_CONTACT)
    # One listing gives every size the manifest does not (index files, errors.jsonl): one request, not one per file.
    sizes = _sizes(fs, root, url, storage_options)
    items = []
    for shard in manifest.shards:
        resolve_inside(dest, shard.path)  # refuses a path that leaves the dataset (and so DEST)
        items.append(StageItem(shard.path, join(root, shard.path), shard.bytes, shard.sha256))
        if shard.index_path:
            resolve_inside(dest, shard.index_path)
            index = join(root, shard.index_path)
            size = sizes.get(index)
            if size is None:  # not listed (a store slow to list what was just written): asked for, or named missing
                size = _size(fs, index, join(url, shard.index_path), storage_options)
            items.append(StageItem(shard.index_path, index, size, shard.index_sha256))
    errors = join(root, ERRORS_NAME)
    if errors in sizes:
        items.append(StageItem(ERRORS_NAME, errors, sizes[errors], None))
    copier = _copier(fs, root, url, storage_options)
    return items, (dest / MANIFEST_NAME, marker_bytes), dest, shown, copier


def _sizes(fs: Any, root: str, url: str, storage_options: Mapping[str, Any] | None) -> dict[str, int]:
    """``{path: size}`` of every object under ``root``, from one (paged) listing."""
    listed = retrying(lambda: fs.find(root, detail=True), url, "listing", storage_options)
    return {path.rstrip("/"): int(info.get("size") or 0) for path, info in listed.items()}


def _size(fs: Any, path: str, url: str, storage_options: Mapping[str, Any] | None) -> int:
    info = retrying(lambda: fs.info(path), url, "looking it up", storage_options)
    return int(info.get("size") or 0)


def _copier(fs: Any, root: str, url: str, storage_options: Mapping[str, Any] | None) -> Callable:
    """Download one item through a temporary name, checked against its size and SHA-256 before the rename."""

    def copy(item: StageItem, target: Path, advance: Callable[[int], None]) -> None:
        item_url = join(url, item.rel)

        def fill(out) -> tuple[int, str]:
            return download_to(fs, str(item.source), item_url, out, item.bytes, advance, storage_options)

        write_checked(item, target, fill, redact(item_url, storage_options))

    return copy


__all__ = ["CACHE_ENV", "default_cache_dir", "plan_remote"]
