"""What a process tree costs, read from ``/proc``: CPU seconds, peak and shared memory, and the page cache.

Images/s says how fast a row is; it does not say what the row takes from the
training step sharing those cores. :func:`tree_cpu_seconds` adds the user and
system time of this process (all its threads: DALI's, PyTorch's) to that of its
live descendants (``DataLoader`` workers, DALI's Python workers, their children)
and of the children already reaped, so that the difference over a timed window is
the CPU the whole tree spent in it, whichever processes came and went.

:func:`in_child` runs a step in a fresh process and returns its own peak memory
(``VmHWM`` read from ``/proc/self/status`` when it ends, not ``ru_maxrss``: Linux
starts a process made by fork and exec with its parent's RSS at the fork as its
``ru_maxrss``, so that figure is never below the size of the process that started
the step) and the peak of every worker it started, sampled every :data:`PERIOD`
seconds while it runs (the last reading of each). Left out of the workers:
multiprocessing's helpers (its resource tracker, a forkserver), processes that are
not this Python (a tool a library runs), and processes seen in only one reading (a
subprocess caught between its fork and its exec still shows its parent's memory).
A worker that grows in its last :data:`PERIOD` is under-reported by that growth.

Linux only; elsewhere :func:`tree_cpu_seconds` returns ``None`` and the benchmark
leaves its column empty.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

_PROC = Path("/proc")
# Fields of /proc/PID/stat after the ")" that closes the command name: state is 0,
# ppid 1, utime 11, stime 12, cutime 13, cstime 14 (man 5 proc, counted from 1 at pid).
_PPID, _UTIME, _CSTIME = 1, 11, 14
#: How often the workers' peaks are read (seconds).
PERIOD = 0.05
#: Command lines of multiprocessing's helper processes: not workers.
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def tree_cpu_seconds() -> float | None:
    """User + system seconds of this process, its live descendants and its reaped children; ``None`` off Linux."""
    if not (_PROC / "self" / "stat").exists():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    own = os.times()
    total = own.user + own.system + own.children_user + own.children_system
    for pid in descendants(os.getpid()):
        fields = _stat_fields(pid)
        if fields is not None:
            # utime + stime + cutime + cstime: a worker's own reaped children count too.
            total += sum(int(v) for v in fields[_UTIME : _CSTIME + 1]) / ticks
    return total


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[_PPID]), []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name; ``None`` when the process is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after its last ")".
    return text[text.rfind(")") + 2 :].split()


def _status_kb(pid: int, key: str, name: str = "status") -> int | None:
    """The ``key:`` line of ``/proc/PID/<name>`` in kB, or None when the process (or the line) is gone."""
    try:
        for line in (_PROC / str(pid) / name).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def vm_hwm_kb(pid: int) -> int | None:
    """The peak resident set of process ``pid`` in kB (``VmHWM``), or None when it is gone."""
    return _status_kb(pid, "VmHWM:")


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process in bytes (shared pages split between their users; 0 if unreadable)."""
    return 1024 * (_status_kb(pid, "Pss:", "smaps_rollup") or 0)


def drop_page_cache(paths: Iterable[Path]) -> None:
    """Ask the kernel to drop these files' clean pages from the page cache (no root needed; a no-op on a tmpfs)."""
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@dataclass
class Measured:
    """What one step gave: its figures (``seconds`` and any others), its own peak and every worker's, in MB."""

    figures: dict[str, float]
    peak_mb: float
    worker_peaks_mb: list[float] = field(default_factory=list)


def in_child(fn: Callable[..., float | dict[str, float]], *args: Any) -> Measured:
    """Run ``fn(*args)`` in a fresh process; it returns its seconds, or a dict of figures with ``seconds``."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_measured, args=(queue, fn, args))
    process.start()
    result = queue.get()
    process.join()
    if isinstance(result, str):
        raise RuntimeError(f"scale suite: {fn.__name__}{args}: {result}")
    return result


def _measured(queue: Any, fn: Callable[..., Any], args: tuple) -> None:
    peaks = DescendantPeaks()
    try:
        figures = fn(*args)
        peaks.stop()
        if not isinstance(figures, dict):
            figures = {"seconds": figures}
        queue.put(Measured(figures, (vm_hwm_kb(os.getpid()) or 0) / 1024, peaks.peaks_mb()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        peaks.stop()
        queue.put(f"{type(exc).__name__}: {exc}")


class DescendantPeaks:
    """Samples the peak RSS (``VmHWM``) of every worker descending from this process, in a thread."""

    def __init__(self, period: float = PERIOD) -> None:
        self._period = period
        self._peaks: dict[int, int] = {}
        self._seen: dict[int, int] = {}
        self._helpers: set[int] = set()
        self._exe = os.readlink("/proc/self/exe")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._period):
            self.sample()

    def sample(self) -> None:
        """Read every worker's peak once."""
        for pid in descendants(os.getpid()):
            if pid in self._helpers:
                continue
            if _is_helper(pid, self._exe):
                self._helpers.add(pid)
                self._peaks.pop(pid, None)
                continue
            kb = vm_hwm_kb(pid)
            if kb is not None:
                self._seen[pid] = self._seen.get(pid, 0) + 1
                # The latest reading, not the largest: caught between its fork and its exec, a
                # worker still shows the parent's memory; after the exec its own peak only grows.
                self._peaks[pid] = kb

    def stop(self) -> None:
        """Stop sampling (the last readings stand)."""
        self._done.set()
        self._thread.join()

    def peaks_mb(self) -> list[float]:
        """Every worker's peak in MB, largest first (empty: the step started no worker)."""
        return sorted((kb / 1024 for pid, kb in self._peaks.items() if self._seen[pid] > 1), reverse=True)


def _is_helper(pid: int, exe: str) -> bool:
    """Whether ``pid`` is not a worker: multiprocessing's helper, or another program than ``exe``."""
    try:
        command = (_PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace")
        program = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False  # gone, or a zombie: its last reading stands
    return program != exe or any(helper in command for helper in HELPERS)
