"""The file under an HDF5 shard: HDF5 never sees a failed write, so a full disk cannot crash it.

Why: when a write fails (``ENOSPC`` on a full disk, ``EFBIG`` at a file-size limit),
HDF5 1.14 under h5py 3.x is left in a state where closing the file raises from
object destructors ("Can't decrement id ref count") and then, often, crashes the
process with a segmentation fault; there is no way to close such a file cleanly.

So the HDF5 writers hand h5py this Python file object (h5py's ``fileobj``
driver) instead of a path. Its first failed write is recorded, not reported:
HDF5 is told every write succeeded, and later writes are dropped, so the
library always closes the file normally. The writer then raises the recorded
``OSError`` (with its ``errno``), and the runner removes the useless file. The
writer must stop feeding data once :attr:`GuardedFile.error` is set: what HDF5
believes it wrote is not on disk.
"""

from __future__ import annotations

import io
import os
from typing import Any


class GuardedFile(io.RawIOBase):
    """An unbuffered read-write file that records its first failed write instead of raising it."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self._raw = open(self.path, "w+b", buffering=0)  # noqa: SIM115 - closed by close()
        #: The first write (or truncate) that failed; ``None`` while every write reached the file.
        self.error: OSError | None = None

    def check(self) -> None:
        """Raise the first failed write: what HDF5 believes it wrote since then is not in the file."""
        if self.error is not None:
            raise OSError(self.error.errno, self.error.strerror, self.path) from self.error

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readinto(self, buffer: Any) -> int:
        return self._raw.readinto(buffer)

    def write(self, data: Any) -> int:
        """Write all of ``data``; after a failure, pretend to (HDF5 must not see the error)."""
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                done = 0
                while done < len(view):  # a raw write may be short
                    done += self._raw.write(view[done:])
            except OSError as exc:
                self.error = exc
        return len(view)

    def truncate(self, size: int | None = None) -> int:
        if self.error is None:
            try:
                return self._raw.truncate(size)
            except OSError as exc:
                self.error = exc
        return self.tell() if size is None else size

    def flush(self) -> None:
        """Nothing is buffered here; :meth:`fsync` makes the bytes durable."""

    def fsync(self) -> None:
        """Flush the file to the disk (raises the ``OSError`` of a failed fsync)."""
        os.fsync(self._raw.fileno())

    def close(self) -> None:
        if not self._raw.closed:
            self._raw.close()
        super().close()
