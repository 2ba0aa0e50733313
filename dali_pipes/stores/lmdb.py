"""LMDB shard reader. The record layout it reads is :mod:`dali_pipes.stores.lmdb_layout`."""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Iterable

import lmdb
import numpy as np

from dali_pipes.stores.base import BatchDict, SampleDict, ShardReader, StoreError, packed
from dali_pipes.stores.lmdb_layout import (
    CRC_DTYPE,
    LEN_KEY,
    array_from_bytes,
    check_record,
    check_records,
    check_rows,
    crc_key,
    little_endian,
    sample_key,
)


def open_env(path: str | os.PathLike) -> lmdb.Environment:
    """Open a shard read-only, without a lock file, refusing a truncated file.

    LMDB maps the file and trusts its meta page; reading a page past the end of
    a truncated file would kill the process with SIGBUS, so the size is checked
    against the last page the meta page names before any record is read.
    """
    if not os.path.isfile(path):
        raise StoreError(f"{path}: LMDB shard file is missing")
    try:
        env = lmdb.open(os.fspath(path), subdir=False, readonly=True, lock=False, readahead=False, max_dbs=0)
    except lmdb.Error as exc:
        raise StoreError(f"{path}: cannot open LMDB shard ({exc})") from exc
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.path.getsize(path)
    if size < needed:
        env.close()
        raise StoreError(f"{path}: LMDB shard is truncated ({size} bytes, its pages need {needed})")
    return env


@dataclass
class _OpenShard:
    """A shard's environment in this process, with what guards its memory map.

    ``fd`` is a descriptor of the very file LMDB mapped (checked by device and
    inode), ``size`` that file's size when the environment was opened and its
    pages checked (:func:`open_env`).
    """

    env: lmdb.Environment
    fd: int
    size: int
    pid: int
    users: int = 1

    def close(self) -> None:
        self.env.close()
        os.close(self.fd)


class _SharedEnvs:
    """One read-only environment per shard file per process, shared by every reader of that file.

    py-lmdb refuses to open one file twice in a process (LMDB's fcntl locks are
    per process and file), so two stores over one dataset, or a store and
    ``verify``, must share the environment. Entries are counted by user and
    closed with the last one; an entry inherited through fork belongs to the
    parent and is replaced, never shared, in the child.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._envs: dict[tuple[int, int], _OpenShard] = {}  # file id (device, inode) -> its environment
        os.register_at_fork(after_in_child=self._reset_lock)

    def _reset_lock(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork

    def acquire(self, path: str | os.PathLike) -> tuple[tuple[int, int], _OpenShard]:
        """The open shard at ``path`` (opened if needed) and the key to release it with."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise StoreError(f"{path}: LMDB shard file is missing") from None
        key = (st.st_dev, st.st_ino)
        with self._lock:
            entry = self._envs.get(key)
            if entry is not None and entry.pid == os.getpid():
                entry.users += 1
                return key, entry
            if entry is not None:
                # The parent's, copied by fork: close this process's copies of the map and descriptor.
                entry.close()
                del self._envs[key]
            entry = _open_shard(path, key)
            self._envs[key] = entry
            return key, entry

    def release(self, key: tuple[int, int], entry: _OpenShard) -> None:
        """One user fewer of ``entry``; the last one closes it."""
        with self._lock:
            if self._envs.get(key) is not entry or entry.pid != os.getpid():
                return
            entry.users -= 1
            if entry.users == 0:
                del self._envs[key]
                entry.close()


def _open_shard(path: str | os.PathLike, key: tuple[int, int]) -> _OpenShard:
    """Open the environment of the file ``key`` names, with a descriptor of that file kept beside it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StoreError(f"{path}: LMDB shard file is missing") from None
    try:
        env = open_env(path)
        try:
            st = os.fstat(fd)
            # The map must be of the file the descriptor watches: refuse one renamed into place meanwhile.
            now = os.stat(path)
            if (st.st_dev, st.st_ino) != key or (now.st_dev, now.st_ino) != key:
                raise StoreError(f"{path}: LMDB shard file was replaced while it was being opened; open it again")
            # open_env checked the size by path; this size is the reads' baseline, so check it again.
            needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            if st.st_size < needed:
                raise StoreError(f"{path}: LMDB shard is truncated ({st.st_size} bytes, its pages need {needed})")
        except BaseException:
            env.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    return _OpenShard(env=env, fd=fd, size=st.st_size, pid=os.getpid())


_ENVS = _SharedEnvs()


class LmdbShardReader(ShardReader):
    """Random access to one LMDB shard (see the module docstring for the keys)."""

    format = "lmdb"
    cheap_batch_reads = True  # records copied straight out of LMDB's map (see read_batch)

    def _open(self) -> None:
        key, shard = _ENVS.acquire(self.path)
        try:
            with shard.env.begin() as txn:
                stored = txn.get(LEN_KEY)
            if stored is None or stored != str(self.num_samples).encode():
                raise StoreError(
                    f"{self.path}: LMDB shard holds {stored.decode(errors='replace') if stored else 'no count of'} "
                    f"samples, the manifest says {self.num_samples}"
                )
        except lmdb.Error as exc:
            _ENVS.release(key, shard)
            raise StoreError(f"{self.path}: cannot read the LMDB shard's sample count ({exc})") from exc
        except StoreError:
            _ENVS.release(key, shard)
            raise
        self._h_shard, self._h_key = shard, key

    def _close_handles(self) -> None:
        shard = self.__dict__.pop("_h_shard", None)
        key = self.__dict__.pop("_h_key", None)
        if shard is not None:
            _ENVS.release(key, shard)

    def _forget_handles(self) -> None:
        # After fork the environment is the parent's; the shared table replaces it on the next open.
        self.__dict__.pop("_h_shard", None)
        self.__dict__.pop("_h_key", None)

    def _check_not_shrunk(self, shard: _OpenShard, where: str) -> None:
        """Refuse to touch the map of a file that became shorter than it was when it was mapped.

        LMDB reads records straight from its memory map: a page past the end of a
        file truncated while it is open is not an error but SIGBUS, which kills this
        process (or a DALI worker) with nothing said. One fstat per read, about a
        microsecond, catches a truncation that happened before this read started.
        It narrows the race but cannot close it: a truncation between this check and
        the copy out of the map below still ends in SIGBUS. Only rewriting shards by
        renaming a new file into place, never in place, is safe while they are read.
        """
        size = os.fstat(shard.fd).st_size
        if size < shard.size:
            raise StoreError(
                f"{where}: the LMDB shard shrank from {shard.size} to {size} bytes while it was open "
                "(truncated or rewritten in place); not read, since reading past its new end would kill "
                "the process (SIGBUS)"
            )

    def read(self, index: int, fields: Iterable[str] | None = None) -> SampleDict:
        """The fields of local sample ``index`` (only ``fields`` if given).

        Each field is its own key, so the fields not asked for are never looked up.
        Raises :class:`StoreError` if a record asked for is missing or damaged.
        """
        selected = self._selected(fields)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"{self.path}: record {index} out of range ({self.num_samples} samples)")
        self._ensure_open()
        where = f"{self.path}: record {index}"
        shard = self._h_shard
        self._check_not_shrunk(shard, where)
        sample: SampleDict = {}
        try:
            # buffers=True: values are views into the map, copied exactly once below.
            with shard.env.begin(buffers=True) as txn:
                crcs = self._stored_crcs(txn, index, where) if self.record_crc else None
                for name, field in selected.items():
                    value = txn.get(sample_key(index, name))
                    if value is None:
                        raise StoreError(f"{where}: field {name!r} is missing (key {sample_key(index, name)!r})")
                    crc = None if crcs is None else crcs[self.crc_column[name]]
                    sample[name] = self._record_value(value, name, field, where, crc)
        except lmdb.Error as exc:
            raise StoreError(f"{where}: LMDB read failed ({exc})") from exc
        return sample

    def _stored_crcs(self, txn: lmdb.Transaction, index: int, where: str) -> np.ndarray:
        """The CRC32C of each field of local sample ``index``, as written (fields in ``crc_order``)."""
        return self._parse_crcs(txn.get(crc_key(index)), index, where)

    def _parse_crcs(self, stored: bytes | memoryview | None, index: int, where: str) -> np.ndarray:
        if stored is None or len(stored) != CRC_DTYPE.itemsize * len(self.fields):
            raise StoreError(
                f"{where}: its record CRCs (key {crc_key(index)!r}) are "
                f"{'missing' if stored is None else 'damaged'}, though the manifest says the dataset has them"
            )
        return np.frombuffer(stored, dtype=CRC_DTYPE).copy()  # a copy: the map's buffer ends with the txn

    def _batch_crcs(self, cursor: lmdb.Cursor, rows: list[int]) -> np.ndarray | None:
        """The stored CRCs of local samples ``rows`` (sorted), one row each; None for a dataset without them."""
        if not self.record_crc:
            return None
        found = cursor.getmulti([crc_key(row) for row in rows])
        size = CRC_DTYPE.itemsize * len(self.fields)
        if len(found) == len(rows) and all(len(value) == size for _, value in found):
            # Every record there and whole (the keys come back in the order asked): parsed at once.
            return np.frombuffer(b"".join(value for _, value in found), dtype=CRC_DTYPE).reshape(len(rows), -1)
        by_key = {bytes(key): value for key, value in found}  # one is missing or damaged: name it
        return np.stack([self._parse_crcs(by_key.get(crc_key(row)), row, f"{self.path}: record {row}") for row in rows])

    def _record_value(self, value: bytes | memoryview, name: str, field, where: str, crc=None):
        """One record's stored bytes -> the field's value (bytes, or its array), checked against ``crc``.

        Both :meth:`read` and :meth:`read_batch` pass each record through here
        (fixed-shape arrays in a batch through :meth:`_fixed_values`).
        """
        raw = bytes(value) if field.kind == "bytes" else value  # bytes: the one copy out of the map
        if crc is not None:
            check_record(raw, crc, where, name)
        if field.kind == "bytes":
            return raw
        return array_from_bytes(raw, name, field, where)

    def _packed_records(self, rows: list[int], order: list[int], found: list, name: str, crcs) -> list[np.ndarray]:
        """A bytes field's records (``found``, in ``rows`` order) checked, then copied out of the map into one buffer.

        Called inside the transaction, which keeps the map's views valid for the one copy.
        """
        records = [np.frombuffer(value, dtype=np.uint8) for _, value in found]
        if crcs is not None:
            check_records(records, crcs[:, self.crc_column[name]], lambda k: f"{self.path}: record {rows[k]}", name)
        values = packed(records)
        return [values[k] for k in order]

    def _fixed_values(self, rows: list[int], found: list, name: str, field, crcs: np.ndarray | None) -> np.ndarray:
        """The records of a fixed-shape array field as one ``(len(rows), *shape)`` array, one decode for all."""
        dtype = np.dtype(field.dtype)
        size = dtype.itemsize * math.prod(field.shape or ())
        payloads = []
        for k, (row, (_, value)) in enumerate(zip(rows, found)):
            if len(value) != size:  # the one-record decode names what is wrong with it (after its CRC)
                where = f"{self.path}: record {row}"
                if crcs is not None:
                    check_record(value, crcs[k, self.crc_column[name]], where, name)
                array_from_bytes(value, name, field, where)
            payloads.append(value)
        stored = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(len(rows), size)
        if crcs is not None:  # every row's CRC at once, over the bytes as stored
            check_rows(stored, crcs[:, self.crc_column[name]], lambda k: f"{self.path}: record {rows[k]}", name)
        flat = stored.reshape(-1).view(little_endian(dtype))
        return flat.astype(dtype).reshape(len(rows), *(field.shape or ()))

    def read_batch(
        self, indices: np.ndarray, fields: Iterable[str] | None = None, *, arrays: bool = False
    ) -> BatchDict:
        """The fields of the local samples ``indices`` (see :meth:`ShardReader.read_batch`).

        One transaction and one cursor: the distinct keys are fetched in key order
        (``Cursor.getmulti``), each record checked against its CRC and decoded.
        With ``arrays``, a bytes field's records are copied out of the map together,
        into one buffer (:func:`~dali_pipes.stores.base.packed`), instead of one
        ``bytes`` object each.
        """
        selected, indices = self._batch_request(indices, fields)
        shard = self._h_shard
        self._check_not_shrunk(shard, f"{self.path}: records {indices.tolist()}")
        rows, inverse = np.unique(indices, return_inverse=True)
        rows_list, order = rows.tolist(), inverse.tolist()
        batch: BatchDict = {}
        try:
            with shard.env.begin(buffers=True) as txn:
                cursor = txn.cursor()
                crcs = self._batch_crcs(cursor, rows_list)
                for name, field in selected.items():
                    keys = [sample_key(row, name) for row in rows_list]
                    found = cursor.getmulti(keys)
                    if len(found) != len(keys):
                        have = {bytes(key) for key, _ in found}
                        row = next(r for r, key in zip(rows_list, keys) if key not in have)
                        raise StoreError(
                            f"{self.path}: record {row}: field {name!r} is missing (key {sample_key(row, name)!r})"
                        )
                    if field.kind == "array" and not field.variable_length:
                        batch[name] = self._fixed_values(rows_list, found, name, field, crcs)[inverse]
                        continue
                    if arrays and field.kind == "bytes":
                        batch[name] = self._packed_records(rows_list, order, found, name, crcs)
                        continue
                    values = [
                        self._record_value(
                            value,
                            name,
                            field,
                            f"{self.path}: record {row}",
                            None if crcs is None else crcs[k, self.crc_column[name]],
                        )
                        for k, (row, (_, value)) in enumerate(zip(rows_list, found))
                    ]
                    batch[name] = [values[k] for k in order]
        except lmdb.Error as exc:
            raise StoreError(f"{self.path}: records {rows_list}: LMDB read failed ({exc})") from exc
        return batch
