"""A test source whose worker process crashes for real: importable by spawned workers (tests/ is on their path)."""

from __future__ import annotations

import ctypes
import os
import resource
from pathlib import Path

from converters.base import Item, Sample
from converters.sources import ImageFolderSource


class CrashingSource(ImageFolderSource):
    """An image folder whose input named ``crash_on`` crashes the loading process (SIGSEGV) while ``flag`` exists.

    The flag is not part of :meth:`describe`, so a run without it is the same job, and resumes.
    """

    def __init__(self, root: str | os.PathLike, *, crash_on: str, flag: str) -> None:
        super().__init__(root)
        self.crash_on = crash_on
        self.flag = flag

    def load(self, item: Item) -> Sample:
        if Path(item.name).name == self.crash_on and os.path.exists(self.flag):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the working folder
            ctypes.string_at(0)  # a read of address 0: a real segmentation fault
        return super().load(item)
