"""Merge the shards of an HDF5 dataset into one HDF5 file, sample order kept.

Two kinds of output, both with the layout of one shard (see
:mod:`dali_pipes.stores.hdf5`), so the same reader, ``open_store`` and plain
h5py read them:

- **physical** (default): every dataset copied into the new file, in blocks,
  with a progress bar. The file stands alone.
- **virtual** (``virtual=True``): each big dataset (fixed arrays and the
  ``data`` of ragged fields) is an HDF5 virtual dataset that maps the shards'
  datasets end to end; nothing big is copied. The ``offsets`` of ragged fields
  are physical, rebased onto the concatenated data. Source files are recorded
  by paths *relative to the merged file's folder*, which is where HDF5 (1.10+)
  looks for a relative source; so the dataset folder can be moved or copied as
  a whole. The shards must stay where the paths say: a reader opening the file
  checks that every source opens (HDF5 itself would silently read zeros).

Layout of the merged file, for a user of plain h5py::

    /                        attrs: layout, layout_version, num_samples, fields (JSON),
                                    manifest (the dataset's index.json, as JSON), virtual (bool)
    /<fixed array field>     (N, *shape)
    /<ragged field>/data     all samples' values back to back (uint8 for bytes fields)
    /<ragged field>/offsets  int64 (N + 1,): sample i is data[offsets[i]:offsets[i + 1]]

The output is written under a temporary name in its folder, fsynced, and renamed when
complete. HDF5 writes it through :class:`~converters.writers._h5file.GuardedFile`, as
the shard writer does, so a full disk (or a file-size limit) ends the merge with one
line naming the output and the free space, and leaves neither the output nor the
temporary file, instead of crashing the process inside HDF5.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from converters.base import ConversionError
from converters.ctrl_c import CtrlC, held
from converters.diskfull import disk_full_errno, disk_full_why, free_space, is_disk_full
from converters.writers._h5file import GuardedFile
from dali_pipes.dataset.fileio import fsync_dir
from dali_pipes.dataset.manifest import Field, Manifest, load_manifest, resolve_inside
from dali_pipes.dataset.progress import bar_disabled, tqdm
from dali_pipes.stores import hdf5_layout
from dali_pipes.stores.checksum import RECORD_CRC32C
from dali_pipes.stores.hdf5 import open_file

log = logging.getLogger(__name__)

#: Bytes copied per block in a physical merge.
COPY_BYTES = 64 << 20


@dataclass(frozen=True)
class _ShardInfo:
    """What the merge needs to know of one shard: its file, rows per dataset and ragged offsets."""

    path: Path
    num_samples: int
    rows: dict[str, int]
    offsets: dict[str, np.ndarray]


def merge_hdf5(dataset_dir: str | os.PathLike, out_h5: str | os.PathLike, *, virtual: bool = False) -> Path:
    """Merge an HDF5 dataset's shards into ``out_h5`` (physical copy, or virtual datasets); return its path.

    Raises :class:`~converters.base.ConversionError` for a dataset of another
    format, an output that exists, or a shard that does not match the manifest.
    """
    dataset_dir = Path(dataset_dir)
    out = Path(out_h5)
    manifest = load_manifest(dataset_dir)
    if manifest.format != "hdf5":
        raise ConversionError(
            f"{dataset_dir}: is a {manifest.format} dataset; only HDF5 datasets can be merged "
            "(convert with --format hdf5)"
        )
    if out.exists():
        raise ConversionError(f"{out}: already exists; remove it or choose another name")
    if not out.parent.is_dir():
        raise ConversionError(f"{out.parent}: no such folder for the merged file")
    shards = [_shard_info(resolve_inside(dataset_dir, s.path), s.num_samples, manifest) for s in manifest.shards]

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        _write_merged(tmp, manifest, shards, out, virtual)
        os.replace(tmp, out)
    except BaseException as exc:
        if is_disk_full(exc):
            kind = "virtual merge" if virtual else "merge"
            todo = "Raise the limit" if disk_full_errno(exc) == errno.EFBIG else "Free space"
            if not virtual:
                todo += " (or merge with --virtual, which copies no data)"
            raise ConversionError(
                f"{out}: disk full while writing the {kind} of {dataset_dir} ({disk_full_why(exc)}; "
                f"{free_space(out.parent)}); nothing of it was kept. {todo} and run the same command again"
            ) from exc
        raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(out.parent)
    log.info("merged %d shards of %s into %s (%s)", len(shards), dataset_dir, out, "virtual" if virtual else "physical")
    return out


def _write_merged(tmp: Path, manifest: Manifest, shards: list[_ShardInfo], out: Path, virtual: bool) -> None:
    """Write the whole merged file at ``tmp``, fsynced; raise the ``OSError`` of a write that failed.

    HDF5 writes through a :class:`~converters.writers._h5file.GuardedFile`, not a
    path, as the shard writer does: given a path, HDF5 that meets a full disk is left
    unable to close the file and often crashes the process (a segmentation fault).
    The guarded file hides a failed write from HDF5, so the file always closes; the
    failure is raised here instead, and the caller removes the useless file.
    """
    guarded = GuardedFile(tmp)
    # Ctrl-C is held while HDF5 may call the guarded file (see converters.ctrl_c), and raised between blocks.
    with held() as ctrl_c:
        try:
            with h5py.File(guarded, "w", libver=hdf5_layout.LIBVER) as f:
                if virtual:
                    _write_virtual(f, manifest, shards, out.parent.resolve())
                else:
                    _write_physical(f, manifest, shards, out.name, guarded, ctrl_c)
                if RECORD_CRC32C in manifest.checksums:
                    # Small (4 bytes per field per sample): always physical, the shards' tables end to end.
                    tables = [_crc_table(shard.path) for shard in shards]
                    f.create_dataset(
                        hdf5_layout.CRC_DATASET,
                        data=np.concatenate(tables),
                        dtype=hdf5_layout.CRC_DTYPE,
                        track_times=False,
                    )
                for key, value in hdf5_layout.layout_attrs(manifest.fields, manifest.num_samples).items():
                    f.attrs[key] = value
                f.attrs[hdf5_layout.MANIFEST_ATTR] = json.dumps(manifest.to_json(), sort_keys=True)
                f.attrs["virtual"] = virtual
            guarded.check()  # the metadata went out when the file closed
            guarded.fsync()  # h5py's close flushes HDF5's buffers but does not fsync
        except Exception:
            # After a hidden failed write HDF5 may trip over the missing bytes in its own way:
            # the failed write is the cause to report.
            guarded.check()
            raise
        finally:
            guarded.close()


def _crc_table(path: Path) -> np.ndarray:
    """A shard's record CRCs (see :mod:`dali_pipes.stores.checksum`)."""
    with open_file(path) as f:
        if hdf5_layout.CRC_DATASET not in f:
            raise ConversionError(
                f"{path}: has no record CRCs ({hdf5_layout.CRC_DATASET!r}), though the manifest says it has"
            )
        return np.asarray(f[hdf5_layout.CRC_DATASET][()], dtype=hdf5_layout.CRC_DTYPE)


def _shard_info(path: Path, num_samples: int, manifest: Manifest) -> _ShardInfo:
    rows: dict[str, int] = {}
    offsets: dict[str, np.ndarray] = {}
    with open_file(path) as f:
        if f.attrs.get("num_samples") != num_samples:
            raise ConversionError(
                f"{path}: holds {f.attrs.get('num_samples')} samples, the manifest says {num_samples}"
            )
        for name, field in manifest.fields.items():
            key = hdf5_layout.data_path(name, field)
            if key not in f:
                raise ConversionError(f"{path}: field {name!r} has no dataset {key!r}")
            rows[name] = f[key].shape[0]
            if hdf5_layout.is_ragged(field):
                offsets[name] = np.asarray(f[hdf5_layout.offsets_path(name)][()], dtype=np.int64)
    return _ShardInfo(path=path, num_samples=num_samples, rows=rows, offsets=offsets)


def _merged_offsets(name: str, shards: list[_ShardInfo]) -> np.ndarray:
    """The shards' offsets of a ragged field, each rebased onto the rows before it."""
    parts, base = [], 0
    for shard in shards:
        parts.append(shard.offsets[name][:-1] + base)
        base += shard.rows[name]
    parts.append(np.array([base], dtype=np.int64))
    return np.concatenate(parts)


def _create_target(f: h5py.File, name: str, field: Field, total_rows: int) -> h5py.Dataset:
    rest = hdf5_layout.row_shape(field)
    if hdf5_layout.is_ragged(field):
        return f.create_dataset(
            hdf5_layout.data_path(name, field),
            shape=(total_rows, *rest),
            dtype=hdf5_layout.data_dtype(field),
            track_times=False,
        )
    return f.create_dataset(
        name,
        shape=(total_rows, *rest),
        chunks=(min(hdf5_layout.chunk_rows(field), max(total_rows, 1)), *rest),
        dtype=hdf5_layout.data_dtype(field),
        track_times=False,
    )


def _write_physical(
    f: h5py.File, manifest: Manifest, shards: list[_ShardInfo], label: str, guarded: GuardedFile, ctrl_c: CtrlC
) -> None:
    row_bytes = {
        n: hdf5_layout.data_dtype(fl).itemsize * math.prod(hdf5_layout.row_shape(fl))
        for n, fl in manifest.fields.items()
    }
    total_bytes = sum(s.rows[n] * row_bytes[n] for s in shards for n in manifest.fields)
    targets = {
        name: _create_target(f, name, field, sum(s.rows[name] for s in shards))
        for name, field in manifest.fields.items()
    }
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"merge {label}", disable=bar_disabled(True)) as bar:
        base = dict.fromkeys(manifest.fields, 0)
        for shard in shards:
            with open_file(shard.path) as src:
                for name, field in manifest.fields.items():
                    source = src[hdf5_layout.data_path(name, field)]
                    # Blocks of about COPY_BYTES, in whole chunks of fixed arrays (a chunk is read whole anyway).
                    step = max(1, COPY_BYTES // max(row_bytes[name], 1))
                    if not hdf5_layout.is_ragged(field):
                        rows = hdf5_layout.chunk_rows(field)
                        step = max(rows, step // rows * rows)
                    for start in range(0, shard.rows[name], step):
                        stop = min(start + step, shard.rows[name])
                        targets[name][base[name] + start : base[name] + stop] = source[start:stop]
                        guarded.check()  # stop copying into a file that is missing bytes
                        ctrl_c.deliver()  # a Ctrl-C, here between HDF5 calls
                        bar.update((stop - start) * row_bytes[name])
                    base[name] += shard.rows[name]
    for name, field in manifest.fields.items():
        if hdf5_layout.is_ragged(field):
            f.create_dataset(hdf5_layout.offsets_path(name), data=_merged_offsets(name, shards), track_times=False)


def _write_virtual(f: h5py.File, manifest: Manifest, shards: list[_ShardInfo], out_dir: Path) -> None:
    for name, field in manifest.fields.items():
        rest = hdf5_layout.row_shape(field)
        key = hdf5_layout.data_path(name, field)
        total = sum(s.rows[name] for s in shards)
        layout = h5py.VirtualLayout(shape=(total, *rest), dtype=hdf5_layout.data_dtype(field))
        base = 0
        for shard in shards:
            n = shard.rows[name]
            if n:  # an empty selection cannot be mapped
                rel = os.path.relpath(shard.path, out_dir)
                layout[base : base + n] = h5py.VirtualSource(
                    rel, key, shape=(n, *rest), dtype=hdf5_layout.data_dtype(field)
                )
            base += n
        f.create_virtual_dataset(key, layout)
        if hdf5_layout.is_ragged(field):
            f.create_dataset(hdf5_layout.offsets_path(name), data=_merged_offsets(name, shards), track_times=False)
