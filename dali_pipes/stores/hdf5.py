"""HDF5 shard reader, and the reading of merged files. The layout is :mod:`dali_pipes.stores.hdf5_layout`.

A reader opens and checks a field's datasets, and reads a ragged field's
offsets, when that field is first read: a reader asked for some fields never
touches the others (see :meth:`Hdf5ShardReader.read`).

A merged file (:mod:`converters.merge`) also carries ``attrs["manifest"]``,
the dataset's manifest JSON, which :func:`merged_manifest` turns into a
one-shard :class:`~dali_pipes.dataset.manifest.Manifest` so that ``open_store`` reads it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import h5py
import numpy as np

from dali_pipes.dataset.manifest import Field, Manifest, ManifestError, Shard, parse_manifest
from dali_pipes.stores._h5map import MappedRows, map_rows
from dali_pipes.stores.base import BatchDict, SampleDict, ShardReader, StoreError, as_arrays, packed
from dali_pipes.stores.checksum import CRC_DATASET, CRC_DTYPE, check_record, check_rows
from dali_pipes.stores.hdf5_layout import (
    LAYOUT,
    MANIFEST_ATTR,
    data_path,
    is_ragged,
    offsets_path,
    row_shape,
)

#: A batch read of a fixed field reads the whole span of its rows as one hyperslab when the
#: span holds at most this many bytes per row asked for, else only those rows (a point selection):
#: a point selection costs far more per row than a hyperslab per byte, and random rows of small
#: fields touch most chunks of the span anyway (the bench README has the figures).
SPAN_BYTES_PER_ROW = 16 << 10


def open_file(path: str | os.PathLike) -> h5py.File:
    """Open an HDF5 shard read-only; :class:`StoreError` if it is missing or unreadable.

    HDF5's default file locking is kept: HDF5 refuses to open one file twice in a
    process with different locking flags, and a user's plain ``h5py.File`` uses the
    default. Where the filesystem has no locks, ``HDF5_USE_FILE_LOCKING=FALSE`` applies to both.
    """
    if not os.path.isfile(path):
        raise StoreError(f"{path}: HDF5 shard file is missing")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise StoreError(f"{path}: cannot open HDF5 shard ({exc})") from exc


def check_virtual_sources(file: h5py.File, path: Path) -> None:
    """Refuse a file of virtual datasets whose source files are missing or unreadable.

    HDF5 reads the fill value (zeros) in place of a source it cannot open, so a
    moved or damaged shard would otherwise come back as silent garbage.
    """
    seen: set[str] = set()
    for obj in _datasets(file):
        if not obj.is_virtual:
            continue
        for source in obj.virtual_sources():
            if source.file_name in seen or source.file_name == ".":
                continue
            seen.add(source.file_name)
            # HDF5 resolves a relative source path against the virtual file's folder.
            src = Path(source.file_name)
            src = src if src.is_absolute() else path.parent / src
            with open_file(src) as f:
                if source.dset_name not in f:
                    raise StoreError(f"{path}: source {src} of virtual dataset {obj.name} has no {source.dset_name}")


def _datasets(group: h5py.Group):
    for name in group:
        try:
            item = group[name]
        except KeyError:
            # An object HDF5 cannot open (a damaged header) is never read as zeros:
            # reading its field fails, naming it. The other fields stay readable.
            continue
        if isinstance(item, h5py.Group):
            yield from _datasets(item)
        else:
            yield item


def merged_manifest(path: str | os.PathLike) -> Manifest:
    """The one-shard manifest of a merged HDF5 file, from its ``manifest`` attribute.

    The shard's ``sha256`` is empty: a file cannot hold its own hash.
    Raises :class:`~dali_pipes.dataset.manifest.ManifestError` for a file without the attribute.
    """
    path = Path(path)
    with open_file(path) as f:
        text = f.attrs.get(MANIFEST_ATTR)
        count = f.attrs.get("num_samples")
    if text is None:
        raise ManifestError(
            f"{path}: not a merged dali-pipes HDF5 file (no '{MANIFEST_ATTR}' attribute); "
            "open the dataset folder instead, or write one with 'dali-pipes merge'"
        )
    try:
        manifest = parse_manifest(json.loads(text), where=str(path))
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: the '{MANIFEST_ATTR}' attribute is not valid JSON ({exc})") from exc
    if count != manifest.num_samples:
        raise ManifestError(f"{path}: holds {count} samples, its manifest says {manifest.num_samples}")
    shard = Shard(path=path.name, num_samples=manifest.num_samples, bytes=path.stat().st_size, sha256="")
    return replace(manifest, shards=(shard,))


class Hdf5ShardReader(ShardReader):
    """Random access to one HDF5 shard or merged file (see the module docstring for the layout)."""

    format = "hdf5"
    cheap_batch_reads = True  # ragged bytes from the mapped file (see read_batch)

    def _open(self) -> None:
        f = open_file(self.path)
        try:
            self._check_file(f)
        except StoreError:
            f.close()
            raise
        except (OSError, KeyError, ValueError, TypeError) as exc:
            f.close()
            raise StoreError(f"{self.path}: damaged HDF5 shard ({exc})") from exc
        # One small read for the whole shard (4 bytes per field per sample), checked on every record read.
        self._h_crcs = self._read_crcs(f) if self.record_crc else None
        self._h_file = f
        # Filled field by field on first use (see _dataset): a read of some fields
        # never opens, checks or loads the offsets of the others.
        self._h_data: dict[str, h5py.Dataset] = {}
        self._h_offsets: dict[str, np.ndarray] = {}
        self._h_maps: dict[str, MappedRows | None] = {}  # batch reads of fixed fields (see _h5map)

    def _check_file(self, f: h5py.File) -> None:
        """The whole-file checks: the layout, the sample count and every virtual source."""
        if f.attrs.get("layout") != LAYOUT:
            raise StoreError(f"{self.path}: not a dali-pipes HDF5 shard (layout attribute {f.attrs.get('layout')!r})")
        count = f.attrs.get("num_samples")
        if count != self.num_samples:
            raise StoreError(f"{self.path}: HDF5 shard holds {count} samples, the manifest says {self.num_samples}")
        # All datasets, not only those read: a missing source reads as zeros, never as an error.
        check_virtual_sources(f, self.path)

    def _read_crcs(self, f: h5py.File) -> np.ndarray:
        """The stored CRC table, checked against the sample and field counts."""
        expected = (self.num_samples, len(self.fields))
        ds = f.get(CRC_DATASET)
        if not isinstance(ds, h5py.Dataset) or ds.shape != expected or ds.dtype != CRC_DTYPE:
            f.close()
            what = "missing" if ds is None else f"of shape {getattr(ds, 'shape', None)}, not {expected}"
            raise StoreError(
                f"{self.path}: its record CRCs ({CRC_DATASET!r}) are {what}, though the manifest says it has them"
            )
        try:
            return np.asarray(ds[()])
        except OSError as exc:
            f.close()
            raise StoreError(f"{self.path}: damaged HDF5 shard, record CRCs ({exc})") from exc

    def _dataset(self, name: str, field: Field) -> h5py.Dataset:
        """The checked dataset of field ``name`` (and its offsets, for a ragged field), opened once."""
        ds = self._h_data.get(name)
        if ds is not None:
            return ds
        try:
            ds, offsets = self._check_field(self._h_file, name, field)
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise StoreError(f"{self.path}: damaged HDF5 shard, field {name!r} ({exc})") from exc
        if offsets is not None:
            self._h_offsets[name] = offsets
        self._h_data[name] = ds
        return ds

    def _check_field(self, f: h5py.File, name: str, field: Field) -> tuple[h5py.Dataset, np.ndarray | None]:
        """A field's dataset and (ragged fields) offsets, checked against the manifest and the sample count."""
        key = data_path(name, field)
        if key not in f:
            raise StoreError(f"{self.path}: field {name!r} has no dataset {key!r}")
        ds = f[key]  # not f.get(key), which answers None for an object it cannot open (damaged header)
        if not isinstance(ds, h5py.Dataset):
            raise StoreError(f"{self.path}: field {name!r} has no dataset {key!r} (a group is in its place)")
        if ds.shape[1:] != row_shape(field):
            raise StoreError(
                f"{self.path}: dataset {key!r} has rows of shape {ds.shape[1:]}, expected {row_shape(field)}"
            )
        if not is_ragged(field):
            if ds.shape[0] != self.num_samples:
                raise StoreError(f"{self.path}: dataset {key!r} has {ds.shape[0]} rows, expected {self.num_samples}")
            return ds, None
        if offsets_path(name) not in f:
            raise StoreError(f"{self.path}: field {name!r} has no dataset {offsets_path(name)!r}")
        offs = np.asarray(f[offsets_path(name)][()], dtype=np.int64)
        if (
            offs.shape != (self.num_samples + 1,)
            or offs[0] != 0
            or offs[-1] != ds.shape[0]
            or np.any(np.diff(offs) < 0)
        ):
            raise StoreError(f"{self.path}: offsets of field {name!r} do not match its data (damaged shard)")
        return ds, offs

    def _close_handles(self) -> None:
        for mapped in self.__dict__.pop("_h_maps", {}).values():
            if mapped is not None:
                mapped.close()
        for attr in ("_h_data", "_h_offsets", "_h_crcs"):
            self.__dict__.pop(attr, None)
        f = self.__dict__.pop("_h_file", None)
        if f is not None:
            f.close()

    def read(self, index: int, fields: Iterable[str] | None = None) -> SampleDict:
        """The fields of local sample ``index`` (only ``fields`` if given).

        Each field is its own dataset, so the fields not asked for are never read.
        Raises :class:`StoreError` if the file, or a dataset asked for, cannot be read.
        """
        selected = self._selected(fields)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"{self.path}: record {index} out of range ({self.num_samples} samples)")
        self._ensure_open()
        sample: SampleDict = {}
        for name, field in selected.items():
            ds = self._dataset(name, field)
            try:
                if is_ragged(field):
                    sample[name] = self._ragged_record(ds, name, field, index)
                else:
                    # A slice, not ds[index]: h5py returns a numpy scalar for ds[index] of a scalar field.
                    sample[name] = ds[index : index + 1].reshape(field.shape)
            except (OSError, ValueError) as exc:
                raise StoreError(f"{self.path}: record {index}, field {name!r}: HDF5 read failed ({exc})") from exc
            if self._h_crcs is not None:
                expected = self._h_crcs[index, self.crc_column[name]]
                check_record(sample[name], expected, f"{self.path}: record {index}", name)
        return sample

    def read_batch(
        self, indices: np.ndarray, fields: Iterable[str] | None = None, *, arrays: bool = False
    ) -> BatchDict:
        """The fields of the local samples ``indices`` (see :meth:`ShardReader.read_batch`).

        A fixed array field is gathered from the mapped file when its chunks are
        plain bytes (:mod:`dali_pipes.stores._h5map`), else read with one HDF5
        selection over the sorted, distinct rows: the hyperslab spanning them when
        it is small enough, else those rows only. A ragged field reads each
        sample's byte range in file order: from the mapped file when the field is
        stored contiguously (as the writer stores it) and ``arrays`` is set, then
        copied into one buffer (:func:`~dali_pipes.stores.base.packed`).
        """
        selected, indices = self._batch_request(indices, fields)
        rows, inverse = None, None  # the sorted distinct records, made when a field reads in file order
        batch: BatchDict = {}
        for name, field in selected.items():
            ds = self._dataset(name, field)
            ragged = is_ragged(field)
            mapped = self._mapped(name, ds) if not ragged or (arrays and field.kind == "bytes") else None
            if rows is None and (ragged or mapped is None):  # these read the records in file order
                rows, inverse = np.unique(indices, return_inverse=True)
            try:
                if ragged:
                    in_map = mapped is not None and len(mapped.views) == 1  # a contiguous dataset
                    if in_map:
                        values = mapped.slices(self._h_offsets[name], rows)  # CRC-checked on the map, then copied
                    else:
                        values = [self._ragged_record(ds, name, field, int(row)) for row in rows]
                    self._check_rows(rows, values, name)
                    if in_map:
                        values = packed(values)
                    batch[name] = [values[k] for k in inverse.tolist()]
                elif mapped is not None:
                    # In the batch's order straight from the map: one copy, no sort, no reordering copy after it.
                    values = mapped.take(indices)
                    self._check_rows(indices, values, name)
                    batch[name] = values.reshape(len(indices), *(field.shape or ()))
                else:
                    values = self._fixed_rows(ds, rows)
                    self._check_rows(rows, values, name)
                    batch[name] = values[inverse].reshape(len(indices), *(field.shape or ()))
            except (OSError, ValueError) as exc:
                raise StoreError(
                    f"{self.path}: records {sorted(set(indices.tolist()))}, field {name!r}: HDF5 read failed ({exc})"
                ) from exc
        return as_arrays(batch, self.fields) if arrays else batch

    def _mapped(self, name: str, ds: h5py.Dataset) -> MappedRows | None:
        """The rows of field ``name``'s dataset read from the mapped file, when they can be (see _h5map)."""
        if name not in self._h_maps:
            self._h_maps[name] = map_rows(self.path, ds)
        return self._h_maps[name]

    def _check_rows(self, rows: np.ndarray, values, name: str) -> None:
        """Check each of ``rows`` (the records ``values`` hold, in their order) against its stored CRC for ``name``."""
        if self._h_crcs is None:
            return
        expected = self._h_crcs[rows, self.crc_column[name]]
        row_list = rows.tolist()
        if isinstance(values, np.ndarray):  # a fixed-shape field: its rows checked together
            check_rows(values, expected, lambda k: f"{self.path}: record {row_list[k]}", name)
            return
        for k, row in enumerate(row_list):
            check_record(values[k], expected[k], f"{self.path}: record {row}", name)

    def _ragged_record(self, ds: h5py.Dataset, name: str, field: Field, row: int):
        start, stop = self._h_offsets[name][row : row + 2]
        value = ds[start:stop]
        return value.tobytes() if field.kind == "bytes" else value

    @staticmethod
    def _fixed_rows(ds: h5py.Dataset, rows: np.ndarray) -> np.ndarray:
        """The sorted distinct ``rows`` of a fixed field: one hyperslab over their span, or a point selection."""
        first, last = int(rows[0]), int(rows[-1])
        row_bytes = ds.dtype.itemsize * math.prod(ds.shape[1:])
        if (last - first + 1) * row_bytes <= SPAN_BYTES_PER_ROW * len(rows):
            return ds[first : last + 1][rows - first]
        return ds[rows]
