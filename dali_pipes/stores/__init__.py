"""Random-access readers over a converted dataset: ``open_store(path)[i]`` -> dict of fields.

One module per format (``lmdb.py``, ``hdf5.py``, ``tfrecord.py``), picked by the
manifest's ``format`` field through :data:`READERS`; ``mixed.py`` joins several
stores into one (:class:`~dali_pipes.stores.mixed.MixedStore`).
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from dali_pipes.dataset.manifest import Manifest, load_manifest, resolve_inside
from dali_pipes.stores.base import (
    BatchDict,
    SampleDict,
    ShardReader,
    StoreError,
    fixed_as_array,
    gather_batch,
    out_of_descriptors,
    select_fields,
)
from dali_pipes.stores.checksum import RECORD_CRC32C

logger = logging.getLogger(__name__)
#: Datasets without record CRCs already reported in this process.
_WARNED_UNCHECKED: set[Path] = set()

#: Manifest ``format`` -> ``"module:class"`` of its one-shard reader, imported when first used.
READERS: dict[str, str] = {
    "lmdb": "dali_pipes.stores.lmdb:LmdbShardReader",
    "hdf5": "dali_pipes.stores.hdf5:Hdf5ShardReader",
    "tfrecord": "dali_pipes.stores.tfrecord:TFRecordShardReader",
}


def reader_class(fmt: str) -> type[ShardReader]:
    """The :class:`ShardReader` subclass for a manifest ``format``."""
    module_name, _, class_name = READERS[fmt].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["Store", "open_store", "StoreError", "ShardReader", "READERS", "reader_class"]


class Store:
    """A converted dataset read by global sample index.

    ``len(store)`` is the sample count, ``store[i]`` a dict of the sample's fields
    (``bytes`` for bytes fields, numpy arrays for array fields),
    ``store.read(i, fields)`` the same for some fields only, ``store.manifest``
    the validated manifest. Safe to pickle and to use after fork or spawn: each
    process opens its own read-only handles on first access.
    """

    def __init__(self, root: str | os.PathLike, manifest: Manifest | None = None) -> None:
        self.root = Path(root)
        self.manifest = manifest if manifest is not None else load_manifest(self.root)
        reader_cls = reader_class(self.manifest.format)
        record_crc = RECORD_CRC32C in self.manifest.checksums
        if not record_crc and self.manifest.format in ("lmdb", "hdf5") and self.root not in _WARNED_UNCHECKED:
            _WARNED_UNCHECKED.add(self.root)  # once per dataset and process, however many stores open it
            logger.warning(
                "%s: this dataset was converted before LMDB and HDF5 shards had a CRC32C per record, so its "
                "records are not checked when read (only 'dali-pipes verify' checks its shards' SHA-256); "
                "convert it again with this version of dali-pipes, into a new folder, to have every record checked",
                self.root,
            )
        self._shards = [
            reader_cls(
                resolve_inside(self.root, shard.path),
                self.manifest.fields,
                shard.num_samples,
                resolve_inside(self.root, shard.index_path) if shard.index_path else None,
                expected_bytes=shard.bytes,
                record_crc=record_crc,
            )
            for shard in self.manifest.shards
        ]

    def __len__(self) -> int:
        return self.manifest.num_samples

    def __getitem__(self, index: int) -> SampleDict:
        return self.read(index)

    def read(self, index: int, fields: Iterable[str] | None = None) -> SampleDict:
        """Sample ``index`` (negative counts from the end), only ``fields`` of it if given.

        The values are those of ``store[index]``, byte for byte, but the fields not
        asked for are neither read nor decoded: an LMDB read fetches only their
        keys, an HDF5 read only their datasets, and a TFRecord read, which must
        read and CRC-check the whole record, decodes only their features.
        ``ValueError`` names an unknown field and the dataset's fields;
        :class:`StoreError` a damaged or missing shard.
        """
        if fields is not None:
            # Checked here too, so that the message names the dataset rather than one shard.
            fields = tuple(select_fields(self.manifest.fields, fields, str(self.root)))
        index = int(index)
        if index < 0:
            index += len(self)
        shard_no, local = self.manifest.locate(index)
        try:
            shard = self._shards[shard_no]
            # A reader written before ``fields`` existed takes the index alone.
            return shard.read(local) if fields is None else shard.read(local, fields)
        except (StoreError, OSError) as exc:
            where = f"{self.root}: sample {index} (shard {self.manifest.shards[shard_no].path}"
            if out_of_descriptors(exc):
                # Not damage: every shard read stays open (two descriptors for LMDB, one otherwise).
                raise StoreError(
                    f"{where}): too many open files. A process keeps every shard it has read open: two "
                    "descriptors per LMDB shard, one per HDF5 or TFRecord shard. Raise the limit (ulimit -n) "
                    "or convert into fewer, larger shards."
                ) from exc
            if not isinstance(exc, StoreError):
                raise
            raise StoreError(
                f"{where}, record {local}): {exc}. Run 'dali-pipes verify {self.root}' and re-convert the damaged shard."
            ) from exc

    def read_batch(
        self, indices: Sequence[int] | np.ndarray, fields: Iterable[str] | None = None, *, arrays: bool = False
    ) -> BatchDict:
        """The samples ``indices`` (global, in that order, repeats allowed), one call per shard touched.

        Returns ``{field: values}``: for a fixed-shape array field one array
        ``(len(indices), *shape)``, for any other field a list with one value per
        index, each equal to what :meth:`read` returns for that sample. Each
        shard's samples are read together, sorted and coalesced by its reader
        (HDF5 hyperslabs, one LMDB cursor, TFRecord reads in file order). When a
        shard's batch read fails, its samples are read again one by one, so the
        error is :meth:`read`'s, naming the dataset, shard and sample.
        ``arrays``: bytes fields as ``uint8`` arrays, copied out of the shards' memory
        maps in one pass per shard where the format allows (see :meth:`ShardReader.read_batch`).
        """
        names = tuple(
            self.manifest.fields if fields is None else select_fields(self.manifest.fields, fields, str(self.root))
        )
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            bad = indices[(indices < 0) | (indices >= len(self))][0]
            raise IndexError(f"sample index {bad} is out of range for a dataset of {len(self)} samples")
        starts = np.asarray(self.manifest.shard_offsets, dtype=np.int64)
        shard_of = np.searchsorted(starts, indices, side="right") - 1
        if len(indices) and shard_of[0] == shard_of[-1] and np.all(shard_of == shard_of[0]):
            # One shard: its reader's values are the batch, in order (no gather, no second copy).
            shard_no = int(shard_of[0])
            values = self._read_shard_batch(shard_no, indices - starts[shard_no], names, arrays)
            return {name: fixed_as_array(self.manifest.fields[name], values[name]) for name in names}
        by_shard = np.argsort(shard_of, kind="stable")
        cuts = np.flatnonzero(np.diff(shard_of[by_shard])) + 1
        parts = []
        for positions in np.split(by_shard, cuts) if len(indices) else ():
            shard_no = int(shard_of[positions[0]])
            parts.append(
                (positions, self._read_shard_batch(shard_no, indices[positions] - starts[shard_no], names, arrays))
            )
        return gather_batch(names, self.manifest.fields, len(indices), parts)

    def _read_shard_batch(self, shard_no: int, local: np.ndarray, names: tuple[str, ...], arrays: bool) -> BatchDict:
        """Shard ``shard_no``'s records ``local``; when its batch read fails, read()'s error for the first bad one."""
        try:
            return self._shards[shard_no].read_batch(local, names, arrays=arrays)
        except Exception:
            start = self.manifest.shard_offsets[shard_no]
            for index in local.tolist():  # the first sample that fails raises read()'s message
                self.read(start + index, names)
            raise  # every sample reads on its own: the batch read itself failed

    def __iter__(self) -> Iterator[SampleDict]:
        for i in range(len(self)):
            yield self[i]

    def column(self, name: str, chunk: int = 1 << 16) -> np.ndarray:
        """Every sample's value of the fixed-shape array field ``name`` (such as ``label``), as one array.

        Reads that field only, ``chunk`` samples a call: the labels of a million
        samples (for ``class_balanced_weights``) are a few MB and seconds.
        """
        field = select_fields(self.manifest.fields, [name], str(self.root))[name]
        if field.kind != "array" or field.variable_length:
            raise ValueError(f"{self.root}: field {name!r} is not a fixed-shape array, which is all column() reads")
        parts = [
            self.read_batch(np.arange(lo, min(lo + chunk, len(self))), [name])[name]
            for lo in range(0, len(self), chunk)
        ]
        return np.concatenate(parts) if parts else np.empty((0, *(field.shape or ())), dtype=field.dtype)

    @property
    def shard_readers(self) -> list[ShardReader]:
        """One reader per shard, in manifest order (for tools that walk a dataset shard by shard)."""
        return list(self._shards)

    @property
    def fields(self):
        """The manifest's fields (name -> :class:`~dali_pipes.dataset.manifest.Field`)."""
        return self.manifest.fields

    def close(self) -> None:
        """Release every open shard handle."""
        for shard in self._shards:
            shard.close()

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r}, format={self.manifest.format}, samples={len(self)})"


def open_store(path: str | os.PathLike) -> Store:
    """Open a dataset folder written by ``dali-pipes convert``, or a file written by ``dali-pipes merge``.

    A merged ``.h5`` file carries its manifest; it is read as a dataset of one shard.
    """
    path = Path(path)
    if path.suffix in (".h5", ".hdf5") and path.is_file():
        from dali_pipes.stores.hdf5 import merged_manifest  # h5py only when an HDF5 file is opened

        return Store(path.parent, merged_manifest(path))
    return Store(path)
