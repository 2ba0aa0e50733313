"""Peak memory of a step run in a fresh process, and of every worker process it starts.

The step's own peak is its ``VmHWM`` read from ``/proc/self/status`` when it
ends, not ``ru_maxrss``: Linux starts a process made by fork and exec with its
parent's RSS at the fork as its ``ru_maxrss`` (kept through the exec), so that
figure is never below the size of the process that started the step. ``VmHWM``
belongs to the process's own address space, made at the exec.

The workers' peaks are sampled from ``/proc/PID/status`` (``VmHWM``) of every
descendant every 0.05 s while the step runs (the last reading of each). Left out: the
helpers multiprocessing starts beside the workers (its resource tracker, a
forkserver); processes that are not this Python (a tool a library runs); and
processes seen in only one reading: a subprocess caught between its fork and
its exec still shows its parent's memory and command line. A worker that grows
in its last 0.05 s is under-reported by that growth.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

#: How often the workers' peaks are read (seconds).
PERIOD = 0.05
#: Command lines of multiprocessing's helper processes: not workers.
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


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


def _measured(queue, fn, args) -> None:
    peaks = DescendantPeaks()
    try:
        figures = fn(*args)
        peaks.stop()
        if not isinstance(figures, dict):
            figures = {"seconds": figures}
        queue.put(Measured(figures, vm_hwm_kb(os.getpid()) / 1024, peaks.peaks_mb()))
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
        self._done.set()
        self._thread.join()

    def peaks_mb(self) -> list[float]:
        """Every worker's peak in MB, largest first (empty: the step started no worker)."""
        return sorted((kb / 1024 for pid, kb in self._peaks.items() if self._seen[pid] > 1), reverse=True)


def _is_helper(pid: int, exe: str) -> bool:
    """Whether ``pid`` is not a worker: multiprocessing's helper, or another program than ``exe``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().decode(errors="replace")
        program = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False  # gone, or a zombie: its last reading stands
    return program != exe or any(helper in command for helper in HELPERS)


def descendants(root: int) -> list[int]:
    """Every process under ``root`` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # The command name may hold spaces; the fields after its closing parenthesis do not.
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        todo += children
    return found


def vm_hwm_kb(pid: int) -> int | None:
    """The peak resident set of process ``pid`` in kB (``VmHWM``), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
