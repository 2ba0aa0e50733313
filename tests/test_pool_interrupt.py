"""One Ctrl-C (a real SIGINT to the process group) at a random moment of a busy local pool ends it within seconds.

Python raises KeyboardInterrupt at whatever bytecode the main thread runs; in a running pool that is mostly
inside ``concurrent.futures`` and ``multiprocessing``. Raised there, it used to leave a future's lock held (the
pool's manager thread then blocked for ever, and so did the interpreter's exit) or a progress message half-read
(the next read then waited for ever). Each moment is random, so each run can land anywhere; without the engine's
own SIGINT handler about one run in six hung here (5 of 30), so sixteen runs catch it about 19 times in 20.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_convert_interrupt import kill_group, wait_stopped

SCRIPT = Path(__file__).with_name("busy_pool_script.py")
RUNS = 16
#: Holding a Ctrl-C until the pool's own loop raises it takes up to its 0.2 s poll; stopping, about as long.
STOP_WITHIN = 10.0


def _left_in_group(group: int) -> list[str]:
    """``"pid: command line"`` of each process of ``group`` still alive (zombies, only waiting to be reaped, aside)."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            left.append(f"{entry}: {command}")
    return left


def _left_after(group: int, seconds: float) -> list[str]:
    """What is left of ``group`` once its processes have had ``seconds`` to end.

    The last to close its end of the output pipes can still be on its way out when they read as closed (its
    memory already released, its command line empty), so this waits a little for that.
    """
    deadline = time.monotonic() + seconds
    while (left := _left_in_group(group)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _interrupt_once(moment: float) -> tuple[int | None, str]:
    """Start the busy pool, Ctrl-C it ``moment`` seconds after its first task: ``(exit code, stderr)``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "3000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        assert proc.stdout.readline() == "running\n", proc.communicate()
        time.sleep(moment)
        os.killpg(proc.pid, signal.SIGINT)
        code, stderr = wait_stopped(proc, f"the pool ({moment:.3f} s into it)", STOP_WITHIN)
        assert not _left_after(proc.pid, 5.0), f"processes {_left_in_group(proc.pid)} left after the Ctrl-C"
        return code, stderr
    finally:
        kill_group(proc)


def test_one_ctrl_c_anywhere_in_a_busy_pool_ends_it_within_seconds():
    moments = random.Random(7).choices([i / 1000 for i in range(300)], k=RUNS)
    for moment in moments:
        code, stderr = _interrupt_once(moment)
        assert code == 130, f"exit {code} after a Ctrl-C {moment:.3f} s into the pool:\n{stderr}"
        assert "interrupted after" in stderr and "Traceback" not in stderr, stderr
