"""Finding a repeated key among millions, with memory that does not grow with their number.

A set of 100 million keys would take gigabytes. Instead each key's 64-bit hash goes to one of
:data:`BUCKETS` buckets (spilled to a temporary file once its buffer is full); each bucket is then
sorted on its own, so at most one bucket's hashes (1/64 of 8 bytes a key) are in memory at a time.
Equal keys have equal hashes, so no repeat is missed; hashes that repeat are only candidates (two
keys may share a hash), which the caller confirms with a second pass over those keys alone.
"""

from __future__ import annotations

import os
import tempfile
from array import array

import numpy as np

#: Buckets the hashes are spread over; a bucket's buffer is spilled at :data:`SPILL` hashes.
BUCKETS = 64
SPILL = 8192


class RepeatedHashes:
    """Collects the hashes of keys (:meth:`add`) and says which occur more than once (:meth:`repeated`).

    Python's ``hash`` of a string is salted per process, so all adds and the confirmation pass happen in
    one process (the conversion's parent). Temporary files live in the system's temporary folder and are
    removed by :meth:`repeated` (or :meth:`close`).
    """

    def __init__(self) -> None:
        self._buffers = [array("q") for _ in range(BUCKETS)]
        self._folder: tempfile.TemporaryDirectory | None = None

    def add(self, key: str) -> None:
        value = hash(key)
        bucket = self._buffers[value % BUCKETS]
        bucket.append(value)
        if len(bucket) >= SPILL:
            self._spill(value % BUCKETS)

    def _spill(self, index: int) -> None:
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="dali-pipes-keys-")
        with open(self._path(index), "ab") as f:
            self._buffers[index].tofile(f)
        self._buffers[index] = array("q")

    def _path(self, index: int) -> str:
        assert self._folder is not None
        return os.path.join(self._folder.name, f"bucket-{index:02d}")

    def repeated(self) -> set[int]:
        """The hashes added more than once (usually none); the temporary files are removed."""
        found: set[int] = set()
        try:
            for index, buffer in enumerate(self._buffers):
                values = np.frombuffer(buffer, dtype=np.int64)
                if self._folder is not None and os.path.exists(self._path(index)):
                    values = np.concatenate([np.fromfile(self._path(index), dtype=np.int64), values])
                values = np.sort(values)
                found.update(int(v) for v in values[1:][values[1:] == values[:-1]])
                self._buffers[index] = array("q")
        finally:
            self.close()
        return found

    def close(self) -> None:
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
