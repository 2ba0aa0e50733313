"""LMDB shard writer: one single-file environment per shard, one record per field per sample.

The key layout is documented in :mod:`dali_pipes.stores.lmdb`. Records are
appended in key order (``MDB_APPEND``: packed pages, no page splits) and
committed in batches. The map starts small and doubles whenever LMDB reports it
full; the batch is then replayed, so a full map is never the user's problem.

The file is reproducible: the same samples give the same bytes, because the
commit points depend only on the data, pages are zero-initialised
(``meminit``), and no lock file or reader table exists (``lock=False``; the
writer is the only user of the file until it is renamed into place).

A full disk: LMDB writes a transaction's pages with ``pwrite`` and turns a short
write, which is what a full disk or a file-size limit gives, into ``EIO``
(``mdb_txn_commit: Input/output error``). So when a commit fails, the writer asks
the file system whether the file can still grow by the batch's size
(``posix_fallocate``), and raises the ``OSError`` that says why not (``ENOSPC``,
``EDQUOT``, ``EFBIG``); a failure with room to spare stays LMDB's own error.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

import lmdb

from converters.base import Sample, ShardWriter
from converters.diskfull import DISK_FULL_ERRNOS
from converters.writers._sample import check_fields, normalize_sample
from dali_pipes.dataset.manifest import Field
from dali_pipes.stores.lmdb_layout import LEN_KEY, array_to_bytes, crc_key, sample_crcs, sample_key

log = logging.getLogger(__name__)

#: The initial map size; it doubles as needed. Only address space, not disk: the file grows with its pages.
DEFAULT_MAP_SIZE = 64 << 20
#: A batch is committed once it holds this many bytes of values or this many samples.
COMMIT_BYTES = 64 << 20
COMMIT_SAMPLES = 1024


class LmdbShardWriter(ShardWriter):
    """Writes one ``.lmdb`` shard file (no lock file, nothing else next to it)."""

    format = "lmdb"
    suffix = ".lmdb"

    def __init__(
        self, path: str | os.PathLike, fields: Mapping[str, Field], *, map_size: int = DEFAULT_MAP_SIZE
    ) -> None:
        super().__init__(path, fields)
        check_fields(self.fields, str(self.path))
        # Keys within a sample must ascend for MDB_APPEND: fields in byte order of their names.
        self._order = sorted(self.fields, key=lambda name: name.encode("utf-8"))
        self._env = lmdb.open(
            os.fspath(self.path),
            map_size=map_size,
            subdir=False,
            lock=False,
            readahead=False,
            meminit=True,
            sync=False,  # one fsync at close, not one per batch
            metasync=False,
            max_dbs=0,
            mode=0o644,
        )
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._pending_samples = 0

    def write(self, sample: Sample) -> None:
        """Append one sample (committed with its batch)."""
        where = f"{self.path}: sample {self.num_samples}"
        values = normalize_sample(self.fields, sample, where)
        # The CRCs first: their key sorts before the sample's fields ('.' < '/').
        crcs = sample_crcs(values).tobytes()
        self._pending.append((crc_key(self.num_samples), crcs))
        self._pending_bytes += len(crcs)
        for name in self._order:
            value = values[name]
            data = value if isinstance(value, bytes) else array_to_bytes(value)
            self._pending.append((sample_key(self.num_samples, name), data))
            self._pending_bytes += len(data)
        self.num_samples += 1
        self._pending_samples += 1
        if self._pending_bytes >= COMMIT_BYTES or self._pending_samples >= COMMIT_SAMPLES:
            self._commit()

    def _commit(self) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value, append=True)
                break
            except lmdb.MapFullError:
                # The transaction was aborted; grow the map and replay the whole batch.
                size = self._env.info()["map_size"] * 2
                log.debug("%s: LMDB map full, growing it to %d bytes", self.path, size)
                self._env.set_mapsize(size)
            except lmdb.Error as exc:
                raise self._explain(exc, self._pending_bytes) from exc
        self._drop_mapped_pages()
        self._pending.clear()
        self._pending_bytes = 0
        self._pending_samples = 0

    def _drop_mapped_pages(self) -> None:
        """Map the file anew, so that the pages LMDB read through its map since the last commit leave this process.

        Without it the writer's resident memory would grow with the shard: every page LMDB reads back while
        appending stays mapped until the map is replaced. Setting the map to its current size replaces it
        (``mdb_env_set_mapsize`` unmaps and maps again between transactions); the file's bytes are the same
        either way (tested).
        """
        self._env.set_mapsize(self._env.info()["map_size"])

    def close(self) -> None:
        """Commit the last batch and the sample count, fsync, and close the environment."""
        if self._env is None:
            return
        self._pending.append((LEN_KEY, str(self.num_samples).encode()))
        self._commit()
        try:
            self._env.sync(True)
        except lmdb.Error as exc:
            raise self._explain(exc, 0) from exc
        self._env.close()
        self._env = None

    def abort(self) -> None:
        """Close without committing the pending batch; the runner removes the file."""
        if self._env is not None:
            self._env.close()
            self._env = None

    def _explain(self, exc: lmdb.Error, needed: int) -> Exception:
        """The error to raise for a failed commit or sync: an ``OSError`` when the file cannot grow, else ``exc``."""
        # At least one page: after a short write even that no longer fits on a full disk.
        room = no_room(self.path, max(needed, 1 << 16))
        if room is None:
            return exc
        return OSError(room.errno, f"{room.strerror} (LMDB reported: {exc})", str(self.path))


def no_room(path: str | os.PathLike, needed: int) -> OSError | None:
    """Whether the file at ``path`` can grow by ``needed`` bytes now.

    Returns the ``OSError`` (``ENOSPC``, ``EDQUOT`` or ``EFBIG``) that says why not,
    or ``None`` when it can or when the file system cannot tell. The file is
    extended (by ``posix_fallocate``) when there is room: call this only on a file
    that is being discarded.
    """
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, os.fstat(fd).st_size, needed)
    except OSError as exc:
        return exc if exc.errno in DISK_FULL_ERRNOS else None
    finally:
        os.close(fd)
    return None
