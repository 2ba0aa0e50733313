"""``dali-pipes bench --suite scale``: conversion and loading at growing N, to see what grows with N.

On synthetic data, for N = 10k, 100k, 1M, ... up to ``max_n``: a list file of N
lines over 200 tiny JPEGs converted to LMDB (``convert list``), and an ``.npy``
of N rows of 16 float32 converted to HDF5 and read with ``DALILoader`` +
``Features`` (batch 1024, CPU, the loader's defaults): one epoch from the
pipeline's start (its first batch included), and, in another process, the
epochs after the first for at least 2 s (steady rows/s; the time is per epoch).
Each loader row also gives the loader's construction (``DALILoader(...)``,
the pipeline built) and its first batch (from ``iter()`` to the first batch
in hand) in seconds; the one-epoch time includes the first batch, not the
construction.

Every step runs in a fresh child process, so its peak RSS is its own: the
parent of the conversion, the loader's process; the peaks of the worker
processes it starts are sampled while it runs (:mod:`dali_pipes.bench.procfs`
says how), every one kept in the JSON, the smallest and the largest in the
table. The growth columns compare with the smallest N (for the workers, the
smallest N that had any), and :func:`format_goal` sets the largest N against
the one before it: the goal is every process's peak within :data:`PEAK_GOAL` and
samples/s no lower from one N to the next, ten times larger.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dali_pipes.bench.procfs import in_child

log = logging.getLogger(__name__)

#: The sizes tried, smallest first; those above ``max_n`` are left out.
SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
IMAGES = 200
ROW_FLOATS = 16
BATCH = 1024
#: The feature field's name (the ``.npy`` file's stem).
ROW_FIELD = "rows"
#: The goal: every process's peak at most this much above the previous N's (10x fewer samples).
PEAK_GOAL = 1.15


@dataclass
class ScaleRow:
    """One step at one N: seconds, samples/s, peak RSS in MB of the step's process and of every worker it started.

    ``worker_rss_mb`` is largest first (empty: no worker); ``construct_s`` and
    ``first_batch_s`` are the loader's (None for a conversion). ``growth`` is
    samples/s against the smallest N; ``rss_growth`` and ``worker_rss_growth``
    the process's and the largest worker's peak against the smallest N that
    had one (None: no worker here or there).
    """

    step: str
    n: int
    seconds: float
    per_second: float
    rss_mb: float
    worker_rss_mb: list[float] = field(default_factory=list)
    construct_s: float | None = None
    first_batch_s: float | None = None
    growth: float = 1.0
    rss_growth: float = 1.0
    worker_rss_growth: float | None = None

    @property
    def workers(self) -> int:
        return len(self.worker_rss_mb)

    @property
    def worker_max_mb(self) -> float | None:
        return max(self.worker_rss_mb, default=None)

    @property
    def worker_min_mb(self) -> float | None:
        return min(self.worker_rss_mb, default=None)

    def as_json(self) -> dict:
        return {**self.__dict__, "workers": self.workers, "worker_max_mb": self.worker_max_mb,
                "worker_min_mb": self.worker_min_mb}  # fmt: skip


def make_inputs(folder: Path, n: int) -> tuple[Path, Path]:
    """The list file of ``n`` lines over the tiny JPEGs, and the ``(n, 16)`` float32 ``.npy`` (made once)."""
    from converters.synth import render

    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    for k in range(IMAGES):
        path = images / f"{k}.jpg"
        if not path.exists():
            render(k, size=(32, 32)).save(path, quality=80)
    list_file, rows = folder / f"list-{n}.txt", folder / f"rows-{n}.npy"
    if not list_file.exists():
        with open(list_file, "w") as f:
            for start in range(0, n, 100_000):
                f.writelines(f"k{i} images/{i % IMAGES}.jpg {i % 10}\n" for i in range(start, min(n, start + 100_000)))
    if not rows.exists():
        rng = np.random.default_rng(0)
        array = np.lib.format.open_memmap(rows, mode="w+", dtype=np.float32, shape=(n, ROW_FLOATS))
        for start in range(0, n, 1_000_000):
            stop = min(n, start + 1_000_000)
            array[start:stop] = rng.standard_normal((stop - start, ROW_FLOATS), dtype=np.float32)
        array.flush()
    return list_file, rows


def _convert(kind: str, source_path: str, fmt: str, out: str, workers: int, per_shard: int | None = None) -> float:
    """Seconds to convert a fresh ``out`` (``per_shard``: samples a shard, else the automatic shard size)."""
    from converters.runner import convert
    from converters.sources.arrays import ArraysSource
    from converters.sources.listfile import ListFileSource

    shutil.rmtree(out, ignore_errors=True)  # an earlier run's dataset would be recognised as done, not converted
    source = ListFileSource(source_path) if kind == "list" else ArraysSource([source_path])
    started = time.perf_counter()
    convert(source, out, format=fmt, workers=workers, samples_per_shard=per_shard, progress=False)
    return time.perf_counter() - started


def _load_features(dataset: str, skip: int = 0, min_seconds: float = 0.0) -> dict[str, float]:
    """``DALILoader(Features)`` with its defaults: seconds per epoch after ``skip`` untimed epochs, construction
    and first batch.

    With ``skip=0`` one epoch, the pipeline's start (its first batch) included;
    with ``skip=1`` the epochs after the first, as many as fill ``min_seconds``
    (at least one): the steady rate a training run sees, less at the mercy of a
    shared machine's moment than one short epoch. ``construct_s`` is the
    ``DALILoader(...)`` call, ``first_batch_s`` the first epoch's ``iter()`` to
    its first batch.
    """
    from dali_pipes import DALILoader, RunOptions
    from dali_pipes.pipelines import Features

    logging.getLogger("dali_pipes").setLevel(logging.WARNING)
    started = time.perf_counter()
    loader = DALILoader(dataset, Features(fields=(ROW_FIELD,)), batch_size=BATCH, run=RunOptions(device="cpu"))
    construct = time.perf_counter() - started
    try:
        first_batch, seconds = _epoch(loader)
        for _ in range(skip - 1):
            _epoch(loader)
        if skip:
            started, epochs = time.perf_counter(), 0
            while not epochs or time.perf_counter() - started < min_seconds:
                _epoch(loader)
                epochs += 1
            seconds = (time.perf_counter() - started) / epochs
        return {"seconds": seconds, "construct_s": construct, "first_batch_s": first_batch}
    finally:
        loader.close()


def _epoch(loader) -> tuple[float, float]:
    """``(seconds to the first batch, seconds of the whole epoch)`` of one pass over ``loader``."""
    started, first = time.perf_counter(), None
    for _ in loader:
        if first is None:
            first = time.perf_counter() - started
    total = time.perf_counter() - started
    return (total if first is None else first), total


def _steps(folder: Path, n: int, workers: int) -> tuple:
    """``(name, function, arguments)`` of every step at ``n``, its inputs made."""
    list_file, array_file = make_inputs(folder, n)
    named = folder / f"{ROW_FIELD}.npy"  # the .npy's stem is the field name
    named.unlink(missing_ok=True)
    named.symlink_to(array_file.name)
    hdf5 = str(folder / f"rows-{n}.hdf5")
    return (
        ("convert list -> lmdb", _convert, ("list", str(list_file), "lmdb", str(folder / f"list-{n}.lmdb"), workers)),
        ("convert arrays -> hdf5", _convert, ("arrays", str(named), "hdf5", hdf5, workers)),
        ("loader Features b1024", _load_features, (hdf5,)),
        ("loader Features b1024, epochs 2+", _load_features, (hdf5, 1, 2.0)),
    )


def run_scale(folder: str | os.PathLike, max_n: int = 1_000_000, workers: int | None = None) -> list[ScaleRow]:
    """Measure every step at every N of :data:`SIZES` up to ``max_n`` (also ``max_n`` itself if not one)."""
    folder = Path(folder)
    sizes = sorted({n for n in SIZES if n <= max_n} | {max_n})
    workers = workers or (os.cpu_count() or 1)
    rows: list[ScaleRow] = []
    for n in sizes:
        for step, fn, args in _steps(folder, n, workers):
            got = in_child(fn, *args)
            seconds = got.figures["seconds"]
            extra = {k: v for k, v in got.figures.items() if k in ("construct_s", "first_batch_s")}
            rows.append(ScaleRow(step, n, seconds, n / seconds, got.peak_mb, got.worker_peaks_mb, **extra))
            log.info("%s at N=%d: %.1f s", step, n, seconds)
    _set_growths(rows)
    return rows


def _set_growths(rows: list[ScaleRow]) -> None:
    """Each row's rate and peaks against its step's smallest N (the largest worker's: the smallest N with one)."""
    rate: dict[str, float] = {}
    peak: dict[str, float] = {}
    worker: dict[str, float] = {}
    for row in rows:
        row.growth = row.per_second / rate.setdefault(row.step, row.per_second)
        row.rss_growth = row.rss_mb / peak.setdefault(row.step, row.rss_mb)
        if row.worker_max_mb is not None:
            row.worker_rss_growth = row.worker_max_mb / worker.setdefault(row.step, row.worker_max_mb)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_scale(rows: list[ScaleRow]) -> str:
    """The rows as a Markdown table, and the goal check of :func:`format_goal` under it."""
    lines = [
        "| step | N | time (s) | samples/s | samples/s vs smallest N | peak RSS (MB): process "
        "| workers: n, smallest / largest peak (MB) | peak vs smallest N: process / largest worker "
        "| loader: construct / first batch (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        workers = f"{r.workers}: {_mb(r.worker_min_mb)} / {_mb(r.worker_max_mb)}" if r.workers else "-"
        loader = "-" if r.construct_s is None else f"{_seconds(r.construct_s)} / {_seconds(r.first_batch_s)}"
        lines.append(
            f"| {r.step} | {r.n:,} | {r.seconds:.1f} | {r.per_second:,.0f} | {_times(r.growth)} | {r.rss_mb:.0f} "
            f"| {workers} | {_times(r.rss_growth)} / {_times(r.worker_rss_growth)} | {loader} |"
        )
    goal = format_goal(rows)
    return "\n".join(lines) + (f"\n\n{goal}" if goal else "")


def goal_check(rows: list[ScaleRow]) -> list[dict]:
    """Per step, the largest N against the N before it: peaks (process, largest and smallest worker), samples/s.

    ``in_goal``: whether the step is one the goal is about (the conversions); the loader's rows are
    checked the same way and reported, since a loader that maps its whole dataset grows with it by nature."""
    sizes = sorted({r.n for r in rows})
    if len(sizes) < 2:
        return []
    low, high = sizes[-2], sizes[-1]
    at = {(r.step, r.n): r for r in rows}
    checks = []
    for step in dict.fromkeys(r.step for r in rows):
        a, b = at.get((step, low)), at.get((step, high))
        if a is None or b is None:
            continue
        ratios = {
            "process": b.rss_mb / a.rss_mb,
            "largest worker": _ratio(b.worker_max_mb, a.worker_max_mb),
            "smallest worker": _ratio(b.worker_min_mb, a.worker_min_mb),
        }
        peaks = {k: v for k, v in ratios.items() if v is not None}
        rate = b.per_second / a.per_second
        met = all(v <= PEAK_GOAL for v in peaks.values()) and rate >= 1.0
        check = {"step": step, "from_n": low, "to_n": high, "peak_growth": peaks, "rate_growth": rate, "met": met}
        checks.append({**check, "in_goal": step.startswith("convert")})
    return checks


def _ratio(b: float | None, a: float | None) -> float | None:
    return None if a is None or b is None else b / a


def format_goal(rows: list[ScaleRow]) -> str:
    """The goal, checked on the largest N against the one before it (empty with one N)."""
    checks = goal_check(rows)
    if not checks:
        return ""
    c0 = checks[0]
    lines = [
        f"Goal from {c0['from_n']:,} to {c0['to_n']:,} samples: every process's peak at most "
        f"x{PEAK_GOAL:.2f}, samples/s at least x1.00 (the largest worker's peak against the largest's, the smallest's against the smallest's):"
    ]
    for c in checks:
        peaks = ", ".join(f"{who} x{v:.2f}" for who, v in c["peak_growth"].items())
        verdict = "met" if c["met"] else "NOT met"
        if not c["in_goal"]:  # the goal is the conversion's; a loader's rows are reported beside it
            verdict = f"reported, outside the goal (would be {verdict})"
        lines.append(f"- {c['step']}: peak {peaks}; samples/s x{c['rate_growth']:.2f}: {verdict}")
    return "\n".join(lines)


def write_scale_json(rows: list[ScaleRow], path: str | os.PathLike) -> Path:
    """Every figure as JSON (every worker's peak included), and the goal check."""
    from dali_pipes.dataset.fileio import atomic_write_json

    payload = {"suite": "scale", "rows": [r.as_json() for r in rows], "goal": goal_check(rows)}
    return atomic_write_json(Path(path), payload)
