"""TFRecord shard reader: random access through DALI's ``.idx`` index.

Each read seeks to the record the index names, checks the length and data CRCs
(cheap next to decoding an image, and the only integrity check TFRecord has),
and decodes the ``tf.train.Example`` (:mod:`dali_pipes.stores.tfexample`). A read
of some fields still reads and checks the whole record (the CRC covers all of
it), but decodes only the features of those fields.
Without an index the reader builds one by walking the record headers once.
"""

from __future__ import annotations

import os
import struct
from typing import Callable, Iterable, Iterator

import numpy as np

from dali_pipes.stores.base import BatchDict, SampleDict, ShardReader, StoreError, as_arrays
from dali_pipes.stores.tfexample import FOOTER_SIZE, HEADER_SIZE, decode_sample, masked_crc32c, parse_index, unframe


def walk_records(fd: int, path: str | os.PathLike) -> Iterator[tuple[int, int]]:
    """``(offset, size)`` of each record of a TFRecord file, from its headers (length CRCs checked).

    Raises :class:`StoreError` naming the record and byte where the file is damaged
    or truncated, after yielding every whole record before it.
    """
    return walk_record_headers(lambda offset, size: os.pread(fd, size, offset), os.fstat(fd).st_size, path)


def walk_record_headers(
    pread: Callable[[int, int], bytes], end: int, path: str | os.PathLike, start: int = 0, number: int = 0
) -> Iterator[tuple[int, int]]:
    """:func:`walk_records` over any reader: ``pread(offset, size)`` bytes of a file of ``end`` bytes
    (a local descriptor, or a remote object read in order through a buffer), from record ``number`` at byte
    ``start`` on (the first by default)."""
    offset = start
    while offset < end:
        head = pread(offset, HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            raise StoreError(f"{path}: record {number} at byte {offset}: truncated header")
        (length,) = struct.unpack_from("<Q", head)
        if masked_crc32c(head[:8]) != struct.unpack_from("<I", head, 8)[0]:
            raise StoreError(f"{path}: record {number} at byte {offset}: length CRC mismatch")
        size = HEADER_SIZE + length + FOOTER_SIZE
        if offset + size > end:
            raise StoreError(f"{path}: record {number} at byte {offset} runs past the end of the file (truncated)")
        yield offset, size
        offset += size
        number += 1


def scan_index(fd: int, path: str | os.PathLike) -> np.ndarray:
    """Build the ``(n, 2)`` ``(offset, size)`` index of a TFRecord file by walking its headers."""
    return np.array(list(walk_records(fd, path)), dtype=np.int64).reshape(-1, 2)


class TFRecordShardReader(ShardReader):
    """Random access to one TFRecord shard, with its DALI ``.idx`` file when there is one."""

    format = "tfrecord"

    def _open(self) -> None:
        if not self.path.is_file():
            raise StoreError(f"{self.path}: TFRecord shard file is missing")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            index = self._load_index(fd)
        except BaseException:
            os.close(fd)
            raise
        self._h_fd = fd
        self._h_index = index

    def _load_index(self, fd: int) -> np.ndarray:
        if self.index_path is None:
            index = scan_index(fd, self.path)
        else:
            try:
                text = self.index_path.read_text(encoding="ascii")
            except FileNotFoundError as exc:
                raise StoreError(f"{self.index_path}: index file of TFRecord shard {self.path} is missing") from exc
            except (OSError, UnicodeDecodeError) as exc:
                raise StoreError(f"{self.index_path}: cannot read TFRecord index ({exc})") from exc
            index = parse_index(text, str(self.index_path))
        if len(index) != self.num_samples:
            raise StoreError(f"{self.path}: index lists {len(index)} records, the manifest says {self.num_samples}")
        size = os.fstat(fd).st_size
        if len(index) and int(index[-1].sum()) > size:
            raise StoreError(
                f"{self.path}: TFRecord shard is truncated ({size} bytes; its last record ends at {int(index[-1].sum())})"
            )
        return index

    def _close_handles(self) -> None:
        self.__dict__.pop("_h_index", None)
        fd = self.__dict__.pop("_h_fd", None)
        if fd is not None:
            os.close(fd)

    def read(self, index: int, fields: Iterable[str] | None = None) -> SampleDict:
        """The fields of local sample ``index`` (only ``fields`` if given).

        The whole record is read and CRC-checked either way; only the features of
        the fields asked for are decoded. Raises :class:`StoreError` on a short
        read, a bad CRC or a bad Example.
        """
        selected = self._selected(fields)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"{self.path}: record {index} out of range ({self.num_samples} samples)")
        self._ensure_open()
        offset, size = (int(v) for v in self._h_index[index])
        where = f"{self.path}: record {index} (byte {offset})"
        return self._decode_record(selected, self._pread(offset, size, where), where)

    def _pread(self, offset: int, size: int, where: str) -> bytes:
        try:
            data = os.pread(self._h_fd, size, offset)
        except OSError as exc:
            raise StoreError(f"{where}: read failed ({exc})") from exc
        if len(data) != size:
            raise StoreError(f"{where}: got {len(data)} of {size} bytes (truncated file)")
        return data

    @staticmethod
    def _decode_record(selected, record: bytes | memoryview, where: str) -> SampleDict:
        """One whole record -> its sample, CRCs checked: the per-record step of :meth:`read` and :meth:`read_batch`."""
        return decode_sample(selected, unframe(record, where), where)

    def read_batch(
        self, indices: np.ndarray, fields: Iterable[str] | None = None, *, arrays: bool = False
    ) -> BatchDict:
        """The fields of the local samples ``indices`` (see :meth:`ShardReader.read_batch`).

        The distinct records are read in file order, each run of adjacent records
        with one ``pread``, and each record checked and decoded on its own.
        ``arrays``: bytes fields as ``uint8`` arrays over the decoded bytes.
        """
        selected, indices = self._batch_request(indices, fields)
        rows, inverse = np.unique(indices, return_inverse=True)
        spans = self._h_index[rows]
        # A new run starts where a record does not begin exactly where the previous one ended.
        starts = np.flatnonzero(np.r_[True, spans[1:, 0] != spans[:-1, 0] + spans[:-1, 1]])
        samples: list[SampleDict] = []
        for lo, hi in zip(starts.tolist(), np.r_[starts[1:], len(rows)].tolist()):
            first = int(spans[lo, 0])
            run = self._pread(first, int(spans[hi - 1].sum()) - first, f"{self.path}: record {rows[lo]}")
            for k in range(lo, hi):
                offset, size = int(spans[k, 0]) - first, int(spans[k, 1])
                where = f"{self.path}: record {rows[k]} (byte {int(spans[k, 0])})"
                samples.append(self._decode_record(selected, run[offset : offset + size], where))
        batch: BatchDict = {name: [samples[k][name] for k in inverse.tolist()] for name in selected}
        return as_arrays(batch, self.fields) if arrays else batch
