"""Per-record CRC32C of LMDB and HDF5 shards: computed by the writers, checked on every read.

LMDB and HDF5 keep no checksum of what they store, so a record damaged on disk
after conversion would otherwise reach the decoder, which often decodes damaged
JPEG data into a damaged image without a word. Each field of each sample has
the CRC32C (Castagnoli, hardware-accelerated by ``google-crc32c``) of its
stored bytes: a ``bytes`` field's bytes, an array field's elements in C order,
little-endian (:func:`~dali_pipes.stores.codec.array_to_bytes`). Where the CRCs
live is the format's business (see :mod:`dali_pipes.stores.lmdb` and
:mod:`dali_pipes.stores.hdf5`); the manifest's ``checksums`` says whether a
dataset has them (:data:`RECORD_CRC32C`).

:func:`check_record` is the one check every reader makes per field read.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterable, Mapping, Sequence, Union

import google_crc32c
import numpy as np

from dali_pipes.stores.codec import array_to_bytes
from dali_pipes.stores.crc_combine import combined_crc
from dali_pipes.stores.errors import StoreError

#: The manifest's ``checksums`` entry of a dataset whose records carry a CRC32C each.
RECORD_CRC32C = "crc32c"
#: The HDF5 dataset of the CRCs (a name no field may have, in any format).
CRC_DATASET = "__crc32c__"
#: The stored CRCs of one sample: one little-endian uint32 per field, fields in :func:`crc_order`.
CRC_DTYPE = np.dtype("<u4")

_LITTLE = sys.byteorder == "little"

Stored = Union[bytes, bytearray, memoryview, np.ndarray]


class RecordChecksumError(StoreError):
    """A record whose bytes do not match the CRC32C written with it: damaged after conversion."""


def _as_buffer(data: Stored) -> bytes | np.ndarray:
    # google_crc32c takes bytes or a numpy array, not a memoryview: a uint8 view copies nothing.
    if isinstance(data, (bytes, np.ndarray)):
        return data
    return np.frombuffer(data, dtype=np.uint8)


def stored_bytes(value: Stored) -> bytes | np.ndarray:
    """What a field's CRC is computed over: the bytes of a bytes field, an array's little-endian elements."""
    if not isinstance(value, np.ndarray):
        return _as_buffer(value)
    if value.flags.c_contiguous and (value.dtype.byteorder in "<|" or (value.dtype.isnative and _LITTLE)):
        return value  # already the stored bytes: no copy
    return array_to_bytes(value)


def crc32c(data: Stored) -> int:
    """The CRC32C of ``data`` (see :func:`stored_bytes` for what an array contributes)."""
    return google_crc32c.value(stored_bytes(data))


def crc_order(fields: Iterable[str]) -> list[str]:
    """The order of a sample's stored CRCs: the field names in the byte order of their UTF-8.

    Not the manifest's order, which a JSON round trip with sorted keys (a merged
    HDF5 file's manifest attribute) does not keep.
    """
    return sorted(fields, key=lambda name: name.encode("utf-8"))


def crc_columns(fields: Iterable[str]) -> dict[str, int]:
    """Each field's position in a sample's stored CRCs."""
    return {name: i for i, name in enumerate(crc_order(fields))}


def sample_crcs(values: Mapping[str, Stored]) -> np.ndarray:
    """The CRCs of one sample's fields, as stored (in :func:`crc_order`)."""
    return np.array([crc32c(values[name]) for name in crc_order(values)], dtype=CRC_DTYPE)


def check_record(data: Stored, expected: int, where: str, field: str) -> None:
    """Raise :class:`RecordChecksumError` unless ``data`` (one field's stored value) has CRC32C ``expected``.

    ``where`` names the shard and record (``"SHARD: record 7"``); the store adds
    the sample and what to do. ``data`` is what the format read: bytes, a view of
    them, or the field's array.
    """
    actual = crc32c(data)
    if actual != int(expected):
        raise RecordChecksumError(
            f"{where}: field {field!r} fails its record CRC32C check (stored {int(expected):08x}, read "
            f"{actual:08x}): the shard was damaged after conversion"
        )


#: Rows of at least this many bytes, this many at a time, are checked by one CRC over all of them (crc_combine.py),
#: which is cheaper there than crc32c_rows; shorter rows are cheaper by crc32c_rows.
COMBINE_ROW_BYTES = 24
COMBINE_MIN_ROWS = 64
#: Rows up to this many bytes are checked together (:func:`crc32c_rows`); longer ones one call each,
#: where the per-call cost is small next to the hardware-accelerated CRC of the row itself.
VECTOR_ROW_BYTES = 256


def _crc_tables() -> np.ndarray:
    """The four 256-entry tables of slicing-by-4 CRC32C (reflected Castagnoli polynomial 0x82F63B78)."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0x82F63B78), table >> 1).astype(np.uint32)
    tables = [table]
    for _ in range(3):
        previous = tables[-1]
        tables.append((previous >> 8) ^ table[previous & 0xFF])
    return np.stack(tables)


_TABLES = _crc_tables()


def _crc_tables_16() -> tuple[np.ndarray, np.ndarray]:
    """Slicing-by-4 as two 65,536-entry tables: the low and the high half of the register after a word is xored in."""
    t0, t1, t2, t3 = _TABLES
    half = np.arange(65536, dtype=np.uint32)
    return t3[half & 0xFF] ^ t2[half >> 8], t1[half & 0xFF] ^ t0[half >> 8]


_TABLES_16: tuple[np.ndarray, np.ndarray] | None = None  # 512 KiB, made on first use


def crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """The CRC32C of each row of the 2-D ``uint8`` array ``rows``, all rows at once (``uint32``, one each).

    The same values as :func:`crc32c` of each row, computed with numpy across the
    rows four bytes at a time: for the small fixed-shape rows of feature arrays
    (a label, a 64-byte embedding) one call per row would cost more than reading them.
    Each word is two lookups in 16-bit tables rather than four in 8-bit ones, with the
    words of a column made contiguous first, which beats both the 8-bit loop and one
    ``google_crc32c`` call per row on such rows.
    """
    global _TABLES_16
    if _TABLES_16 is None:
        _TABLES_16 = _crc_tables_16()
    low_table, high_table = _TABLES_16
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    crc = np.full(len(rows), 0xFFFFFFFF, dtype=np.uint32)
    width = rows.shape[1]
    columns = np.ascontiguousarray(rows[:, : width - width % 4].view("<u4").T)
    low = np.empty(len(rows), dtype=np.uint32)
    for column in columns:
        np.bitwise_xor(crc, column, out=crc)
        np.bitwise_and(crc, 0xFFFF, out=low)
        np.right_shift(crc, 16, out=crc)
        crc = low_table.take(low) ^ high_table.take(crc)
    t0 = _TABLES[0]
    for j in range(width - width % 4, width):
        crc = t0[(crc ^ rows[:, j]) & 0xFF] ^ (crc >> 8)
    return crc ^ np.uint32(0xFFFFFFFF)


def check_records(values: Sequence[np.ndarray], expected: np.ndarray, where: Callable[[int], str], field: str) -> None:
    """:func:`check_record` for each of ``values`` (``uint8`` arrays, one record each), with no per-record overhead.

    A batch of 256 images paid more for the calls around each CRC (names of the
    record formatted up front, conversions) than for the CRC itself; here a
    record's name is only made for the one that fails.
    """
    value = google_crc32c.value
    for k, (data, crc) in enumerate(zip(values, np.asarray(expected).tolist())):
        if value(data) != crc:
            check_record(data, crc, where(k), field)


def check_rows(values: np.ndarray, expected: np.ndarray, where: Callable[[int], str], field: str) -> None:
    """:func:`check_record` for each row of the fixed-shape array ``values`` (one row per record).

    ``expected[k]`` is row ``k``'s stored CRC and ``where(k)`` names its shard and
    record. Small rows are checked together; the first row that fails raises
    :func:`check_record`'s error.
    """
    rows = np.asarray(values).reshape(len(values), -1)
    if rows.dtype.itemsize * rows.shape[1] > VECTOR_ROW_BYTES:
        for k in range(len(rows)):
            check_record(values[k], expected[k], where(k), field)
        return
    if not (rows.dtype.byteorder in "<|" or (rows.dtype.isnative and _LITTLE)):
        rows = rows.astype(rows.dtype.newbyteorder("<"))
    as_bytes = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), -1)
    expected = np.asarray(expected, dtype=np.uint32)
    combined = as_bytes.shape[1] >= COMBINE_ROW_BYTES and len(rows) >= COMBINE_MIN_ROWS
    if combined and google_crc32c.value(as_bytes) == combined_crc(expected, as_bytes.shape[1]):
        return  # one hardware CRC over the batch agrees with the rows' own CRCs (crc_combine.py)
    bad = np.flatnonzero(crc32c_rows(as_bytes) != expected)
    if len(bad):
        check_record(values[int(bad[0])], expected[int(bad[0])], where(int(bad[0])), field)
    if combined:
        raise RuntimeError(f"{where(0)}: the batch CRC disagrees but no row's does; this is a bug in dali-pipes")
