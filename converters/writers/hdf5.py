"""HDF5 shard writer (layout in :mod:`dali_pipes.stores.hdf5`).

Why ragged fields (encoded images, text, boxes) are spooled: random access to one
sample must read only that sample's bytes, which a *contiguous* dataset of the
concatenated values plus an offsets dataset gives (a chunked one would read whole
chunks around it, and HDF5 chunks are all one size). A contiguous dataset needs
its size at creation, which the writer learns only at the end; so ragged values
go to an anonymous temporary file in the shard's folder (in memory up to
:data:`SPOOL_MEMORY`; unnamed on disk, so nothing is left behind after a crash)
and are copied into the HDF5 file at :meth:`close`. The cost is writing those
bytes twice, once to the spool and once to the shard; the price of variable-size
HDF5 alternatives (one dataset per sample, or vlen types in the global heap) is
paid on every read instead.

Fixed-shape arrays go straight into resizable chunked datasets, in whole chunks.

The file is reproducible: fixed library version bounds, no timestamps
(``track_times=False``), and the same sequence of writes for the same samples.

HDF5 writes through a :class:`~converters.writers._h5file.GuardedFile`, not a
path: a full disk then ends the shard with an ``OSError`` (``ENOSPC``/``EFBIG``)
instead of leaving HDF5 in a state that crashes the process on close. For the
same reason a Ctrl-C is held while HDF5 may call that file (:mod:`converters.ctrl_c`):
raised inside one of its writes, HDF5 would lose it or crash.
"""

from __future__ import annotations

import math
import os
import tempfile
from array import array
from typing import Mapping

import h5py
import numpy as np

from converters.base import Sample, ShardWriter
from converters.ctrl_c import holds_ctrl_c
from converters.writers._h5file import GuardedFile
from converters.writers._sample import check_fields, normalize_sample
from dali_pipes.dataset.manifest import Field
from dali_pipes.stores import hdf5_layout

#: Ragged values stay in memory up to this many bytes per field, then spill to the temporary file.
SPOOL_MEMORY = 32 << 20
#: Fixed arrays are buffered up to about this many bytes per field between writes.
FLUSH_BYTES = 8 << 20
#: The block size of the copy from spool to shard.
COPY_BYTES = 16 << 20


class Hdf5ShardWriter(ShardWriter):
    """Writes one ``.h5`` shard file."""

    format = "hdf5"
    suffix = ".h5"

    def __init__(self, path: str | os.PathLike, fields: Mapping[str, Field]) -> None:
        super().__init__(path, fields)
        check_fields(self.fields, str(self.path))
        self._io = GuardedFile(self.path)
        self._file: h5py.File | None = None
        self._spools: dict[str, tempfile.SpooledTemporaryFile] = {}
        # Per-sample state kept as packed arrays (8 and 4 bytes a value), not Python ints: a shard may hold
        # millions of rows, and a list of ints or of small arrays costs 50-150 bytes a sample.
        self._offsets: dict[str, array] = {}
        self._buffers: dict[str, list[np.ndarray]] = {}
        self._flush_rows: dict[str, int] = {}
        self._crcs = array("I")  # the field CRCs of each sample, one row after another
        try:
            self._create_file()
        except BaseException:
            self.abort()
            raise

    @holds_ctrl_c
    def _create_file(self) -> None:
        self._file = h5py.File(self._io, "w", libver=hdf5_layout.LIBVER)
        for name, field in self.fields.items():
            if hdf5_layout.is_ragged(field):
                self._spools[name] = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY, dir=self.path.parent)
                self._offsets[name] = array("q", [0])
            else:
                rows = hdf5_layout.chunk_rows(field)
                shape = tuple(field.shape or ())
                self._file.create_dataset(
                    name,
                    shape=(0, *shape),
                    maxshape=(None, *shape),
                    chunks=(rows, *shape),
                    dtype=hdf5_layout.data_dtype(field),
                    track_times=False,
                )
                self._buffers[name] = []
                # Flush whole chunks only, so no chunk is written twice.
                row_bytes = hdf5_layout.data_dtype(field).itemsize * math.prod(shape)
                self._flush_rows[name] = rows * max(1, FLUSH_BYTES // (rows * row_bytes))
        self._io.check()

    def write(self, sample: Sample) -> None:
        """Append one sample."""
        where = f"{self.path}: sample {self.num_samples}"
        values = normalize_sample(self.fields, sample, where)
        self._crcs.frombytes(np.asarray(hdf5_layout.sample_crcs(values), dtype=np.uint32).tobytes())
        for name, field in self.fields.items():
            value = values[name]
            if hdf5_layout.is_ragged(field):
                data = value if isinstance(value, bytes) else value.tobytes()
                self._spools[name].write(data)
                rows = len(data) if field.kind == "bytes" else value.shape[0]
                self._offsets[name].append(self._offsets[name][-1] + rows)
            else:
                self._buffers[name].append(value)
                if len(self._buffers[name]) >= self._flush_rows[name]:
                    self._flush(name)
        self._io.check()
        self.num_samples += 1

    @holds_ctrl_c
    def _flush(self, name: str) -> None:
        rows = self._buffers[name]
        if not rows:
            return
        ds = self._file[name]
        start = ds.shape[0]
        ds.resize(start + len(rows), axis=0)
        ds[start:] = np.stack(rows)
        rows.clear()

    def _write_ragged(self, name: str, field: Field) -> None:
        spool = self._spools.pop(name)
        offsets = np.frombuffer(self._offsets[name], dtype=np.int64)
        dtype = hdf5_layout.data_dtype(field)
        rest = hdf5_layout.row_shape(field)
        row_bytes = dtype.itemsize * math.prod(rest)
        ds = self._file.create_dataset(
            hdf5_layout.data_path(name, field), shape=(int(offsets[-1]), *rest), dtype=dtype, track_times=False
        )
        spool.seek(0)
        block_rows = max(1, COPY_BYTES // row_bytes)
        done = 0
        while done < ds.shape[0]:
            block = spool.read(block_rows * row_bytes)
            n = len(block) // row_bytes
            if n == 0:
                raise OSError(f"{self.path}: the spool of field {name!r} ended at row {done} of {ds.shape[0]}")
            ds[done : done + n] = np.frombuffer(block, dtype=dtype).reshape((n, *rest))
            self._io.check()
            done += n
        spool.close()
        self._file.create_dataset(hdf5_layout.offsets_path(name), data=offsets, track_times=False)

    @holds_ctrl_c
    def close(self) -> None:
        """Write the ragged fields and the attributes, flush, fsync and close the file."""
        if self._file is None:
            return
        for name, field in self.fields.items():
            if hdf5_layout.is_ragged(field):
                self._write_ragged(name, field)
            else:
                self._flush(name)
        crcs = np.frombuffer(self._crcs, dtype=np.uint32).astype(hdf5_layout.CRC_DTYPE).reshape(-1, len(self.fields))
        self._file.create_dataset(hdf5_layout.CRC_DATASET, data=crcs, dtype=hdf5_layout.CRC_DTYPE, track_times=False)
        for key, value in hdf5_layout.layout_attrs(self.fields, self.num_samples).items():
            self._file.attrs[key] = value
        self._file.close()
        self._file = None
        self._io.check()  # the last metadata went out at close
        # h5py's close flushes HDF5's buffers but does not fsync.
        self._io.fsync()
        self._io.close()

    @holds_ctrl_c
    def abort(self) -> None:
        """Close the file and drop the spools; the runner removes the shard."""
        for spool in self._spools.values():
            spool.close()
        self._spools.clear()
        try:
            if self._file is not None:
                # Safe even after a failed write: HDF5 never saw the failure (see GuardedFile).
                self._file.close()
                self._file = None
        finally:
            self._io.close()  # the descriptor, whatever HDF5 did
