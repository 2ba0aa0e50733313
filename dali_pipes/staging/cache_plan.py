"""What a streaming cache holds of a dataset, and which of it a folder already holds whole.

A cache *entry* is one shard with its index file, if it has one (a TFRecord shard's ``.idx``): they are
downloaded, counted against the limit and evicted together. Entries are planned where the dataset is
(:func:`~dali_pipes.staging.stage.plan_source`: a URL's manifest and listing, or a local folder), so
their sizes and SHA-256 are the manifest's. :func:`kept_entries` decides, when the first process of a
run opens a folder, which entries an earlier run left whole.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from dali_pipes.dataset.fileio import sha256_file
from dali_pipes.dataset.manifest import Manifest, Shard, human_bytes, parse_manifest
from dali_pipes.remote.urls import redact
from dali_pipes.staging.cache_folder import FULL_ERRNOS, CacheError, remove_leftovers
from dali_pipes.staging.checked import TMP_PREFIX, StageItem
from dali_pipes.staging.stage import plan_source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheEntry:
    """One shard as the cache holds it: its files (the shard, and its index if it has one) and their bytes."""

    shard: Shard
    items: tuple[StageItem, ...]
    bytes: int

    @property
    def key(self) -> str:
        """The shard's path in the manifest: its name in the cache's bookkeeping and in the folder."""
        return self.shard.path

    def files(self, root: Path) -> list[Path]:
        """Where the entry's files are in the folder ``root``."""
        return [root / item.rel for item in self.items]


class CachePlan(NamedTuple):
    """What a streaming cache holds of a dataset (:func:`plan_entries`)."""

    origin: str  #: the dataset's name with any secret taken out (recorded in the folder)
    manifest: Manifest
    manifest_bytes: bytes
    entries: list[CacheEntry]
    copy: Callable  #: downloads one file through a temporary name, checked against its size and SHA-256


def plan_entries(source: str | os.PathLike, folder: Path, storage_options: Mapping[str, Any] | None) -> CachePlan:
    """The :class:`CachePlan` of the dataset at ``source``, read where it is."""
    if str(source).endswith((".h5", ".hdf5")):
        shown = redact(str(source), storage_options)
        raise CacheError(f"{shown}: a merged .h5 file is not streamed; give the dataset folder (or its URL)")
    plan = plan_source(source, folder, storage_options)
    items, (_, manifest_bytes), origin, copy = plan.items, plan.marker, plan.origin, plan.copy
    manifest = parse_manifest(json.loads(manifest_bytes), where=origin)
    by_rel = {item.rel: item for item in items}
    entries = []
    for shard in manifest.shards:
        files = tuple(by_rel[rel] for rel in (shard.path, shard.index_path) if rel)
        entries.append(CacheEntry(shard, files, sum(item.bytes for item in files)))
    return CachePlan(origin, manifest, manifest_bytes, entries, copy)


def refuse_oversized(folder: Path, entries: list[CacheEntry], limit: int) -> None:
    """:class:`CacheError` when one shard alone takes more than ``limit``: no cache of that size can hold it."""
    largest = max(entries, key=lambda entry: entry.bytes, default=None)
    if largest is not None and largest.bytes > limit:
        raise CacheError(
            f"{folder}: shard {largest.key} takes {human_bytes(largest.bytes)} ({largest.bytes} bytes, with its "
            f"index), more than the cache's limit of {human_bytes(limit)} ({limit} bytes); raise the limit (to "
            "several shards: the shards being read and the next ones), or convert the dataset into smaller shards"
        )


def kept_entries(root: Path, entries: list[CacheEntry], previous: Manifest | None, verify: bool) -> list[CacheEntry]:
    """The entries an earlier run left whole in ``root``; everything else of the dataset there is removed.

    Removed: temporaries of killed downloads, the shards of an older version of the dataset (named by the
    ``previous`` manifest), and entries not whole. Sizes are always checked; hashes when ``verify``, and for
    shards the previous manifest does not record as they are now (a changed dataset, or a folder whose
    bookkeeping was lost)."""
    for tmp in root.rglob(f"{TMP_PREFIX}*"):
        tmp.unlink(missing_ok=True)
    trusted = {shard.path: shard for shard in previous.shards} if previous else {}
    current = {entry.key for entry in entries}
    for shard in trusted.values():
        if shard.path not in current:
            for rel in filter(None, (shard.path, shard.index_path)):
                (root / rel).unlink(missing_ok=True)
    kept = []
    for entry in entries:
        if whole(root, entry, hashed=verify or trusted.get(entry.key) != entry.shard):
            kept.append(entry)
        else:
            remove_leftovers(entry.files(root), keep_final=False)
    return kept


def whole(root: Path, entry: CacheEntry, *, hashed: bool) -> bool:
    """True when every file of ``entry`` is in ``root`` at its size (and, if ``hashed``, its SHA-256)."""
    for item in entry.items:
        path = root / item.rel
        try:
            if path.stat().st_size != item.bytes:
                return False
        except FileNotFoundError:
            return False
        if hashed and item.sha256 is not None and sha256_file(path) != item.sha256:
            log.warning("cache %s: %s does not match the manifest's SHA-256; removing it", root, item.rel)
            return False
    return True


def read_bytes(path: Path) -> bytes | None:
    """The bytes of the file at ``path``, or ``None`` when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def read_manifest(path: Path) -> Manifest | None:
    """The manifest stored at ``path``, or ``None`` when there is none or it is unreadable."""
    try:
        return parse_manifest(json.loads(path.read_bytes()), where=str(path))
    except (OSError, ValueError):
        return None


def full_error(exc: BaseException | None) -> OSError | None:
    """The "no room" error (full disk, quota, file-size limit) behind ``exc``, if that is what it is."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


__all__ = [
    "CacheEntry",
    "full_error",
    "kept_entries",
    "plan_entries",
    "read_bytes",
    "read_manifest",
    "refuse_oversized",
    "whole",
]
