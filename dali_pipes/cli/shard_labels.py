"""A dataset's label column and the bytes each shard takes in a stream cache, for a folder or a URL, with no copy.

``dali-pipes mixing`` needs every sample's label (to count the classes of a batch) and each shard's
bytes (to size the window a cache limit gives). A folder's labels are read in place. A URL's are read
shard by shard: the labels lie inside the shards (an LMDB B-tree, HDF5 chunks, TFRecord records),
where no ranged read finds them without the shard's own index, so each shard is downloaded (its
SHA-256 checked, as a stage checks it) into a temporary folder, its label field read, and the shard
deleted before the next: one shard on disk at a time, the whole dataset downloaded once.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from dali_pipes.dataset.manifest import Manifest
from dali_pipes.dataset.sizes import format_size
from dali_pipes.remote.urls import is_url, redact
from dali_pipes.stores import Store, open_store

log = logging.getLogger(__name__)


def check_label_field(manifest: Manifest, field: str, shown: str) -> None:
    """Refuse a ``field`` the dataset has not, or one that is not one integer a sample, naming ``--field``."""
    if field not in manifest.fields:
        raise ValueError(f"{shown}: no field {field!r} (fields: {', '.join(manifest.fields)}); name one with --field")
    spec = manifest.fields[field]
    integer = spec.dtype is not None and np.dtype(spec.dtype).kind in "iub"
    if spec.kind != "array" or spec.variable_length or tuple(spec.shape or ()) not in ((), (1,)) or not integer:
        raise ValueError(f"{shown}: field {field!r} is not one integer a sample ({spec.to_json()}); name the label "
                         "field with --field")  # fmt: skip


def labels_and_shard_bytes(
    dataset: str | os.PathLike,
    field: str,
    storage_options: Mapping[str, Any] | None = None,
    before_reading: Callable[[list[int]], object] | None = None,
) -> tuple[Manifest, np.ndarray, list[int]]:
    """``(manifest, labels, bytes)``: the dataset's manifest, every sample's ``field`` (one integer each) and the
    bytes each shard takes in a stream cache (the shard and its index file), for a folder or a URL.

    ``before_reading(bytes)`` is called before any label is read (a URL's shards downloaded): a check that can
    refuse from the sizes alone refuses before the downloads."""
    if is_url(dataset):
        return _remote(str(dataset), field, storage_options, before_reading)
    root = Path(dataset)
    store = open_store(root)
    try:
        check_label_field(store.manifest, field, str(root))
        sizes = [
            shard.bytes + ((root / shard.index_path).stat().st_size if shard.index_path else 0)
            for shard in store.manifest.shards
        ]
        if before_reading:
            before_reading(sizes)
        labels = store.column(field).reshape(len(store), -1)[:, 0]
    finally:
        store.close()
    return store.manifest, labels, sizes


def _remote(
    url: str, field: str, storage_options: Mapping[str, Any] | None, before_reading: Callable | None
) -> tuple[Manifest, np.ndarray, list[int]]:
    from dali_pipes.remote.dataset import load_remote_manifest
    from dali_pipes.remote.fs import LOOK
    from dali_pipes.staging.download import plan_remote

    shown = redact(url, storage_options)
    manifest = load_remote_manifest(url, storage_options, LOOK)[0]  # a wrong field refused before any download
    check_label_field(manifest, field, shown)
    with tempfile.TemporaryDirectory(prefix="dali-pipes-labels-") as tmp:
        items, _, _, _, copy = plan_remote(url, Path(tmp), storage_options)
        by_rel = {item.rel: item for item in items}
        files_of = [[by_rel[rel] for rel in (shard.path, shard.index_path) if rel] for shard in manifest.shards]
        sizes = [sum(item.bytes for item in files) for files in files_of]
        if before_reading:
            before_reading(sizes)
        log.info(
            "%s: the %s of each sample lies inside its shard: downloading %s (%s), one shard at a time, to read them",
            shown, field, format_size(sum(sizes), "GB"), f"{sum(sizes):,} bytes",
        )  # fmt: skip
        store = Store(tmp, manifest)  # its readers open a shard's files on its first read
        parts = []
        for number, (shard, reader) in enumerate(zip(manifest.shards, store.shard_readers)):
            files = files_of[number]
            log.info("%s: reading the %s of shard %d of %d", shown, field, number + 1, len(manifest.shards))
            try:
                for item in files:
                    copy(item, Path(tmp) / item.rel, lambda _: None)
                start = manifest.shard_offsets[number]
                parts.append(store.read_batch(np.arange(start, start + shard.num_samples), [field])[field])
            finally:
                reader.close()
                for item in files:
                    (Path(tmp) / item.rel).unlink(missing_ok=True)
    labels = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    return manifest, labels.reshape(len(labels), -1)[:, 0], sizes


__all__ = ["check_label_field", "labels_and_shard_bytes"]
