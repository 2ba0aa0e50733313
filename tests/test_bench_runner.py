"""The benchmark's timing machinery: CPU time of a process tree, and rows measured side by side.

Real processes burn real CPU here (no patched clocks); the side-by-side runner is
driven with plain Python streams whose every ``next()`` is recorded, so the order
of windows, the draining of queues and the fate of failing rows are checked exactly.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import subprocess
import sys
import time

import pytest

from dali_pipes.bench.interleave import run_interleaved, run_jobs
from dali_pipes.bench.procfs import tree_cpu_seconds
from dali_pipes.bench.runner import Job, Skipped, Target, Timing, TimingPlan

pytestmark = pytest.mark.skipif(tree_cpu_seconds() is None, reason="CPU time of a process tree is read from /proc")

PLAN = TimingPlan(warmup_batches=2, repeats=3, min_batches=2, min_seconds=0.0, warmup_seconds=0.0)


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_tree_cpu_counts_live_children_and_grandchildren():
    # A child that starts a busy grandchild, both alive when the second reading is taken.
    script = (
        "import subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time\\nend = time.process_time() + 0.6\\n"
        "while time.process_time() < end: pass\\ntime.sleep(30)'])\n"
        "time.sleep(30)\n"
    )
    before = tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        time.sleep(2.0)  # the parent sleeps: what is counted was burnt below it
        spent = tree_cpu_seconds() - before
    finally:
        child.kill()
        child.wait()
    assert spent >= 0.5, spent  # the grandchild's 0.6 s (and two interpreter start-ups)


def test_tree_cpu_keeps_what_finished_children_spent():
    before = tree_cpu_seconds()
    process = multiprocessing.get_context("spawn").Process(target=_burn, args=(0.5,))
    process.start()
    process.join()
    assert tree_cpu_seconds() - before >= 0.45


def test_timing_reports_cpu_per_thousand_images_and_cores_busy():
    timing = Timing((100.0, 120.0), images=500, seconds=4.0, cpu_seconds=6.0)
    assert timing.cpu_seconds_per_1k == pytest.approx(12.0) and timing.cores_busy == pytest.approx(1.5)
    data = timing.to_json()
    assert data["cpu_seconds_per_1k_images"] == pytest.approx(12.0) and data["cores_busy"] == pytest.approx(1.5)
    assert Timing((1.0,), images=1, seconds=1.0).cpu_seconds_per_1k is None


def _recording_job(name: str, log: list[str], *, in_flight: int = 0, fail_after: int | None = None) -> Job:
    @contextlib.contextmanager
    def factory():
        def stream():
            for n in range(10**6):
                if fail_after is not None and n >= fail_after:
                    raise RuntimeError(f"{name} broke")
                log.append(name)
                yield 1

        yield stream()
        log.append(f"{name} closed")

    return Job(name, factory, in_flight=in_flight)


def test_side_by_side_rows_take_their_windows_in_turn_after_draining_their_queues():
    log: list[str] = []
    jobs = [_recording_job("a", log, in_flight=1), _recording_job("b", log, in_flight=0)]
    rows = run_interleaved(jobs, PLAN, Target("cpu"), progress=False)
    assert [row.name for row in rows] == ["a", "b"]
    # Opening: each warmed up (a: 2 + 1 in flight, b: 2); then per round, a drains 1 and
    # times 2, b times 2; both closed at the end, once.
    assert log[:5] == ["a", "a", "a", "b", "b"]
    assert log[5:20] == ["a", "a", "a", "b", "b"] * 3
    assert sorted(log[20:]) == ["a closed", "b closed"]
    for row in rows:
        assert row.timing is not None and len(row.timing.values) == PLAN.repeats
        assert row.timing.images == PLAN.repeats * PLAN.min_batches and row.timing.cpu_seconds is not None


def test_side_by_side_a_failing_row_ends_alone_and_skipped_rows_say_why():
    log: list[str] = []

    @contextlib.contextmanager
    def skipped():
        raise Skipped("not on this machine")
        yield  # pragma: no cover

    # "bad" survives its warm-up (2) and first window (2), then breaks in the second round.
    jobs = [
        _recording_job("bad", log, fail_after=5),
        Job("skipped", skipped),
        _recording_job("good", log),
    ]
    rows = run_jobs(jobs, PLAN, Target("cpu"), progress=False)
    bad, skip, good = rows
    assert bad.error == "RuntimeError: bad broke" and bad.timing is None
    assert log.index("bad closed") < len(log) - 1  # closed when it broke, not at the end
    assert skip.skipped == "not on this machine" and skip.timing is None
    assert good.error is None and len(good.timing.values) == PLAN.repeats


def test_one_after_another_when_asked():
    log: list[str] = []
    jobs = [_recording_job("a", log), _recording_job("b", log)]
    run_jobs(jobs, PLAN, Target("cpu"), progress=False, side_by_side=False)
    # a runs whole (warm-up 2 + 3 windows of 2) and closes before b opens.
    assert log == ["a"] * 8 + ["a closed"] + ["b"] * 8 + ["b closed"]


def test_a_window_waits_for_the_row_before_to_stop_working():
    """wait_until_quiet returns only once work running in the background (a row refilling its queues) has ended."""
    import threading
    import time

    from dali_pipes.bench.interleave import wait_until_quiet

    stop, ended = threading.Event(), []

    def burn():
        while not stop.is_set():
            sum(range(10_000))
        ended.append(time.perf_counter())

    worker = threading.Thread(target=burn)
    worker.start()
    threading.Timer(0.4, stop.set).start()
    waited = wait_until_quiet(limit=30)
    returned = time.perf_counter()
    worker.join()
    assert ended and returned >= ended[0] and waited >= 0.3  # not before the busy thread stopped
    assert wait_until_quiet(limit=30) < 5  # an idle process goes on at once (one short look)
