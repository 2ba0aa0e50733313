"""Rows of an unfiltered HDF5 dataset read straight from the memory-mapped file, for batch reads.

A batch of random rows of a small fixed field (16 floats) costs h5py either a
point selection, slow per row, or a read of every chunk the rows touch, and
random rows touch nearly all of them. An uncompressed dataset's chunks are plain
row-major bytes in the file, so once HDF5 has said where each chunk lies
(``get_chunk_info``), numpy can gather the rows from a read-only map of the
file. Chunks that follow each other in the file (nearly all: the writer appends
them in order) are joined into one view, so a batch is one fancy index per run
of adjacent chunks, not one per chunk: a random batch touches nearly every
chunk, and looping over a dozen runs costs a fraction of looping over a thousand chunks.

Only used when that is exactly what HDF5 would return: a native-order dataset
with no filters, not virtual, chunked along the sample axis only (or contiguous),
with every chunk allocated where the file has bytes for it. Anything else
(:func:`map_rows` returns ``None``) is read through h5py. Like LMDB's map, a file
truncated while mapped would raise SIGBUS on access, so :class:`MappedRows`
checks the file's size before every gather (see ``LmdbShardReader._check_not_shrunk``).
"""

from __future__ import annotations

import math
import mmap
import os

import h5py
import numpy as np

from dali_pipes.stores.base import StoreError


class MappedRows:
    """The rows of one dataset as numpy views of the mapped file, one view per run of adjacent chunks."""

    def __init__(self, fd: int, mapped: mmap.mmap, views: list[np.ndarray], starts: list[int], path: str) -> None:
        self.fd, self.mapped, self.views, self.path = fd, mapped, views, path
        self.starts = np.asarray(starts, dtype=np.int64)  # the first row of each view
        self.size = len(mapped)

    def _check_not_shrunk(self) -> None:
        size = os.fstat(self.fd).st_size
        if size < self.size:
            raise StoreError(
                f"{self.path}: the HDF5 shard shrank from {self.size} to {size} bytes while it was open "
                "(truncated or rewritten in place); not read, since reading past its new end would kill the process"
            )

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (in range, in any order, repeats allowed) as one new array, in that order."""
        self._check_not_shrunk()
        first = self.views[0]
        if len(self.views) == 1:
            return first[rows]
        out = np.empty((len(rows), *first.shape[1:]), dtype=first.dtype)
        view_of = np.searchsorted(self.starts, rows, side="right") - 1
        for number, (view, start) in enumerate(zip(self.views, self.starts.tolist())):
            positions = np.flatnonzero(view_of == number)
            if len(positions):
                out[positions] = view[rows[positions] - start]
        return out

    def slices(self, offsets: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
        """The ragged samples ``rows`` of a dataset held in one view: ``view[offsets[r]:offsets[r + 1]]`` each.

        Views of the map, valid while it is open: copy them before the reader closes.
        """
        self._check_not_shrunk()
        (view,) = self.views
        starts, stops = offsets[rows].tolist(), offsets[rows + 1].tolist()
        return [view[start:stop] for start, stop in zip(starts, stops)]

    def close(self) -> None:
        self.views = []
        try:
            self.mapped.close()
        except BufferError:  # a view still exported (a caller kept one); the map goes with it
            pass
        os.close(self.fd)


def map_rows(path: str | os.PathLike, ds: h5py.Dataset) -> MappedRows | None:
    """A :class:`MappedRows` over ``ds`` when its bytes can be read from the file as they are, else ``None``."""
    if ds.is_virtual or ds.dtype.byteorder not in ("=", "|", "<" if np.little_endian else ">"):
        return None
    if ds.id.get_create_plist().get_nfilters() or ds.shape[0] == 0:
        return None
    row_elems = math.prod(ds.shape[1:])
    row_bytes = ds.dtype.itemsize * row_elems
    if ds.chunks is None:
        offset = ds.id.get_offset()
        if offset is None:
            return None
        spans = [(offset, ds.shape[0])]
    else:
        if tuple(ds.chunks[1:]) != tuple(ds.shape[1:]):
            return None
        chunk_rows = ds.chunks[0]
        count = ds.id.get_num_chunks()
        if count != -(-ds.shape[0] // chunk_rows):
            return None  # a chunk never written (fill value): h5py knows what to return for it
        infos = sorted((ds.id.get_chunk_info(i) for i in range(count)), key=lambda info: info.chunk_offset[0])
        for k, info in enumerate(infos):
            if info.chunk_offset[0] != k * chunk_rows or info.filter_mask or info.size != chunk_rows * row_bytes:
                return None
        spans = [(info.byte_offset, chunk_rows) for info in infos]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if any(offset + rows * row_bytes > size for offset, rows in spans):
            os.close(fd)
            return None
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except BaseException:
        os.close(fd)
        raise
    views, starts = [], []
    for offset, rows, start in _runs(spans, row_bytes):
        views.append(
            np.frombuffer(mapped, dtype=ds.dtype, count=rows * row_elems, offset=offset).reshape(rows, *ds.shape[1:])
        )
        starts.append(start)
    return MappedRows(fd, mapped, views, starts, str(path))


def _runs(spans: list[tuple[int, int]], row_bytes: int) -> list[tuple[int, int, int]]:
    """``(byte offset, rows, first row)`` of each run of ``spans`` (in row order) that lie end to end in the file."""
    runs: list[list[int]] = []
    first_row = 0
    for offset, rows in spans:
        if runs and runs[-1][0] + runs[-1][1] * row_bytes == offset:
            runs[-1][1] += rows
        else:
            runs.append([offset, rows, first_row])
        first_row += rows
    return [(offset, rows, start) for offset, rows, start in runs]
