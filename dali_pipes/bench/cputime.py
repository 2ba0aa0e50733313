"""CPU time of this process and every process under it: what a benchmark row costs the cores.

Images/s says how fast a row is; it does not say what the row takes from the
training step sharing those cores (a loader that reaches its speed by keeping
every core busy is not free). :func:`tree_cpu_seconds` adds user and system time
of this process (all its threads: DALI's, PyTorch's) to that of its live
descendants (``DataLoader`` workers, DALI's Python workers, their own children)
and of the children already reaped, so that the difference over a timed window
is the CPU the whole tree spent in it, whichever processes came and went.

Linux only (``/proc``); elsewhere it returns ``None`` and the benchmark leaves
the column empty.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")
# Fields of /proc/PID/stat after the ")" that closes the command name: state is 0,
# ppid 1, utime 11, stime 12, cutime 13, cstime 14 (man 5 proc, counted from 1 at pid).
_PPID, _UTIME, _CSTIME = 1, 11, 14


def tree_cpu_seconds() -> float | None:
    """User + system seconds of this process, its live descendants and its reaped children; ``None`` off Linux."""
    if not (_PROC / "self" / "stat").exists():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    own = os.times()
    total = own.user + own.system + own.children_user + own.children_system
    for pid in _descendants(os.getpid()):
        fields = _stat_fields(pid)
        if fields is not None:
            # utime + stime + cutime + cstime: a worker's own reaped children count too.
            total += sum(int(v) for v in fields[_UTIME : _CSTIME + 1]) / ticks
    return total


def _descendants(root: int) -> list[int]:
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
