"""The CRC32C that a run of equal-length records must have, computed from the records' own CRCs.

A batch of small fixed-shape rows (feature vectors, labels) is checked with one
hardware CRC over the batch's bytes instead of one per row: CRC32C is linear, so
``crc(A || B) = Z_len(B)(crc(A)) ^ crc(B)``, where ``Z_n`` (the register fed ``n``
zero bytes) is a linear map of 32 bits (zlib's ``crc32_combine``). For rows
``r_0 .. r_{N-1}`` of ``L`` bytes each::

    crc(r_0 || ... || r_{N-1}) = XOR_i  Z_{(N-1-i) L}(crc(r_i))

Each ``Z_{k L}`` is held as four 256-entry byte tables (a 32x32 bit matrix
applied a byte at a time); ``k`` is split as ``q * INNER + r`` so that few tables
serve a block of ``BLOCK_ROWS`` rows, and a longer batch is folded block by block. What this detects is what a CRC32C of the concatenation detects:
every error of up to 32 bits in a row, every odd number of bit errors, and other
damage but for a 2**-32 chance; two rows damaged alike do not cancel, since
their errors sit at different shifts. A mismatch is then narrowed down to the
row by the per-row check, which names it.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["BLOCK_ROWS", "combined_crc"]

#: A row's shift is split in two lookups: within its group of INNER rows, then its group's among OUTER groups.
#: The tables per row length: (INNER + OUTER) x 4 x 256 uint32, 384 KiB, of which a batch touches the inner 128 KiB
#: and one outer entry per group; 32 row lengths are kept (a dataset's fields, a mixture's datasets).
INNER = 32
OUTER = 64
BLOCK_ROWS = INNER * OUTER
_POLY = 0x82F63B78  # CRC32C, reflected


def _byte_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
    return table


_BYTE = _byte_table()
#: The images of the 32 unit bits under the identity map.
_UNIT_BITS = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32))


def _apply(tables: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The linear map held as byte ``tables`` (shape ``[..., 4, 256]``) applied to ``values`` (uint32)."""
    return (
        tables[..., 0, :][..., values & 0xFF]
        ^ tables[..., 1, :][..., (values >> 8) & 0xFF]
        ^ tables[..., 2, :][..., (values >> 16) & 0xFF]
        ^ tables[..., 3, :][..., values >> 24]
    )


def _tables_of(images: np.ndarray) -> np.ndarray:
    """Byte tables ``[4, 256]`` of the linear map whose images of the 32 unit bits are ``images``."""
    bits = (np.arange(256, dtype=np.uint32)[:, None] >> np.arange(8, dtype=np.uint32)) & 1  # [256, 8]
    tables = np.zeros((4, 256), dtype=np.uint32)
    for k in range(4):
        for bit in range(8):
            tables[k] ^= np.where(bits[:, bit] == 1, images[8 * k + bit], np.uint32(0)).astype(np.uint32)
    return tables


def _zeros_map(n_bytes: int) -> np.ndarray:
    """Byte tables of ``Z_n``: the register fed ``n_bytes`` zero bytes (by squaring, O(log n) steps)."""
    result = _UNIT_BITS.copy()  # the identity
    step = (_UNIT_BITS >> 8) ^ _BYTE[_UNIT_BITS & 0xFF]  # one zero byte
    n = n_bytes
    while n:
        if n & 1:
            result = _apply(_tables_of(step), result)
        step = _apply(_tables_of(step), step)
        n >>= 1
    return _tables_of(result)


def _powers(step: np.ndarray, count: int) -> np.ndarray:
    """``[count, 4, 256]``: entry ``k`` holds the map ``step`` applied ``k`` times (entry 0: the identity)."""
    tables = np.empty((count, 4, 256), dtype=np.uint32)
    tables[0] = _tables_of(_UNIT_BITS)
    for k in range(1, count):
        tables[k] = _apply(step, tables[k - 1])
    tables.setflags(write=False)
    return tables


@lru_cache(maxsize=32)
def _shift_tables(row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """``Z_{r * row_bytes}`` for ``r < INNER`` and ``Z_{q * INNER * row_bytes}`` for ``q < OUTER``."""
    return _powers(_zeros_map(row_bytes), INNER), _powers(_zeros_map(row_bytes * INNER), OUTER)


def _gather(tables: np.ndarray, shifts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``tables[shifts[i]]`` applied to ``values[i]``, for each ``i``."""
    return (
        tables[shifts, 0, values & 0xFF]
        ^ tables[shifts, 1, (values >> 8) & 0xFF]
        ^ tables[shifts, 2, (values >> 16) & 0xFF]
        ^ tables[shifts, 3, values >> 24]
    )


def _block_crc(crcs: np.ndarray, row_bytes: int) -> int:
    """:func:`combined_crc` of at most ``BLOCK_ROWS`` rows: row ``i`` moves past the ``s = n - 1 - i`` rows after it,
    as ``Z_{(s // INNER) * INNER * L}`` of ``Z_{(s % INNER) * L}``: the inner maps per row, the outer per group."""
    inner, outer = _shift_tables(row_bytes)
    n = len(crcs)
    pad = -n % INNER  # zeros in front (a map of 0 is 0), so that the groups of INNER rows end with the last row
    shifts = np.arange(n + pad - 1, -1, -1) % INNER
    moved = _gather(inner, shifts[pad:], crcs)
    groups = np.bitwise_xor.reduce(np.concatenate([np.zeros(pad, np.uint32), moved]).reshape(-1, INNER), axis=1)
    return int(np.bitwise_xor.reduce(_gather(outer, np.arange(len(groups) - 1, -1, -1), groups)))


@lru_cache(maxsize=32)
def _block_shift(row_bytes: int, rows: int) -> np.ndarray:
    return _zeros_map(row_bytes * rows)


def combined_crc(crcs: np.ndarray, row_bytes: int) -> int:
    """The CRC32C of the concatenation of records of ``row_bytes`` bytes whose own CRC32Cs are ``crcs``."""
    crcs = np.asarray(crcs, dtype=np.uint32).reshape(-1)
    total = 0
    for lo in range(0, len(crcs), BLOCK_ROWS):
        block = crcs[lo : lo + BLOCK_ROWS]
        value = _block_crc(block, row_bytes)
        # The blocks before, moved past this one.
        total = (int(_apply(_block_shift(row_bytes, len(block)), np.uint32(total))) if lo else 0) ^ value
    return total
