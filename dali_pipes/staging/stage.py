"""``dali-pipes stage``: copy a converted dataset to fast local storage, in parallel and resumably.

A dataset on a network filesystem is re-read by every rank every epoch; a copy
on a local SSD or a tmpfs (``/dev/shm``) is read at memory or disk speed. Staging:

- copies every file the dataset needs (shards, TFRecord indexes, ``errors.jsonl``;
  for a merged ``.h5`` file, the file and, for a virtual one, the shard files its
  virtual datasets map, at the same relative paths so that they still resolve),
  several files at a time, with a progress bar in bytes;
- checks every copied shard's SHA-256 against the manifest while copying it
  (the bytes are hashed as they are read, so the source is read once);
- writes each file under a temporary name and renames it into place only when it
  is whole and its hash matches, so a file at its final name is always complete;
- writes the *completion marker* last: the dataset's ``index.json`` (byte for
  byte the source's), or for a merged file a ``.NAME.staged.json`` record. Until
  it is there, no reader takes ``DEST`` for a dataset;
- is resumable: after a crash (even SIGKILL) a second run keeps the files already
  in place whose hash still matches and copies the rest; a copy found complete
  (its marker matches the source) is reused after a size check (``verify=True``
  re-hashes it);
- refuses a ``DEST`` that holds another dataset's copy (``DEST/.dali-pipes-staged-from``
  records the source, before the first file is copied): one folder, one dataset;
- is serialised by a lock file in ``DEST``: of several processes staging the same
  dataset on one node (the ranks of a DDP job), one copies and the others wait
  for it and then reuse its copy. A process that dies holding the lock releases
  it, and the next one resumes where it stopped.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from dali_pipes.dataset.fileio import atomic_write_bytes, sha256_file
from dali_pipes.dataset.manifest import ERRORS_NAME, MANIFEST_NAME, human_bytes, load_manifest, resolve_inside
from dali_pipes.dataset.progress import bar_disabled, tqdm
from dali_pipes.remote.urls import is_url
from dali_pipes.staging.checked import TMP_PREFIX, StageError, StageItem, write_checked

log = logging.getLogger(__name__)

#: The lock file that serialises stagers into one folder.
LOCK_NAME = ".dali-pipes-stage.lock"
#: Records which dataset a folder holds a copy of (written before its first file is copied).
SOURCE_RECORD = ".dali-pipes-staged-from"
_CHUNK = 8 << 20


@dataclass
class StageReport:
    """What :func:`stage_dataset` did: where the copy is, and which files it copied or found in place."""

    path: Path
    copied: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    reused: bool = False
    bytes_copied: int = 0


def stage_dataset(
    dataset: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    verify: bool = False,
    workers: int = 4,
    progress: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> StageReport:
    """Copy ``dataset`` (a dataset folder or a merged ``.h5`` file) into the folder ``dest``.

    Returns a :class:`StageReport` whose ``path`` is what to open at ``dest``: the
    folder itself, or the merged file in it. See the module docstring for the
    guarantees. ``verify`` re-hashes a copy found complete (and every file kept
    from an earlier run is re-hashed anyway). Raises :class:`StageError` or
    :class:`~dali_pipes.dataset.manifest.ManifestError` naming the file at fault.

    ``dataset`` may be a URL of object storage (``s3://bucket/ds``, ``gs://``, ``az://``, ``hf://``): the
    shards are downloaded by ranged reads, ``workers`` at a time, each retried on dropped connections and
    throttling and hash-checked as it arrives (:mod:`dali_pipes.staging.download`); ``storage_options``
    go to its fsspec backend (credentials, ``endpoint_url``) and are never written or shown.
    """
    dest = Path(dest)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    source, items, marker, target, origin, copy = plan_source(dataset, dest, storage_options)
    if dest.exists() and not dest.is_dir():
        raise StageError(f"{dest}: is a file; stage into a folder (it is made if missing)")
    dest.mkdir(parents=True, exist_ok=True)
    with _StageLock(dest):
        report = StageReport(path=target)
        _claim(dest, source, origin)
        marker_path, marker_bytes = marker
        if _complete(dest, items, marker_path, marker_bytes):
            report.reused = True
            if verify:
                _verify_all(dest, items, progress)
            log.info("stage: %s is already staged at %s; reusing it", source, dest)
            return report
        _remove_stale(dest, marker_path)
        todo = _keep_whole_files(dest, items, report, progress)
        _check_free_space(dest, todo)
        _copy_all(dest, todo, report, workers, progress, copy)
        if verify:
            _verify_all(dest, [item for item in items if item.rel in report.copied], progress)
        atomic_write_bytes(marker_path, marker_bytes)  # last: DEST is a dataset from now on
    log.info(
        "stage: %s -> %s: %d file(s) copied (%s), %d kept from an earlier run",
        source,
        dest,
        len(report.copied),
        human_bytes(report.bytes_copied),
        len(report.kept),
    )
    return report


# --- what to copy --------------------------------------------------------------------------------


class SourcePlan(NamedTuple):
    """What staging (or a streaming cache) copies of a dataset, and how."""

    source: Path | str  #: where the dataset is
    items: list[StageItem]  #: its files to copy
    marker: tuple[Path, bytes]  #: the completion marker: (path, bytes), written last
    target: Path  #: the path to open once copied
    origin: str  #: the dataset's name to record and show (any secret taken out)
    copy: "Copier"  #: copies one item, checked


def plan_source(dataset: str | os.PathLike, dest: Path, storage_options: Mapping[str, Any] | None) -> SourcePlan:
    """The :class:`SourcePlan` for staging ``dataset`` into ``dest``.

    A URL is planned by :func:`~dali_pipes.staging.download.plan_remote` (its files downloaded); a local dataset
    by :func:`_plan` (its files copied by :func:`copy_checked`), refused when ``dest`` is where it already is.
    """
    if is_url(dataset):
        from dali_pipes.staging.download import plan_remote

        items, marker, target, origin, copy = plan_remote(str(dataset), dest, storage_options)
        return SourcePlan(origin, items, marker, target, origin, copy)
    source = Path(dataset)
    items, marker, target = _plan(source, dest)
    origin = str(source.resolve())
    if dest.resolve() in {source.resolve(), source.resolve().parent}:
        raise StageError(f"{dest}: is where {source} already is; stage into another folder")
    return SourcePlan(source, items, marker, target, origin, copy_checked)


def _plan(source: Path, dest: Path) -> tuple[list[StageItem], tuple[Path, bytes], Path]:
    """The files to copy, the completion marker ``(path, bytes)`` and the path to open at ``dest``."""
    if source.suffix in (".h5", ".hdf5") and source.is_file():
        return _plan_merged(source, dest)
    manifest = load_manifest(source)
    items = []
    for shard in manifest.shards:
        items.append(StageItem(shard.path, resolve_inside(source, shard.path), shard.bytes, shard.sha256))
        if shard.index_path:
            index = resolve_inside(source, shard.index_path)
            items.append(StageItem(shard.index_path, index, _size(index), shard.index_sha256))
    errors = source / ERRORS_NAME
    if errors.is_file():
        items.append(StageItem(ERRORS_NAME, errors, _size(errors), None))
    marker = (dest / MANIFEST_NAME, (source / MANIFEST_NAME).read_bytes())
    return items, marker, dest


def _plan_merged(source: Path, dest: Path) -> tuple[list[StageItem], tuple[Path, bytes], Path]:
    """A merged file and (virtual merge) its source shards, at their paths relative to the merged file."""
    from dali_pipes.stores.hdf5 import merged_manifest, open_file

    merged_manifest(source)  # refuses a file that is not a merged dali-pipes file
    items: list[StageItem] = []
    with open_file(source) as f:
        sources = sorted(_virtual_source_files(f))
        by_name = _original_shards(source, f)
    for name in sources:
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise StageError(
                f"{source}: its virtual datasets read {name}, outside the merged file's folder, so the staged "
                "copy could not find it at the same relative path; stage the dataset folder instead, or merge "
                "into a file inside the dataset folder's parent"
            )
        path = source.parent / rel
        shard = by_name.get(rel.name)
        expected = shard.sha256 if shard is not None and shard.bytes == _size(path) else None
        items.append(StageItem(rel.as_posix(), path, _size(path), expected))
    items.append(StageItem(source.name, source, _size(source), None))
    # The merged file holds no hash of itself: the marker ties the copy to the source's size and time.
    record = {
        "source": str(source.resolve()),
        "files": {item.rel: [item.bytes, item.sha256 or os.stat(item.source).st_mtime_ns] for item in items},
    }
    marker = (dest / f".{source.name}.staged.json", (json.dumps(record, indent=1) + "\n").encode())
    return items, marker, dest / source.name


def _original_shards(source: Path, f) -> dict:
    """The dataset's own shards, by file name: a merged file's manifest attribute is its dataset's manifest."""
    from dali_pipes.dataset.manifest import parse_manifest
    from dali_pipes.stores.hdf5 import MANIFEST_ATTR

    manifest = parse_manifest(json.loads(f.attrs[MANIFEST_ATTR]), where=str(source))
    return {Path(s.path).name: s for s in manifest.shards}


def _virtual_source_files(f) -> set[str]:
    """The source file names of every virtual dataset in an open HDF5 file."""
    import h5py

    names: set[str] = set()

    def visit(_name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset) and obj.is_virtual:
            names.update(s.file_name for s in obj.virtual_sources() if s.file_name != ".")

    f.visititems(visit)
    return names


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise StageError(f"{path}: missing; the dataset is incomplete, so it cannot be staged") from None


# --- reuse ---------------------------------------------------------------------------------------


def _claim(dest: Path, source: Path | str, origin: str) -> None:
    """Record that ``dest`` holds a copy of ``source``; refuse a folder that holds another dataset's copy.

    Two datasets staged into one folder would overwrite each other's shards, and a
    loader still reading the first could then read the second's files.
    """
    record = dest / SOURCE_RECORD
    try:
        recorded = record.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        atomic_write_bytes(record, (origin + "\n").encode())
        return
    if recorded != origin:
        raise StageError(
            f"{dest}: already holds a staged copy of {recorded}, not of {source}; stage {source} into another "
            f"folder (or delete {dest} if the copy of {recorded} is no longer used)"
        )


def _complete(dest: Path, items: list[StageItem], marker_path: Path, marker_bytes: bytes) -> bool:
    """True when ``dest`` holds a finished copy of this very source (marker equal, every size right)."""
    try:
        if marker_path.read_bytes() != marker_bytes:
            return False
    except FileNotFoundError:
        return False
    for item in items:
        try:
            if os.stat(dest / item.rel).st_size != item.bytes:
                log.warning("stage: %s has the wrong size; staging again", dest / item.rel)
                return False
        except FileNotFoundError:
            log.warning("stage: %s is missing from the staged copy; staging again", dest / item.rel)
            return False
    return True


def _remove_stale(dest: Path, marker_path: Path) -> None:
    """Drop the marker of an older copy and temporary files a killed stager left behind."""
    marker_path.unlink(missing_ok=True)
    for tmp in dest.rglob(f"{TMP_PREFIX}*"):
        tmp.unlink(missing_ok=True)


def _keep_whole_files(dest: Path, items: list[StageItem], report: StageReport, progress: bool) -> list[StageItem]:
    """Keep files an earlier run put in place whose hash still matches; return the files left to copy."""
    todo = []
    present = {item.rel for item in items if item.sha256 and _size_is(dest / item.rel, item.bytes)}
    with tqdm(
        total=sum(i.bytes for i in items if i.rel in present),
        unit="B",
        unit_scale=True,
        desc="check staged",
        disable=bar_disabled(progress and bool(present)),
    ) as bar:
        for item in items:
            if item.rel in present and sha256_file(dest / item.rel) == item.sha256:
                report.kept.append(item.rel)
            else:
                todo.append(item)
            bar.update(item.bytes if item.rel in present else 0)
    return todo


def _size_is(path: Path, size: int) -> bool:
    try:
        return os.stat(path).st_size == size
    except FileNotFoundError:
        return False


def _check_free_space(dest: Path, todo: list[StageItem]) -> None:
    need = sum(item.bytes for item in todo)
    free = shutil.disk_usage(dest).free
    if need > free:
        raise StageError(
            f"{dest}: staging needs {human_bytes(need)} more but only {human_bytes(free)} is free there; "
            "free space, or stage to a larger disk (the dataset can also be read where it is)"
        )


# --- copying -------------------------------------------------------------------------------------


#: Copies one item to its target, calling ``advance`` with each count of bytes written.
Copier = Callable[[StageItem, Path, Callable[[int], None]], None]


def _copy_all(
    dest: Path, todo: list[StageItem], report: StageReport, workers: int, progress: bool, copy_one: Copier
) -> None:
    lock = threading.Lock()
    total = sum(item.bytes for item in todo)
    if todo:
        log.info("stage: copying %d file(s), %s, into %s", len(todo), human_bytes(total), dest)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"stage {dest}", disable=bar_disabled(progress)) as bar:

        def copy(item: StageItem) -> None:
            copy_one(item, dest / item.rel, lambda n: _locked(lock, bar.update, n))
            with lock:
                report.copied.append(item.rel)
                report.bytes_copied += item.bytes

        with ThreadPoolExecutor(max_workers=min(workers, max(1, len(todo)))) as pool:
            futures = [pool.submit(copy, item) for item in todo]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                # Start no other file; those under way finish (or fail) before the error is raised.
                pool.shutdown(wait=True, cancel_futures=True)
                raise


def _locked(lock: threading.Lock, call, *args) -> None:
    with lock:
        call(*args)


def copy_checked(item: StageItem, target: Path, advance: Callable[[int], None]) -> None:
    """Copy ``item`` to ``target`` through a temporary name, checking its size and hash before the rename."""

    def fill(out) -> tuple[int, str]:
        digest = hashlib.sha256()
        size = 0
        with open(item.source, "rb") as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
                advance(len(chunk))
        return size, digest.hexdigest()

    write_checked(item, target, fill, str(item.source))


def _verify_all(dest: Path, items: list[StageItem], progress: bool) -> None:
    """Re-hash the staged files (against the manifest, or against the source where it records no hash)."""
    with tqdm(
        total=sum(i.bytes for i in items),
        unit="B",
        unit_scale=True,
        desc="verify staged",
        disable=bar_disabled(progress),
    ) as bar:
        for item in items:
            expected = item.sha256 or (sha256_file(item.source) if isinstance(item.source, Path) else None)
            if expected is None:  # a remote file without a recorded hash (errors.jsonl): its size was checked
                bar.update(item.bytes)
                continue
            if sha256_file(dest / item.rel) != expected:
                raise StageError(
                    f"{dest / item.rel}: the staged copy does not match "
                    f"{'the manifest' if item.sha256 else item.source}; delete {dest} and stage again"
                )
            bar.update(item.bytes)


# --- one stager at a time ------------------------------------------------------------------------


class _StageLock:
    """An exclusive ``flock`` on ``DEST/.dali-pipes-stage.lock``, logged when another process holds it."""

    def __init__(self, dest: Path) -> None:
        self.path = dest / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> "_StageLock":
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("stage: another process is staging into %s; waiting for it", self.path.parent)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


__all__ = ["TMP_PREFIX", "StageError", "StageItem", "StageReport", "copy_checked", "stage_dataset", "write_checked"]
