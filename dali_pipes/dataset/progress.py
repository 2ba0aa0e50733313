"""Progress of the package's long jobs: one rule for when a bar shows, and lines for logs where it cannot.

Every long job (convert, stage, merge, verify, the RAM cache, the benchmarks) makes its bar as
``tqdm(..., disable=bar_disabled(progress))`` with the :class:`tqdm` of this module, which is tqdm's own
everywhere but in one case: asked for progress (``disable=None``) and writing to something that is not a
terminal (a pipe, a batch job's log file), it draws no bar, whose redrawn ``\\r`` lines would fill the log,
and logs one line every :func:`progress_interval` seconds instead (``DALI_PIPES_PROGRESS_INTERVAL``,
default 30; ``0`` or ``off``: none), as tqdm's ``mininterval`` or Lightning's logged progress do::

    convert lmdb: 3,000/6,000 samples (50%), 412 samples/s, about 7 s left

The lines go to the ``dali_pipes.progress`` logger at INFO (the ``dali-pipes`` command writes those to
stderr; a script sees them once it configures logging). A job shorter than the interval logs none; one that
logged lines logs a last one when it ends, with its total time.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

from tqdm import tqdm as _tqdm

from dali_pipes.dataset.manifest import human_bytes

__all__ = ["INTERVAL_ENV", "bar_disabled", "progress_interval", "progress_line", "tqdm"]

log = logging.getLogger("dali_pipes.progress")

#: Seconds between two progress lines when the output is no terminal; ``0`` or ``off`` for none.
INTERVAL_ENV = "DALI_PIPES_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 30.0
_OFF = ("0", "off", "no", "none", "false")
_warned: set[str] = set()  # bad values of INTERVAL_ENV already warned about (one warning per value, not per bar)


def bar_disabled(progress: bool) -> bool | None:
    """tqdm's ``disable`` for a job run with ``progress``: never when asked not to, else only on a terminal.

    ``None`` is tqdm's own test (``file.isatty()``), so a bar never fills a batch job's log or a pipe; this
    module's :class:`tqdm` then logs a progress line every :func:`progress_interval` seconds instead.
    """
    return None if progress else True


def progress_interval() -> float | None:
    """Seconds between progress lines (``DALI_PIPES_PROGRESS_INTERVAL``, default 30), ``None`` for no lines."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL
    if text.lower() in _OFF:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not math.isfinite(seconds) or seconds < 0:
        if text not in _warned:  # read by each bar: a job with many would repeat it
            _warned.add(text)
            log.warning(
                "%s=%r: not a number of seconds; progress lines come every %g s (give seconds, or 0 for none)",
                INTERVAL_ENV,
                text,
                DEFAULT_INTERVAL,
            )
        return DEFAULT_INTERVAL
    return seconds or None


class tqdm(_tqdm):  # noqa: N801 - tqdm's own name, as tqdm.auto's is: the call sites read as tqdm's
    """tqdm's bar, or where ``disable=None`` finds no terminal, a logged line every :func:`progress_interval` s.

    tqdm counts as it always does (``update``, iteration, ``set_postfix_str``); only the drawing, which tqdm
    leaves to :meth:`display` for its subclasses to replace, becomes a log line. Its ``\\r`` output goes nowhere.
    """

    def __init__(self, *args: Any, disable: bool | None = False, file: Any = None, **kwargs: Any) -> None:
        stream = sys.stderr if file is None else file
        self._every: float | None = None  # seconds between lines; None: tqdm's own bar (or none)
        if disable is None and not _isatty(stream):
            self._every = progress_interval()
            if self._every is None:
                disable = True
            else:
                disable, file = False, _Nowhere()
                # Time is checked at each update only once this much has passed; no count threshold (miniters 0),
                # so a slow job still logs on time.
                kwargs.update(mininterval=self._every, miniters=0)
        self._started = time.monotonic()
        self._last = (self._started, kwargs.get("initial", 0))  # (when, n) at the last line
        self._lines = 0
        super().__init__(*args, disable=disable, file=file, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """Draw the bar, or (in a log) write a progress line once the interval has passed since the last."""
        if self._every is None:
            return super().display(msg, pos)
        if self.disable:  # tqdm's close() draws once more after it disabled the bar: our last line is out already
            return True
        now = time.monotonic()
        # msg="" is tqdm clearing a bar, and a bar at its total is about to close with its own last line.
        finished = self.total is not None and self.n >= self.total
        if msg is None and not finished and now - self._last[0] >= self._every:
            when, count = self._last
            rate = (self.n - count) / (now - when) if now > when else 0.0
            log.info("%s", progress_line(self.desc, self.n, self.total, rate, self.unit, self.unit_scale))
            self._last = (now, self.n)
            self._lines += 1
        return True

    def close(self) -> None:
        """End the bar; in a log that had progress lines, one last line: the count, and the time it took."""
        # getattr: tqdm's __del__ closes a bar whose __init__ may not have got this far.
        if getattr(self, "_every", None) is not None and getattr(self, "_lines", 0) and not self.disable:
            seconds = time.monotonic() - self._started
            rate = (self.n - self.initial) / seconds if seconds > 0 else 0.0
            line = progress_line(self.desc, self.n, self.total, rate, self.unit, self.unit_scale, eta=False)
            # Closed short of its total, the job failed or was stopped: its own error says why.
            ended = "done in" if self.total is None or self.n >= self.total else "stopped after"
            log.info("%s; %s %s", line, ended, _duration(seconds))
            self._lines = 0
        super().close()


def progress_line(
    desc: str, n: float, total: float | None, rate: float, unit: str, unit_scale: bool | float, eta: bool = True
) -> str:
    """``"convert lmdb: 3,000/6,000 samples (50%), 412 samples/s, about 7 s left"`` (no share nor time left
    when the total is unknown; byte counts as ``1.2 GB``)."""
    count = _amount(n, unit, unit_scale)
    if total:
        count = f"{_amount(n, unit, unit_scale, bare=True)}/{_amount(total, unit, unit_scale)}"
        count += f" ({math.floor(100 * n / total)}%)"  # floored: 100% only once it is all done
    parts = [count, f"{_amount(rate, unit, unit_scale, rate=True)}/s"]
    if eta and total and rate > 0 and n < total:
        left = (total - n) / rate
        parts.append(f"about {_duration(left, tenths=False)} left" if left >= 1 else "less than 1 s left")
    return f"{desc or 'progress'}: {', '.join(parts)}"


def _amount(value: float, unit: str, unit_scale: bool | float, bare: bool = False, rate: bool = False) -> str:
    """``1,234 samples``, ``3.4 GB`` (bytes), ``12.5 MB`` (a rate of bytes); ``bare``: without the unit."""
    if unit == "B" and unit_scale:
        return human_bytes(value)  # "1.2 GB" with its unit, also where bare: the total's may differ
    number = f"{value:,.0f}" if rate or float(value).is_integer() else f"{value:,.1f}"
    if bare:
        return number
    plural = unit.isalpha() and len(unit) > 1 and not unit.endswith("s") and (rate or value != 1)
    return f"{number} {unit}{'s' if plural else ''}"


def _duration(seconds: float, tenths: bool = True) -> str:
    """``7 s``, ``4 min``, ``2 h 5 min``: as precise as a log reader wants (``tenths``: ``7.3 s`` under 10 s)."""
    if seconds < 90:
        return f"{seconds:.1f} s" if tenths and seconds < 10 else f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60} min"


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no such method, or a closed file: no terminal either way
        return False


class _Nowhere:
    """Where tqdm's own drawing goes while its progress is logged as lines: nowhere."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
