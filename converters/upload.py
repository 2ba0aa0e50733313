"""Conversion into object storage: shards written in a local work folder, uploaded whole, the manifest last.

:func:`convert_to_url` runs the usual parallel, resumable conversion (:func:`converters.runner.convert`)
into a local work folder, with one step added to each shard: once written and recorded, the worker
that wrote it uploads it (and its index) and deletes the local copy. The work folder so holds the
shards being written, a few at a time, never the dataset. Then ``errors.jsonl`` is uploaded, and
``index.json`` last: until it is there, no reader takes the URL for a dataset.

An object store shows an object only when its upload is complete (one PUT, or a multipart upload
completed at its end), so a killed upload leaves no half shard at its name. A killed run resumes:
a shard recorded as done whose local file is gone counts as done when the object at the URL has
its recorded size and SHA-256 (read back by ranges, never uploaded again); any other is written again.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from converters.base import ConversionError, Source
from converters.jobdir import ShardRecord
from dali_pipes.dataset.folder import JOB_DIR
from dali_pipes.dataset.manifest import ERRORS_NAME, MANIFEST_NAME, Manifest
from dali_pipes.remote.fs import filesystem, remote_errors
from dali_pipes.remote.transfer import hash_remote, remote_size, upload_file
from dali_pipes.remote.urls import join, redact

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Uploader:
    """Where shards go (``url``, with the backend's ``storage_options``); pickled to the worker processes."""

    url: str
    # Not in the repr: a task's arguments are shown in some engines' logs (Dask's "Compute Failed" lines).
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)

    def _fs(self):
        return filesystem(self.url, self.storage_options)

    def shown(self, rel: str = "") -> str:
        """The URL (or that of ``rel`` below it) as it may be shown: secrets taken out."""
        return redact(join(self.url, rel) if rel else self.url, self.storage_options)

    def upload(self, out: Path, rel: str, size: int | None = None) -> None:
        """Upload ``out/rel`` to ``url/rel`` and check the object's size."""
        fs, root = self._fs()
        url = join(self.url, rel)
        upload_file(str(out / rel), fs, join(root, rel), url, self.storage_options)
        expected = os.stat(out / rel).st_size if size is None else size
        got = remote_size(fs, join(root, rel), url, self.storage_options)
        if got != expected:
            raise ConversionError(f"{self.shown(rel)}: uploaded {expected} bytes but the object holds {got}; run again")

    def publish(self, out: Path, record: ShardRecord) -> None:
        """Upload a finished shard (index first, then the shard), then delete the local copies."""
        if record.index_path and (out / record.index_path).exists():
            self.upload(out, record.index_path)
        if (out / record.path).exists():
            self.upload(out, record.path, record.bytes)
        for rel in (record.path, record.index_path):
            if rel:
                (out / rel).unlink(missing_ok=True)

    def holds(self, record: ShardRecord) -> bool:
        """True when the shard (and its index) at ``url`` have the recorded sizes and SHA-256."""
        fs, root = self._fs()
        for rel, sha256 in ((record.path, record.sha256), (record.index_path, record.index_sha256)):
            if rel is None:
                continue
            try:
                size, digest = hash_remote(
                    fs, join(root, rel), join(self.url, rel), storage_options=self.storage_options
                )
            except ValueError:  # RemoteError: not there (or unreadable): the shard is written again
                return False
            if (rel == record.path and size != record.bytes) or (sha256 and digest != sha256):
                log.info("%s: does not match this job's record; writing it again", self.shown(rel))
                return False
        return True

    def after(self, write: Callable[..., ShardRecord]) -> "_WriteThenUpload":
        """``write`` (the runner's ``write_shard``) followed by :meth:`publish`, as one picklable task function."""
        return _WriteThenUpload(write, self)


@dataclass(frozen=True)
class _WriteThenUpload:
    """``write_shard`` followed by the upload, in the worker that wrote the shard (picklable for the engines)."""

    write: Callable[..., ShardRecord]
    uploader: Uploader

    def __call__(self, source, fmt, plan, items, out, on_error, *args, **kwargs) -> ShardRecord:
        record = self.write(source, fmt, plan, items, out, on_error, *args, **kwargs)
        self.uploader.publish(Path(out), record)
        return record


def convert_to_url(
    source: Source,
    url: str,
    *,
    work_dir: str | os.PathLike | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
):
    """Convert ``source`` into a dataset at ``url`` (``s3://bucket/ds``, ...); see the module docstring.

    The destination is checked before anything else (:func:`~dali_pipes.remote.destination.check_destination`):
    credentials found, the server reached, the bucket there, writing allowed; else :class:`RemoteError`, with
    nothing read, converted or left behind.

    ``work_dir`` is the local folder shards are written in before their upload (default: a folder
    for this URL under ``$DALI_PIPES_CACHE`` or ``~/.cache/dali-pipes``); it keeps only the job's
    records and the small ``index.json`` and ``errors.jsonl`` once done, so a re-run finds the job
    complete. ``options`` go to :func:`converters.runner.convert`. Returns its ``ConvertResult``.
    """
    from converters.runner import convert
    from dali_pipes.remote.destination import check_destination
    from dali_pipes.staging.download import default_cache_dir

    uploader = Uploader(url.rstrip("/"), storage_options)
    # First, within seconds: a bucket that is not there or may not be written to would otherwise show only at the
    # first upload, after that shard's work, with a work folder left in the cache.
    check_destination(uploader.url, storage_options)
    out = (
        Path(work_dir)
        if work_dir is not None
        else default_cache_dir(url).with_name("convert-" + default_cache_dir(url).name)
    )
    fs, root = filesystem(uploader.url, storage_options)
    with remote_errors(join(url, MANIFEST_NAME), storage_options):
        taken = not (out / MANIFEST_NAME).exists() and fs.exists(join(root, MANIFEST_NAME))
    if taken:  # a dataset this work folder did not write: its shards would be overwritten one by one
        raise ConversionError(
            f"{uploader.shown()}: already holds a dataset (its index.json) that this conversion did not write; "
            "convert into another URL, or delete that dataset first"
        )
    log.info("%s: writing shards in %s, each uploaded when whole", uploader.shown(), out)
    try:
        result = convert(source, out, uploader=uploader, **options)
    except ConversionError:
        if not (out / JOB_DIR).exists():  # refused or failed for good: the job discarded its local work
            _remove_uploaded_shards(fs, root, uploader, storage_options)
        raise
    _check_shards_uploaded(fs, root, uploader, out, result.manifest, storage_options)
    if (out / ERRORS_NAME).exists():
        uploader.upload(out, ERRORS_NAME)
    uploader.upload(out, MANIFEST_NAME)  # last: the URL is a dataset from now on
    log.info("%s: %d shard(s) and the manifest uploaded", uploader.shown(), len(result.manifest.shards))
    return result


def _check_shards_uploaded(
    fs: Any, root: str, uploader: Uploader, out: Path, manifest: Manifest, storage_options: Mapping[str, Any] | None
) -> None:
    """Make sure each shard of the finished job is at the URL before the manifest vouches for it: upload one still
    in ``out``, and refuse one there whose size is not the recorded one."""
    for shard in manifest.shards:
        if (out / shard.path).exists():  # a run killed between a shard's record and its upload left it here
            uploader.publish(
                out, ShardRecord(shard.path, shard.num_samples, shard.bytes, shard.sha256, shard.index_path)
            )
        elif remote_size(fs, join(root, shard.path), join(uploader.url, shard.path), storage_options) != shard.bytes:
            raise ConversionError(
                f"{uploader.shown(shard.path)}: not the shard this conversion uploaded (its size differs); delete "
                f"the work folder {out} and convert again"
            )


def _remove_uploaded_shards(fs: Any, root: str, uploader: Uploader, storage_options: Mapping[str, Any] | None) -> None:
    """Delete the shards a discarded job uploaded: with no work folder left, nothing could resume or remove them,
    and the URL holds no manifest of another dataset (checked before the job started), so they are this job's."""
    with remote_errors(uploader.url, storage_options):
        leftovers = fs.glob(join(root, "shard-*"))
        for path in leftovers:
            fs.rm_file(path)
    if leftovers:
        log.info(
            "%s: removed the %d shard file(s) this refused conversion had uploaded", uploader.shown(), len(leftovers)
        )


__all__ = ["Uploader", "convert_to_url"]
