"""A loader's lifetime: dropped, closed or inherited through fork, it leaves nothing running and never hangs.

Each test runs a real script (``lifetime_script.py``) in a subprocess with a
timeout, since the failures these guard against are a hang of the process or
of the processes it forks, and threads or processes left behind in it. Those marked ``driver_init`` run again
with the loader's workers spawned (tests/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dali_pipes import DALILoader, LoaderError, RunOptions, WorkerDiedError

from loader_helpers import TinySpec, damage_shard, wait_until_dead, write_dataset

TWO_WORKERS = RunOptions(device="cpu", py_num_workers=2)

SCRIPT = Path(__file__).with_name("lifetime_script.py")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("lifetime") / "ds", 24, samples_per_shard=8)


def run_script(*args: object, timeout: float = 120) -> dict:
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the script hung ({timeout} s): {exc.stderr!r}") from None
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
# Rerun with spawned workers (driver_init) without the collector: freed by the drop alone, the harder case.
@pytest.mark.parametrize("collect", ["gc", pytest.param("nogc", marks=pytest.mark.driver_init)])
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_dropped_loader_leaves_nothing_running_and_a_later_dataloader_does_not_hang(dataset, start_method, collect):
    report = run_script(dataset, start_method, collect, "plain")
    # Freed when dropped, garbage collector or not: its helper thread, DALI's observer and its workers are gone.
    assert report["left"] == {"threads": [], "workers_alive": []}
    assert report["read"] == list(range(40))


@pytest.mark.driver_init
@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_forked_while_a_loader_is_alive_do_not_hang(dataset, start_method):
    # The user's own reference cycle keeps the loader alive until the garbage collector runs, which
    # then happens in the forked workers too: they must not shut down the pipeline they inherited.
    # The script makes the worst timing certain: a collection while Python itself readies the child,
    # before most fork handlers have run (it hung one CI run in a few before the collector was paused).
    report = run_script(dataset, start_method, "nogc", "cycle")
    assert "dali-pipes-loader-0" in report["left"]["threads"]  # still alive when the DataLoader started
    assert report["read"] == list(range(40))


@pytest.mark.timeout(300)
def test_fifty_loaders_created_and_dropped_leave_threads_processes_descriptors_and_memory_flat(dataset):
    seen = run_script("churn", dataset, 50, timeout=280)
    after_10, after_50 = seen["10"], seen["50"]
    assert after_50["threads"] == after_10["threads"] == 1
    assert after_50["children"] == after_10["children"] == 0
    assert after_50["fds"] == after_10["fds"]
    # 40 more loaders, each with its pipeline, worker and shared memory: a leak of even one
    # loader's worth each time would show as hundreds of MiB.
    assert after_50["rss_kib"] - after_10["rss_kib"] < 64 * 1024, seen


@pytest.mark.driver_init
@pytest.mark.timeout(120)
def test_close_and_the_context_manager_stop_the_workers_and_the_helper_thread(dataset):
    import threading

    # Threads of earlier tests may still be there (a call stuck on a killed worker keeps its own).
    before = set(threading.enumerate())
    with DALILoader(dataset, TinySpec(), batch_size=4, run=TWO_WORKERS) as loader:
        assert len([b for b in loader]) == 6
        pids = loader.worker_pids
        started = {t.name for t in set(threading.enumerate()) - before}
        assert "dali-pipes-loader-0" in started
    for pid in pids:
        wait_until_dead(pid)
    _wait(lambda: not set(threading.enumerate()) - before, f"threads still running after the with block: {started}")
    with pytest.raises(LoaderError, match="closed"):
        iter(loader)


def _wait(condition, message: str, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.05)


@pytest.mark.driver_init
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["part-way", "failed", "worker-died"])
def test_a_loader_left_part_way_or_failed_is_freed_when_dropped_without_the_garbage_collector(tmp_path, how):
    import gc
    import signal
    import weakref

    # Enough batches that the reader processes cannot have read the rest ahead before one is killed.
    path = write_dataset(tmp_path / "ds", 240 if how == "worker-died" else 24, samples_per_shard=8)
    if how == "failed":
        damage_shard(path, "lmdb", "scribble", shard=1, sample=9)

    def use_and_drop() -> weakref.ref:
        loader = DALILoader(path, TinySpec(), batch_size=4, run=TWO_WORKERS)
        iterator = iter(loader)
        if how == "part-way":
            next(iterator)
        elif how == "failed":
            with pytest.raises(LoaderError, match="record CRC32C"):
                list(iterator)
        else:
            next(iterator)
            os.kill(loader.worker_pids[0], signal.SIGKILL)
            with pytest.raises(WorkerDiedError):
                list(iterator)
        return weakref.ref(loader)

    gc.collect()
    gc.disable()  # only reference counting may free it
    try:
        ref = use_and_drop()
        assert ref() is None
    finally:
        gc.enable()


def test_forks_from_two_threads_at_once_leave_the_collector_as_it_was():
    import gc

    from dali_pipes.loading import lifetime

    # The fork handlers, in the order two overlapping forks run them in the parent: the collector is
    # back on only after the second fork, and stays off for a user who had turned it off.
    was_enabled = gc.isenabled()
    try:
        for user_enabled in (True, False):
            (gc.enable if user_enabled else gc.disable)()
            lifetime._pause_collector()
            lifetime._pause_collector()
            lifetime._resume_collector()
            assert not gc.isenabled()  # the other fork is still under way
            lifetime._resume_collector()
            assert gc.isenabled() == user_enabled
    finally:
        (gc.enable if was_enabled else gc.disable)()


@pytest.mark.driver_init
@pytest.mark.timeout(120)
def test_an_iterator_kept_past_close_says_the_loader_was_closed(tmp_path):
    loader = DALILoader(write_dataset(tmp_path / "ds", 40), TinySpec(), batch_size=4, run=TWO_WORKERS)
    iterator = iter(loader)
    next(iterator)
    loader.close()
    with pytest.raises(LoaderError, match="this loader was closed"):
        next(iterator)
    with pytest.raises(LoaderError, match="this loader was closed"):
        iter(loader)
