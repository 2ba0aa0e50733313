"""Feature arrays read from object storage by ranged requests: the ``arrays`` source's inputs at a URL.

Nothing is copied whole to a local disk. A ``.npy`` file (and a member of an uncompressed ``.npz``
archive, which is plain ``.npy`` bytes inside the zip) is read as its header, then row by row at
``data offset + row x row bytes``, through a buffered reader whose every refill is one ranged request
of :data:`ROWS_BLOCK` bytes, so that the consecutive rows a shard task reads cost one request per
block, not one per row. HDF5 files are opened by h5py (3.x) through the same kind of seekable file
object (h5py's file-object driver): its metadata and chunk reads become ranged requests.

Two layouts cannot be read a row at a time and are read whole into memory, once per worker process,
as a compressed member already is locally: a member of a compressed archive (``np.savez_compressed``)
and an array stored in Fortran order (its rows are spread across the whole file).
"""

from __future__ import annotations

import logging
import struct
import zipfile
from typing import IO, Any

import numpy as np

from converters.base import ConversionError
from converters.remote_inputs import open_input
from dali_pipes.remote.fs import RemoteError

log = logging.getLogger(__name__)

#: Bytes fetched per request while reading headers and metadata (planning), and while reading rows.
SCAN_BLOCK = 256 << 10
ROWS_BLOCK = 4 << 20


def open_url(url: str, block: int = SCAN_BLOCK) -> IO[bytes]:
    """A seekable file over the object at ``url`` (reads are ranged requests of ``block`` bytes);
    a :class:`ConversionError` naming the URL when it cannot be reached (no such object, no access)."""
    try:
        return open_input(url, block=block)
    except RemoteError as exc:
        raise ConversionError(str(exc)) from None


class RemoteRows:
    """The rows of a C-ordered array stored at byte ``offset`` of the object at ``url``, indexable by row.

    Opened on first use; each row is a seek and a read of the buffered ranged file, so that rows read
    in order come from one request per :data:`ROWS_BLOCK`.
    """

    def __init__(self, url: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.url, self.offset, self.dtype, self.shape = url, offset, dtype, shape
        self.row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        self._file: IO[bytes] | None = None

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, row: int) -> np.ndarray:
        if not 0 <= row < self.shape[0]:
            raise IndexError(f"row {row} of {self.url} (it has {self.shape[0]})")
        if self._file is None:
            self._file = open_url(self.url, ROWS_BLOCK)
        start = self.offset + row * self.row_bytes
        self._file.seek(start)
        data = self._file.read(self.row_bytes)
        if len(data) != self.row_bytes:
            raise ValueError(f"{self.url} ends at byte {start + len(data)}, inside row {row} (truncated object)")
        return np.frombuffer(data, dtype=self.dtype).reshape(self.shape[1:])


def member_data_offset(raw: IO[bytes], info: zipfile.ZipInfo) -> int:
    """Where the ``.npy`` bytes of a stored (uncompressed) zip member begin in the archive ``raw``."""
    raw.seek(info.header_offset)
    local = raw.read(30)
    if local[:4] != b"PK\x03\x04":
        raise ValueError(f"bad zip local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len


def open_remote_npy(url: str, read_header) -> Any:
    """The rows of the ``.npy`` object at ``url`` (``read_header(f, where)`` parses its header)."""
    with open_url(url) as f:
        offset, dtype, shape, fortran = read_header(f, url)
    return _rows_or_whole(url, offset, dtype, shape, fortran)


def open_remote_npz_member(url: str, member: str, read_header) -> Any:
    """The rows of ``member`` of the ``.npz`` object at ``url``: by range when stored, whole when compressed."""
    where = f"{url}:{member}"
    with open_url(url, ROWS_BLOCK) as raw, zipfile.ZipFile(raw) as archive:  # a compressed member is read whole
        info = archive.getinfo(member + ".npy")
        if info.compress_type != zipfile.ZIP_STORED:
            log.info(
                "%s: member is compressed; each worker decompresses it once into memory (%.1f MB)",
                where,
                info.file_size / 1e6,
            )
            with archive.open(info) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        raw.seek(member_data_offset(raw, info))
        offset, dtype, shape, fortran = read_header(raw, where)
    return _rows_or_whole(url, offset, dtype, shape, fortran, where)


def _rows_or_whole(
    url: str, offset: int, dtype: np.dtype, shape: tuple[int, ...], fortran: bool, where: str | None = None
) -> Any:
    """Row-by-row reads for a C-ordered array; the whole array read into memory for a Fortran-ordered one."""
    if not fortran or len(shape) < 2:
        return RemoteRows(url, offset, dtype, shape)
    size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    log.info(
        "%s: stored in Fortran order (a row is spread over the whole array); each worker reads it once into "
        "memory (%.1f MB)",
        where or url,
        size / 1e6,
    )
    with open_url(url, ROWS_BLOCK) as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise ValueError(f"{where or url}: the object ends {size - len(data)} bytes short of its array (truncated)")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F")


def open_remote_hdf5(url: str) -> Any:
    """An h5py file over the object at ``url`` (read-only; h5py's reads are ranged requests)."""
    import h5py

    handle = open_url(url, ROWS_BLOCK)
    try:
        return h5py.File(handle, "r")
    except OSError as exc:
        handle.close()
        raise ConversionError(f"{url}: not a readable HDF5 file ({exc})") from None


__all__ = [
    "ROWS_BLOCK",
    "SCAN_BLOCK",
    "RemoteRows",
    "member_data_offset",
    "open_remote_hdf5",
    "open_remote_npy",
    "open_remote_npz_member",
    "open_url",
]
