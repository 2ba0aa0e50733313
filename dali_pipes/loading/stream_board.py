"""What a stream's reader processes and the loader's process tell each other, in shared memory.

With ``py_num_workers > 0`` the batches are read in DALI's reader processes, but the shards are pinned and
downloaded by the loader's process (:mod:`dali_pipes.loading.streaming`). A :class:`ReadBoard` is a small file in
``/dev/shm`` mapped by both sides:

- **ready** (a byte a shard): 1 while the loader's process holds the shard pinned to read and downloaded, 2 when
  its download failed (the error's text in the board), 0 otherwise. The loader's process clears a shard's byte
  *before* it unpins the shard, under the board's lock (below), so a reader that takes its shards as held while
  they read 1 holds shards that are present and stay so (:meth:`ReadBoard.hold`).
- **slots** (one a reader process, claimed with an ``flock`` held for the process's life): the batch the process
  reads now (its epoch, samples and padding flags), under a sequence number bumped at each post, and where it is
  with it: waiting for its shards, reading them (*holding*), or done. The loader's process watches them to know
  which windows to pin (:class:`~dali_pipes.loading.stream_readers.ReaderWatch`): the readers run ahead of the
  training loop by DALI's prefetch depth. Each slot also counts the seconds and batches its process waited for its
  shards (:meth:`ReadBoard.waits`, summed into the loader's ``cache.blocked_s``).

A reader's shards stay pinned while it reads them, by the loader's process, with no pin of the reader's own in the
cache's state (two file-locked updates of it a batch cost more than the read): under the board's lock
(:meth:`ReadBoard.locked`, an ``flock``) a reader takes its batch as *holding* only if each of its shards' bytes is
1, and the loader's process clears a shard's byte before it unpins it, then looks for readers holding it
(:meth:`ReadBoard.release`): those shards stay pinned until the readers are done with them. So a shard a reader
holds is pinned, and a reader process that dies holds nothing (its slot's ``flock`` ended with it).

Nothing here is pickled data read from a shard: the board holds integers only.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import shutil
import struct
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from dali_pipes.staging.tmpfs import OwnedFolder, writable_tmpfs

__all__ = ["BOARD_PREFIX", "DONE", "FAILED", "HOLDING", "NOT_READY", "READY", "WAITING", "Posted", "ReadBoard"]

#: The prefix of a board's folder (in ``/dev/shm`` where there is one).
BOARD_PREFIX = "dali-pipes-board-"

_HEADER = struct.Struct("<5q")  # shards, slots, capacity (samples a slot), error length, broken (1: see stop())
_ERROR_BYTES = 2048
_SLOT_HEAD = 7  # int64s before a slot's samples: sequence, epoch, samples, its step (below), its process id, and
# the nanoseconds and batches it waited for its shards
#: A shard's byte in ``ready``.
NOT_READY, READY, FAILED = 0, 1, 2
#: A slot's step with its batch: read, waiting for its shards, reading them (holding them: they stay pinned).
DONE, WAITING, HOLDING = 0, 1, 2


class Posted(NamedTuple):
    """A reader process's batch (under its slot's sequence number): its ``epoch``, samples and padding flags."""

    seq: int
    epoch: int
    indices: np.ndarray
    is_pad: np.ndarray
    waiting: bool
    slot: int
    holding: bool
    pid: int


class ReadBoard:
    """The shared board of one streamed loader (see the module docstring); made by the loader's process, attached
    by its reader processes when unpickled."""

    def __init__(self, shards: int, slots: int, capacity: int) -> None:
        if writable_tmpfs() is not None:  # removed after a SIGKILL too, by the next loader (as the epoch plans)
            folder = OwnedFolder(BOARD_PREFIX)
            self._remove: Any = folder.close
            self.path = str(folder.path / "board")
        else:
            made = tempfile.mkdtemp(prefix=BOARD_PREFIX)
            self._remove = weakref.finalize(self, shutil.rmtree, made, True)
            self.path = str(Path(made) / "board")
        size = _size(shards, slots, capacity)
        with open(self.path, "wb") as f:
            f.truncate(size)
            f.write(_HEADER.pack(shards, slots, capacity, 0, 0))
        self._attach()
        self.owner_pid = os.getpid()
        self._claimed: int | None = None

    def _attach(self) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.shards, self.slots, self.capacity, _, _ = _HEADER.unpack_from(self._map, 0)
        at = _HEADER.size + _ERROR_BYTES
        self._ready = np.frombuffer(self._map, dtype=np.uint8, count=self.shards, offset=at)
        at += -(-self.shards // 8) * 8
        width = _SLOT_HEAD + 2 * self.capacity
        self._slots = np.frombuffer(self._map, dtype=np.int64, count=self.slots * width, offset=at)
        self._slots = self._slots.reshape(self.slots, width)
        self._lock_pid: int | None = None
        self._lock_fd = -1
        self._lock_mutex = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "owner_pid": self.owner_pid}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.owner_pid = state["path"], state["owner_pid"]
        self._remove = None
        self._claimed = None
        self._attach()

    # --- the loader's process -----------------------------------------------------------------

    def mark(self, shard: int, state: int) -> None:
        """Set ``shard``'s byte (:data:`READY`, :data:`NOT_READY`)."""
        self._ready[shard] = state

    def fail(self, shard: int, message: str) -> None:
        """``shard``'s download failed with ``message``: the reader processes waiting for it raise it."""
        self._say(message)
        self._ready[shard] = FAILED

    def stop(self, message: str) -> None:
        """The loader's process can no longer serve its reader processes: each raises ``message`` at its next look."""
        self._say(message)
        struct.pack_into("<q", self._map, 32, 1)

    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return struct.unpack_from("<q", self._map, 32)[0] == 1

    def _say(self, message: str) -> None:
        data = message.encode("utf-8", "replace")[:_ERROR_BYTES]
        self._map[_HEADER.size : _HEADER.size + len(data)] = data
        struct.pack_into("<q", self._map, 24, len(data))

    def posted(self) -> list[Posted]:
        """Every slot's batch now (slots never posted to left out)."""
        out = []
        for slot in np.flatnonzero(self._slots[:, 0] > 0):
            row = np.array(self._slots[slot])  # a copy: a post may land meanwhile, seen at the next look
            seq, epoch, count, step, pid = (int(v) for v in row[:5])
            if 0 <= count <= self.capacity:
                samples = row[_SLOT_HEAD : _SLOT_HEAD + count]
                pads = row[_SLOT_HEAD + self.capacity : _SLOT_HEAD + self.capacity + count].astype(bool)
                out.append(Posted(seq, epoch, samples, pads, step == WAITING, int(slot), step == HOLDING, pid))
        return out

    def release(self, shards: list[int], shard_of: Callable[[np.ndarray], np.ndarray]) -> set[int]:
        """The loader's process lets go of ``shards``: their bytes cleared, under the board's lock; those a live reader
        process holds now, which must stay pinned until it is done (``shard_of`` maps its samples to shards)."""
        with self.locked():
            self._ready[shards] = NOT_READY
            held = self._held(shard_of).intersection(shards)
        if held and self._reap():  # a reader process that died holding its batch holds nothing
            with self.locked():
                held = self._held(shard_of).intersection(shards)
        return held

    def _held(self, shard_of: Callable[[np.ndarray], np.ndarray]) -> set[int]:
        """The shards of the batches reader processes hold now."""
        rows = np.flatnonzero(self._slots[:, 3] == HOLDING).tolist()
        return {k for slot in rows for k in shard_of(self._samples(slot)).tolist()}

    def _samples(self, slot: int) -> np.ndarray:
        count = min(max(int(self._slots[slot, 2]), 0), self.capacity)
        return np.array(self._slots[slot, _SLOT_HEAD : _SLOT_HEAD + count])

    def _reap(self) -> bool:
        """Mark done the batches held by reader processes that ended (a slot's ``flock`` ends with its process);
        whether there was one. The mark is written while this process holds the slot's lock: a new process cannot
        claim the slot meanwhile."""
        reaped = False
        for slot in np.flatnonzero(self._slots[:, 3] == HOLDING).tolist():
            try:
                fd = os.open(f"{self.path}.slot{slot}", os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._slots[slot, 3] = DONE
                reaped = True
            except OSError:
                pass  # alive
            finally:
                os.close(fd)  # the lock, if taken, ends here
        return reaped

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The board's lock (an ``flock``, one descriptor a process): a reader taking its shards as held and the
        loader's process clearing a shard's byte never interleave."""
        if self._lock_pid != os.getpid():  # a forked child shares its parent's open file (and so its flock) and
            # the parent's mutex as it was at the fork (taken, if another thread held the lock then)
            self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._lock_mutex = threading.Lock()
            self._lock_pid = os.getpid()
        with self._lock_mutex:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def seen(self) -> tuple[int, ...]:
        """Each slot's sequence and waiting flag, a cheap look for a change."""
        return tuple(self._slots[:, [0, 3]].ravel().tolist())

    def close(self) -> None:
        """Remove the board's file (the loader's process, at its close)."""
        if self._remove is not None and os.getpid() == self.owner_pid:
            self._remove()

    # --- a reader process -----------------------------------------------------------------------

    def post(self, epoch: int, indices: np.ndarray, is_pad: np.ndarray) -> None:
        """This process reads a batch of ``epoch``: ``indices`` (``is_pad``)."""
        slot, count = self._slot(), len(indices)
        if count > self.capacity:
            raise ValueError(f"{self.path}: a batch of {count} samples, more than the board's {self.capacity}")
        row = self._slots[slot]
        row[_SLOT_HEAD : _SLOT_HEAD + count] = indices[:count]
        row[_SLOT_HEAD + self.capacity : _SLOT_HEAD + self.capacity + count] = np.asarray(is_pad[:count], dtype=bool)
        row[1:4] = (epoch, count, WAITING)
        row[0] += 1  # last: the loader's process reads the sequence to see a new post

    def hold(self, shards: list[int]) -> bool:
        """Take this process's posted batch as held, if each of its ``shards`` is ready (under the board's lock: see
        the module docstring); ``False`` when one is not (it waits for it again)."""
        with self.locked():
            if not all(self._ready[k] == READY for k in shards):
                return False
            self._slots[self._slot(), 3] = HOLDING
            return True

    def done(self) -> None:
        """This process read its batch: the loader's process may let go of its shards."""
        self._slots[self._slot(), 3] = DONE

    def waited(self, seconds: float) -> None:
        """This process waited ``seconds`` for its batch's shards (counted in :meth:`waits`)."""
        row = self._slots[self._slot()]
        row[5] += int(seconds * 1e9)
        row[6] += 1

    def waits(self) -> tuple[float, int]:
        """``(seconds, batches)`` the reader processes waited for their shards, all together."""
        return float(self._slots[:, 5].sum()) / 1e9, int(self._slots[:, 6].sum())

    def ready(self, shard: int) -> int:
        """``shard``'s byte: :data:`READY`, :data:`FAILED` or :data:`NOT_READY`."""
        return int(self._ready[shard])

    def error(self) -> str:
        """The message of the last failed download (:meth:`fail`)."""
        (length,) = struct.unpack_from("<q", self._map, 24)
        return bytes(self._map[_HEADER.size : _HEADER.size + length]).decode("utf-8", "replace")

    def _slot(self) -> int:
        """This process's slot, claimed at its first post with an ``flock`` held until it ends."""
        if self._claimed is None:
            for slot in range(self.slots):
                fd = os.open(f"{self.path}.slot{slot}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self._claimed = slot  # the descriptor stays open: the lock ends with the process
                self._slots[slot, 0] = 0  # its waits stay: a process that takes a dead one's slot adds to them
                self._slots[slot, 4] = os.getpid()
                break
            else:
                raise RuntimeError(f"{self.path}: more reader processes than the {self.slots} slots of the board")
        return self._claimed


def _size(shards: int, slots: int, capacity: int) -> int:
    return _HEADER.size + _ERROR_BYTES + -(-shards // 8) * 8 + slots * (_SLOT_HEAD + 2 * capacity) * 8
