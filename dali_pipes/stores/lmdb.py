"""LMDB shard reader, and the key layout shared with the writer.

Layout: one LMDB environment per shard, a single file (``subdir=False``), the
main (unnamed) database only. Every field of every sample is one record::

    b"0000000042/image"  -> the image's original bytes
    b"0000000042/label"  -> the raw little-endian bytes of the label array
    b"__len__"           -> the shard's sample count, ASCII decimal

The key is the sample's index in the shard, zero-padded to 10 digits, ``/``,
and the field name in UTF-8, so keys sort in write order (the writer appends
with ``MDB_APPEND``). Bytes fields hold their bytes; array fields the raw
array bytes of :mod:`dali_pipes.stores._codec` (dtype and shape come from the
manifest). Nothing is pickled. A user can read a shard with plain ``lmdb``
(in a process with no store open on it: py-lmdb opens a file once per process)::

    env = lmdb.open("shard-00000.lmdb", subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        jpeg = txn.get(b"0000000000/image")
"""

from __future__ import annotations

import os
import threading

import lmdb

from dali_pipes.stores._codec import array_from_bytes
from dali_pipes.stores.base import SampleDict, ShardReader, StoreError

#: Key of the sample-count record (sorts after every sample key).
LEN_KEY = b"__len__"


def sample_key(index: int, name: str) -> bytes:
    """The LMDB key of field ``name`` of local sample ``index``."""
    return b"%010d/%s" % (index, name.encode("utf-8"))


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
        self._envs: dict[tuple[int, int], list] = {}  # file id -> [pid, env, users]
        os.register_at_fork(after_in_child=self._reset_lock)

    def _reset_lock(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork

    def acquire(self, path: str | os.PathLike) -> tuple[tuple[int, int], lmdb.Environment]:
        """The environment of the shard at ``path`` (opened if needed) and the key to release it with."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise StoreError(f"{path}: LMDB shard file is missing") from None
        key = (st.st_dev, st.st_ino)
        with self._lock:
            entry = self._envs.get(key)
            if entry is not None and entry[0] == os.getpid():
                entry[2] += 1
                return key, entry[1]
            if entry is not None:
                # The parent's environment, copied by fork: close this process's copy of the map.
                entry[1].close()
                del self._envs[key]
            env = open_env(path)
            self._envs[key] = [os.getpid(), env, 1]
            return key, env

    def release(self, key: tuple[int, int], env: lmdb.Environment) -> None:
        """One user fewer of ``env``; the last one closes it."""
        with self._lock:
            entry = self._envs.get(key)
            if entry is None or entry[1] is not env or entry[0] != os.getpid():
                return
            entry[2] -= 1
            if entry[2] == 0:
                del self._envs[key]
                env.close()


_ENVS = _SharedEnvs()


class LmdbShardReader(ShardReader):
    """Random access to one LMDB shard (see the module docstring for the keys)."""

    format = "lmdb"

    def _open(self) -> None:
        key, env = _ENVS.acquire(self.path)
        try:
            with env.begin() as txn:
                stored = txn.get(LEN_KEY)
            if stored is None or stored != str(self.num_samples).encode():
                raise StoreError(
                    f"{self.path}: LMDB shard holds {stored.decode(errors='replace') if stored else 'no count of'} "
                    f"samples, the manifest says {self.num_samples}"
                )
        except lmdb.Error as exc:
            _ENVS.release(key, env)
            raise StoreError(f"{self.path}: cannot read the LMDB shard's sample count ({exc})") from exc
        except StoreError:
            _ENVS.release(key, env)
            raise
        self._h_env, self._h_key = env, key

    def _close_handles(self) -> None:
        env = self.__dict__.pop("_h_env", None)
        key = self.__dict__.pop("_h_key", None)
        if env is not None:
            _ENVS.release(key, env)

    def _forget_handles(self) -> None:
        # After fork the environment is the parent's; the shared table replaces it on the next open.
        self.__dict__.pop("_h_env", None)
        self.__dict__.pop("_h_key", None)

    def read(self, index: int) -> SampleDict:
        """The fields of local sample ``index``; :class:`StoreError` if a record is missing or damaged."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"{self.path}: record {index} out of range ({self.num_samples} samples)")
        self._ensure_open()
        where = f"{self.path}: record {index}"
        sample: SampleDict = {}
        try:
            # buffers=True: values are views into the map, copied exactly once below.
            with self._h_env.begin(buffers=True) as txn:
                for name, field in self.fields.items():
                    value = txn.get(sample_key(index, name))
                    if value is None:
                        raise StoreError(f"{where}: field {name!r} is missing (key {sample_key(index, name)!r})")
                    if field.kind == "bytes":
                        sample[name] = bytes(value)
                    else:
                        sample[name] = array_from_bytes(value, name, field, where)
        except lmdb.Error as exc:
            raise StoreError(f"{where}: LMDB read failed ({exc})") from exc
        return sample
