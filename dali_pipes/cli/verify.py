"""``dali-pipes verify``: check a dataset's shards against its manifest.

Every shard must exist, have the recorded size and SHA-256 (and so must its
sidecar index), and every record must read back and match its checksum (TFRecord's
CRC per record; the CRC32C per field of each sample of LMDB and HDF5 shards whose
manifest lists them); with ``decode=True`` every image is decoded as well.
Problems are collected rather than raised at the first one, so one run names every
damaged shard and, in a shard of the right size, every record that fails its checksum.
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from PIL import Image

from dali_pipes.dataset.fileio import sha256_file
from dali_pipes.dataset.manifest import ManifestError, load_manifest, resolve_inside
from dali_pipes.dataset.progress import bar_disabled, tqdm
from dali_pipes.remote.urls import is_url, redact
from dali_pipes.stores import Store, StoreError
from dali_pipes.stores.checksum import RecordChecksumError

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_dataset`: what was checked and every problem found."""

    dataset: Path | str
    num_shards: int
    num_samples: int
    samples_read: int = 0
    images_decoded: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_dataset(
    path: str | os.PathLike,
    *,
    decode: bool = False,
    progress: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Check sizes, hashes and records of every shard; with ``decode``, decode every image too.

    Raises :class:`~dali_pipes.dataset.manifest.ManifestError` when the manifest itself is
    unusable; problems with shards are returned in the report. A URL of object storage is
    checked remotely (:func:`verify_remote`).
    """
    if is_url(path):
        if decode:
            raise ValueError(
                f"{redact(path, storage_options)}: --decode reads every record, which is done on a local copy: "
                "run 'dali-pipes stage URL DEST' and then 'dali-pipes verify --decode DEST'"
            )
        return verify_remote(str(path), progress=progress, storage_options=storage_options)
    root = Path(path)
    manifest = load_manifest(root)
    report = VerifyReport(root, len(manifest.shards), manifest.num_samples)
    image_fields = [name for name, f in manifest.fields.items() if f.is_image]
    store = Store(root, manifest)
    bar = tqdm(total=manifest.num_samples, unit="sample", desc="verify", disable=bar_disabled(progress))
    try:
        for (start, shard), reader in zip(manifest.iter_shards(), store.shard_readers):
            problem, readable = _check_files(root, shard)
            if problem:
                report.problems.append(f"shard {shard.path}: {problem}")
            if not readable:
                bar.update(shard.num_samples)
                continue
            for local in range(shard.num_samples):
                try:
                    sample = reader.read(local)
                except RecordChecksumError as exc:  # this record only: the others are worth reading
                    report.problems.append(f"shard {shard.path}: sample {start + local}: {exc}")
                    bar.update(1)
                    continue
                except StoreError as exc:
                    report.problems.append(f"shard {shard.path}: sample {start + local} cannot be read: {exc}")
                    bar.update(shard.num_samples - local)
                    break
                report.samples_read += 1
                if decode:
                    for name in image_fields:
                        error = _decode_error(sample[name])
                        if error:
                            report.problems.append(
                                f"shard {shard.path}: sample {start + local} field {name!r} does not decode: {error}"
                            )
                        else:
                            report.images_decoded += 1
                bar.update(1)
            reader.close()
    finally:
        bar.close()
    return report


def _check_files(root: Path, shard) -> tuple[str | None, bool]:
    """Why a shard's files do not match the manifest (``None`` when they do), and whether to read its records.

    A shard of the right size whose hash differs is read record by record, so
    that the record checksums name the damaged records.
    """
    try:
        shard_path = resolve_inside(root, shard.path)
    except ManifestError as exc:
        return str(exc), False
    if not shard_path.exists():
        return "missing", False
    size = shard_path.stat().st_size
    if size != shard.bytes:
        return f"size is {size} bytes, the manifest says {shard.bytes} (truncated or replaced)", False
    if shard.index_path:
        index_path = resolve_inside(root, shard.index_path)
        if not index_path.exists():
            return f"its index {shard.index_path} is missing", False
        if shard.index_sha256 and sha256_file(index_path) != shard.index_sha256:
            return f"its index {shard.index_path} does not match the manifest's SHA-256", False
    if sha256_file(shard_path) != shard.sha256:
        return "SHA-256 does not match the manifest (the file was altered or damaged)", True
    return None, True


def verify_remote(url: str, *, progress: bool = True, storage_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Check each shard (and index) at ``url``: present, of the recorded size, of the recorded SHA-256.

    The bytes are read by ranges and hashed as they arrive; nothing is written locally. Records are
    not read one by one (a shard whose SHA-256 matches holds the records it was written with); a
    staged copy checks them again as it is read.
    """
    from dali_pipes.remote.dataset import load_remote_manifest
    from dali_pipes.remote.fs import RemoteError, filesystem
    from dali_pipes.remote.transfer import hash_remote
    from dali_pipes.remote.urls import join

    manifest, _ = load_remote_manifest(url, storage_options)
    fs, root = filesystem(url, storage_options)
    report = VerifyReport(url, len(manifest.shards), manifest.num_samples)
    files = [(s.path, s.bytes, s.sha256) for s in manifest.shards]
    files += [(s.index_path, None, s.index_sha256) for s in manifest.shards if s.index_path]
    total = sum(s.bytes for s in manifest.shards)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=bar_disabled(progress)) as bar:
        for rel, size, sha256 in files:
            try:
                got_size, got_hash = hash_remote(fs, join(root, rel), join(url, rel), bar.update, storage_options)
            except RemoteError as exc:
                report.problems.append(f"{rel}: {exc}")
                continue
            if size is not None and got_size != size:
                report.problems.append(f"shard {rel}: size is {got_size} bytes, the manifest says {size}")
            elif sha256 and got_hash != sha256:
                report.problems.append(
                    f"{rel}: SHA-256 does not match the manifest (the object was altered or damaged)"
                )
    return report


def _decode_error(data: bytes) -> str | None:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except Exception as exc:  # noqa: BLE001 - PIL raises many kinds; each is a decode failure
        return f"{type(exc).__name__}: {exc}"
    return None
