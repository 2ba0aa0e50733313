"""A dataset at a URL: its manifest read over the network and checked as a local one is.

Shard paths must stay inside the dataset (relative, no ``..``), as :func:`~dali_pipes.dataset.manifest.load_manifest`
requires of a folder; the manifest's bytes are returned too, so that a staged copy can hold them unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import PurePosixPath
from typing import Any, Mapping

from dali_pipes.dataset.manifest import ERRORS_NAME, MANIFEST_NAME, Manifest, ManifestError, parse_manifest
from dali_pipes.dataset.manifest import load_manifest as load_local_manifest
from dali_pipes.remote.fs import JOB, Patience, RemoteError, filesystem, remote_errors
from dali_pipes.remote.transfer import retrying
from dali_pipes.remote.urls import is_url, join, redact


def load_manifest(
    dataset: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None, check_paths: bool = True
) -> Manifest:
    """The manifest of a dataset folder, or of a dataset at a URL (``s3://bucket/ds``, ``gs://``, ``az://``, ``hf://``).

    What ``dali_pipes.load_manifest`` is: a URL is read with ``storage_options``
    (:func:`load_remote_manifest`), a folder by
    :func:`dali_pipes.dataset.manifest.load_manifest` (``check_paths`` as there).
    """
    if is_url(dataset):
        return load_remote_manifest(str(dataset), storage_options)[0]
    return load_local_manifest(dataset, check_paths=check_paths)


def load_remote_manifest(
    url: str, storage_options: Mapping[str, Any] | None = None, patience: Patience = JOB
) -> tuple[Manifest, bytes]:
    """``(manifest, its bytes)`` of the dataset at ``url``; :class:`RemoteError` or :class:`ManifestError` naming it.

    ``patience``: :data:`~dali_pipes.remote.fs.LOOK` for a read-only look that should fail within seconds."""
    fs, root = filesystem(url, storage_options, patience)
    manifest_url = join(url, MANIFEST_NAME)
    shown = redact(manifest_url, storage_options)

    def read() -> bytes:
        try:
            return fs.cat_file(join(root, MANIFEST_NAME))
        except FileNotFoundError:
            _refuse_a_wrong_path(fs, url, root, storage_options)
            raise  # no bucket, or none that can be looked at: said as any missing object is

    data = retrying(read, manifest_url, "reading", storage_options, patience)
    try:
        manifest = parse_manifest(json.loads(data), where=shown)
    except ManifestError:
        raise
    except ValueError as exc:  # not JSON
        raise ManifestError(
            f"{shown}: not valid JSON ({exc}); the manifest is damaged, convert the dataset again"
        ) from None
    for shard in manifest.shards:
        for rel in (shard.path, shard.index_path):
            if rel is not None and (PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts):
                raise ManifestError(f"{shown}: shard path {rel!r} leaves the dataset; shard paths must stay inside it")
    return manifest, data


def _refuse_a_wrong_path(fs: Any, url: str, root: str, storage_options: Mapping[str, Any] | None) -> None:
    """No index.json at ``url``: raise :class:`RemoteError` saying so when its bucket exists (the path is wrong, not
    the bucket, which a missing bucket's message would say); return when it does not or cannot be looked at."""
    bucket = root.split("/", 1)[0]
    if bucket == root.rstrip("/"):  # the URL is a bucket's root: nothing to tell apart
        return
    try:
        exists = fs.exists(bucket)
    except Exception:  # noqa: BLE001 - a bucket that cannot be looked at (denied, unreachable): the plain message
        return
    if exists:
        raise RemoteError(
            f"no {MANIFEST_NAME} under {redact(url, storage_options)} (the bucket {redact(bucket, storage_options)} "
            "exists): check the path, and that the dataset was uploaded whole (its index.json is written last)"
        )


def read_errors(url: str, storage_options: Mapping[str, Any] | None = None, patience: Patience = JOB) -> list[str]:
    """The lines of the dataset's ``errors.jsonl`` at ``url`` (none when it has none)."""
    fs, root = filesystem(url, storage_options, patience)
    path = join(root, ERRORS_NAME)
    with remote_errors(join(url, ERRORS_NAME), storage_options, patience):
        if not fs.exists(path):
            return []
    data = retrying(lambda: fs.cat_file(path), join(url, ERRORS_NAME), "reading", storage_options, patience)
    return data.decode("utf-8", errors="replace").splitlines()


__all__ = ["load_remote_manifest", "read_errors"]
