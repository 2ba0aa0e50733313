"""A training script that drops a DALILoader without close(), then runs a torch DataLoader with workers.

Run by ``test_loader_lifetime.py`` in a subprocess with a timeout (the failure
it guards against is a hang)::

    python lifetime_script.py DATASET START_METHOD COLLECT HOLD
    python lifetime_script.py churn DATASET COUNT

``START_METHOD``: the DataLoader's workers' (``fork`` or ``spawn``);
``COLLECT``: ``gc`` to call ``gc.collect()`` after the loader is dropped, or
``nogc``; ``HOLD``: ``plain``, or ``cycle`` to drop the loader inside a
reference cycle of the user's own, so that it is still alive when the
DataLoader forks (only the fork handlers then keep the workers from hanging).
In ``cycle``, the timing that once hung one run in a few is made certain: the
cycle is made young just before each fork and the collector set to run at the
next allocation, so that without ``dali_pipes``' handlers it would free the
loader in the child while Python itself is still getting the child ready, before
any handler registered after ``threading``'s has run.
Prints one JSON line: what was left after the loader was dropped, and what the
DataLoader read. ``churn`` creates and drops COUNT loaders and prints the
threads, child processes, descriptors and memory after 10 and after all.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).parent))

from loader_helpers import TinySpec, process_alive  # noqa: E402


class CollectingDataset(Dataset):
    """Runs the garbage collector in the DataLoader's workers, as their allocations do sooner or later."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        gc.collect()
        return torch.tensor(i)


def train(dataset: str, hold: str) -> list[int]:
    """Iterate a loader once and let it go without close(); returns its worker pids."""
    from dali_pipes import DALILoader, RunOptions

    loader = DALILoader(dataset, TinySpec(), batch_size=4, run=RunOptions(device="cpu", py_num_workers=2))
    for _ in loader:
        pass
    pids = loader.worker_pids
    if hold == "cycle":
        _HELD.append(loader)
        # Registered after dali_pipes' handlers: this before handler runs ahead of theirs (reverse order), the
        # after handlers behind theirs, once the child has disowned the pipeline.
        os.register_at_fork(
            before=_drop_in_a_young_cycle, after_in_parent=_usual_collector, after_in_child=_usual_collector
        )
    return pids


#: The loader ``cycle`` drops in a reference cycle of its own at the next fork.
_HELD: list = []


#: The collector's thresholds before :func:`_drop_in_a_young_cycle` made it run at every allocation.
_USUAL_THRESHOLD = gc.get_threshold()


def _drop_in_a_young_cycle() -> None:
    """Just before a fork: the loader's last reference into a new cycle, and the collector due at once."""
    if _HELD:
        holder: dict = {"loader": _HELD.pop()}
        holder["self"] = holder  # only the garbage collector can free this
        gc.set_threshold(1)


def _usual_collector() -> None:
    """After the fork, in both processes: collections as usual again (a threshold of 1 would slow them down)."""
    gc.set_threshold(*_USUAL_THRESHOLD)


def resources() -> dict:
    """This process's threads, live child processes, open descriptors and resident memory (KiB).

    Counted after a collection, so that the figures do not depend on when the collector last ran (the loader
    collects before it forks workers, not before it spawns them). Not counted: ``multiprocessing``'s resource
    tracker, the one child that the first spawn starts and that lives as long as this process, by design.
    """
    gc.collect()
    children = [pid for pid in _children() if process_alive(pid) and not _is_resource_tracker(pid)]
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {
        "threads": threading.active_count(),
        "children": len(children),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kib": rss,
    }


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def _children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
        except OSError:
            continue
    return pids


def churn(dataset: str, count: int) -> None:
    """Create, iterate and drop ``count`` loaders; print the resources after the first 10 and after all."""
    from dali_pipes import DALILoader, RunOptions

    seen = {}
    for i in range(1, count + 1):
        loader = DALILoader(dataset, TinySpec(), batch_size=4, run=RunOptions(device="cpu", py_num_workers=1))
        for _ in loader:
            pass
        del loader
        if i in (10, count):
            seen[i] = resources()
    print(json.dumps(seen), flush=True)


def main() -> None:
    if sys.argv[1] == "churn":
        churn(sys.argv[2], int(sys.argv[3]))
        return
    dataset, start_method, collect, hold = sys.argv[1:5]
    pids = train(dataset, hold)
    if collect == "gc":
        gc.collect()
    left = {
        "threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
        "workers_alive": [pid for pid in pids if process_alive(pid)],
    }
    loader = DataLoader(CollectingDataset(), batch_size=4, num_workers=2, multiprocessing_context=start_method)
    read = sorted(int(i) for batch in loader for i in batch)
    print(json.dumps({"left": left, "read": read, "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
