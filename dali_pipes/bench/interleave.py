"""Measuring a table of rows: side by side (every stream open at once, windows taken in turn) or one by one.

On a machine whose load moves (other jobs, a shared CI runner, a laptop's
clock), rows measured one after another see different machines, and a ratio of
two rows then says more about the moment than about the rows. Here each round
times one window of every row in turn, so each row's median comes from the same
stretches of time as the others', and their ratios hold when the absolute
figures move.

A stream that sat idle while the others ran has its queues full: the first
batches of its next window would come for free. So each window starts by
drawing the row's ``in_flight`` batches untimed, once the row before has
finished refilling its own queues (:func:`wait_until_quiet`). Streams are opened
(and warmed, which starts their worker processes) rows without a DALI pipeline
first, then DALI's, so that no worker is forked from a process already running
DALI's threads. Rows timed cold (``Job.cold_images``: start-up is their point)
are measured alone, before the others open.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Sequence

from dali_pipes.bench.procfs import tree_cpu_seconds
from dali_pipes.bench.runner import (
    Job,
    Row,
    Target,
    TimingPlan,
    Window,
    collect_garbage,
    measure,
    record_gpu_memory,
    record_outcome,
    time_window,
    timing_of,
    warm_up,
)
from dali_pipes.dataset.progress import bar_disabled

log = logging.getLogger(__name__)


def run_jobs(
    jobs: Sequence[Job],
    plan: TimingPlan,
    target: Target,
    *,
    progress: bool = True,
    title: str = "bench",
    side_by_side: bool = True,
) -> list[Row]:
    """Measure ``jobs`` (with a progress bar): side by side, or one after another (see :func:`measure`).

    Side by side (:mod:`dali_pipes.bench.interleave`), every row is open at once
    and the rows take their timed windows in turn, so that their ratios hold on a
    machine whose load moves; one after another, each row runs alone.
    """
    from dali_pipes.dataset.progress import tqdm

    if side_by_side and len(jobs) > 1:
        return run_interleaved(jobs, plan, target, progress=progress, title=title)

    rows = []
    with tqdm(jobs, desc=title, unit="row", disable=bar_disabled(progress), leave=False) as bar:
        for job in bar:
            bar.set_postfix_str(job.name)
            rows.append(measure(job, plan, target))
    return rows


def run_interleaved(
    jobs: Sequence[Job], plan: TimingPlan, target: Target, *, progress: bool = True, title: str = "bench"
) -> list[Row]:
    """Measure ``jobs`` side by side (see the module docstring); rows come back in ``jobs``' order."""
    from dali_pipes.dataset.progress import tqdm

    rows = [Row(job.name, job.description, dict(job.params)) for job in jobs]
    windows: dict[int, list[Window]] = {}
    total = len(jobs) * (1 + plan.repeats)
    with (
        contextlib.ExitStack() as all_open,
        tqdm(total=total, desc=title, unit="window", disable=bar_disabled(progress), leave=False) as bar,
    ):
        streams: dict[int, tuple[Iterator[int], contextlib.ExitStack]] = {}
        # Cold rows alone first; then rows without DALI before DALI's (see the module docstring).
        for i in sorted(range(len(jobs)), key=lambda i: (jobs[i].cold_images is None, jobs[i].runs_dali)):
            bar.set_postfix_str(f"open {jobs[i].name}")
            if jobs[i].cold_images is not None:
                rows[i] = measure(jobs[i], plan, target)
                bar.update(1 + plan.repeats)
                continue
            opened = _open(jobs[i], rows[i], plan, target)
            if opened is not None:
                all_open.callback(opened[1].close)
                streams[i] = opened
                windows[i] = []
            bar.update(1 if opened is not None else 1 + plan.repeats)
        for round_number in range(1, plan.repeats + 1):
            for i in sorted(streams):
                bar.set_postfix_str(jobs[i].name)
                _take_window(jobs[i], rows[i], streams, i, windows[i], plan, target)
                bar.update(1)
            _log_round(title, round_number, plan.repeats, jobs, windows)
    for i, taken in windows.items():
        if rows[i].error is None and len(taken) == plan.repeats:
            rows[i].timing = timing_of(taken)
    return rows


def _log_round(title: str, number: int, rounds: int, jobs: Sequence[Job], windows: dict[int, list[Window]]) -> None:
    """One line per round with every row's windows so far: a run cut short (a lease's limit) still reports."""
    figures = []
    names = [job.name for job in jobs]
    for i, taken in sorted(windows.items()):
        rates = ", ".join(f"{w.images / w.seconds:,.0f}" for w in taken if w.seconds > 0)
        label = jobs[i].name
        if names.count(label) > 1:  # rows of one name differ by their settings: say which this is
            label += " [" + " ".join(f"{k}={v}" for k, v in jobs[i].params.items()) + "]"
        figures.append(f"{label}: {rates or 'failed'}")
    log.info("%s: round %d of %d, images/s of each window so far: %s", title, number, rounds, "; ".join(figures))


def _open(job: Job, row: Row, plan: TimingPlan, target: Target) -> tuple[Iterator[int], contextlib.ExitStack] | None:
    """``job``'s stream, open and warmed up; ``None`` (with the reason in ``row``) when it cannot run."""
    collect_garbage()
    closer = contextlib.ExitStack()
    try:
        before = target.memory_used()
        stream = closer.enter_context(job.factory())
        warm_up(stream, plan, target, job.in_flight)
        # Rows open one after another and stay open: each row's figure is what it added.
        record_gpu_memory(row, before, target)
        return stream, closer
    except Exception as exc:  # noqa: BLE001 - recorded in the row, shown in the table
        record_outcome(row, exc)
    closer.close()
    return None


def _take_window(
    job: Job,
    row: Row,
    streams: dict[int, tuple[Iterator[int], contextlib.ExitStack]],
    index: int,
    taken: list[Window],
    plan: TimingPlan,
    target: Target,
) -> None:
    """One timed window of ``job``, after drawing what its queues made while it waited; a failure ends the row."""
    stream, closer = streams[index]
    try:
        wait_until_quiet()  # the row before refills its queues after its window: not on this row's time
        for _ in range(job.in_flight):
            next(stream)
        target.sync()
        taken.append(time_window(stream, plan, target))
    except Exception as exc:  # noqa: BLE001 - recorded in the row; the other rows go on
        record_outcome(row, exc)
        del streams[index]
        closer.close()


def wait_until_quiet(*, busy: float = 0.25, interval: float = 0.05, limit: float = 1.5) -> float:
    """Wait until this process tree uses less than ``busy`` of a core over ``interval`` seconds; the seconds waited.

    After its timed window a row's workers go on filling their queues (a
    ``DataLoader``'s ``prefetch_factor`` batches per worker, a pool's chunks in
    flight, DALI's prefetch), taking CPU from the next row's window: rows measured
    after a heavy one would come out slower and noisier than alone (the bench
    README says by how much). Waiting for that work to end first gives every row
    the machine as it would have it alone. Gives up after ``limit`` seconds: a row
    that is never idle costs the wait, not the figures, and a GPU bench of a few
    rows must still fit a short lease.
    """
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        before = tree_cpu_seconds()
        time.sleep(interval)
        after = tree_cpu_seconds()
        if before is None or after is None or after - before < busy * interval:
            break
    return time.perf_counter() - started
