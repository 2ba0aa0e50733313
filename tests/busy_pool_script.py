"""A local pool whose main thread is busy with the pool itself, for one Ctrl-C to land anywhere in it.

Run by ``test_pool_interrupt.py`` in its own process group::

    python busy_pool_script.py TASKS

Thousands of tasks that take milliseconds keep this process's main thread inside ``concurrent.futures`` and
``multiprocessing`` (waiting on futures, taking their locks, reading progress messages) most of the time, not
asleep: a Ctrl-C then lands in their internals as often as a loaded machine makes it do in a real conversion.
Prints ``running`` once the first task is done, and on Ctrl-C says ``interrupted`` and exits 130, as the CLI does.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from typing import Any

from converters.engines import LocalEngine

_queue: Any = None
_stop: Any = None


def _init(queue: Any, stop: Any) -> None:
    global _queue, _stop
    _queue, _stop = queue, stop


def _task(number: int) -> dict[str, int]:
    for _ in range(4):  # progress messages through the queue, as a shard's samples send them
        if _stop.is_set():
            raise RuntimeError("stopped")
        time.sleep(random.random() * 0.004)
        _queue.put(1)
    return {"number": number}


def main(count: int) -> int:
    tasks = [(n, _task, (n,)) for n in range(count)]
    done = 0
    try:
        for _ in LocalEngine(2, _init).run(tasks, lambda ticks: None):
            done += 1
            if done == 1:
                print("running", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted after {done} tasks", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":  # spawned workers import this file too
    # As a shell starts a program: Ctrl-C raises (the test process may pass on SIGINT ignored or blocked).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    sys.exit(main(int(sys.argv[1])))
