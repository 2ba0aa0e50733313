"""When a progress bar shows: the one rule every long job of the package follows."""

from __future__ import annotations

__all__ = ["bar_disabled"]


def bar_disabled(progress: bool) -> bool | None:
    """tqdm's ``disable`` for a job run with ``progress``: never when asked not to, else only on a terminal.

    ``None`` is tqdm's own test (``file.isatty()``), so a bar never fills a batch job's log or a pipe.
    """
    return None if progress else True
