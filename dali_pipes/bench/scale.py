"""``dali-pipes bench --suite scale``: conversion and loading at growing N, to see what grows with N.

On synthetic data, for N = 10k, 100k, 1M, ... up to ``max_n``: a list file of N
lines over 200 tiny JPEGs converted to LMDB (``convert list``), and an ``.npy``
of N rows of 16 float32 converted to HDF5 and read with ``DALILoader`` +
``Features`` (batch 1024, CPU, the loader's defaults): one epoch from the
pipeline's start (its first batch included), and, in another process, the
epochs after the first for at least 2 s (steady rows/s; the time is per epoch).
Every step runs in a fresh child process, so its
peak RSS (``ru_maxrss``) is its own: the parent of the conversion, the loader's
process. Its workers' peaks are sampled from ``/proc/PID/status`` (``VmHWM``)
every 0.1 s while the step runs (the last reading of each), not taken from ``RUSAGE_CHILDREN``: Linux
charges a child started by fork and exec with its parent's RSS at the fork, so
that figure says how big the parent was, not the worker. The last column is the
growth factor of samples/s against the smallest N (1.0: flat).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)

#: The sizes tried, smallest first; those above ``max_n`` are left out.
SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
IMAGES = 200
ROW_FLOATS = 16
BATCH = 1024
#: The feature field's name (the ``.npy`` file's stem).
ROW_FIELD = "rows"


@dataclass
class ScaleRow:
    """One step at one N: seconds, samples/s, peak RSS in MB of the step's process and its largest child."""

    step: str
    n: int
    seconds: float
    per_second: float
    rss_mb: float
    child_rss_mb: float
    growth: float = 1.0


def _peak_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # kB on Linux


def _in_child(fn: Callable[..., float], *args: Any) -> tuple[float, float, float]:
    """``(seconds, own peak MB, largest child's peak MB)`` of ``fn(*args)`` run in a fresh process."""
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
    peaks = _DescendantPeaks()
    try:
        seconds = fn(*args)
        peaks.stop()
        queue.put((seconds, _peak_mb(resource.RUSAGE_SELF), peaks.largest_mb()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        peaks.stop()
        queue.put(f"{type(exc).__name__}: {exc}")


class _DescendantPeaks:
    """Samples the peak RSS (``VmHWM``) of every descendant of this process every 0.1 s, in a thread.

    A process that grows in its last 0.1 s is under-reported by that growth.
    """

    def __init__(self) -> None:
        self._peaks: dict[int, int] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.1):
            for pid in _descendants(os.getpid()):
                kb = _vm_hwm_kb(pid)
                if kb is not None:
                    # The latest reading, not the largest: caught between its fork and its exec, a
                    # worker still shows the parent's memory; after the exec its own peak only grows.
                    self._peaks[pid] = kb

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def largest_mb(self) -> float:
        return max(self._peaks.values(), default=0) / 1024


def _descendants(root: int) -> list[int]:
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


def _vm_hwm_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


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


def _convert(kind: str, source_path: str, fmt: str, out: str, workers: int) -> float:
    from converters.runner import convert
    from converters.sources.arrays import ArraysSource
    from converters.sources.listfile import ListFileSource

    source = ListFileSource(source_path) if kind == "list" else ArraysSource([source_path])
    started = time.perf_counter()
    convert(source, out, format=fmt, workers=workers, progress=False)
    return time.perf_counter() - started


def _load_features(dataset: str, skip: int = 0, min_seconds: float = 0.0) -> float:
    """Seconds per epoch of ``DALILoader(Features)`` with its defaults, after ``skip`` untimed epochs.

    With ``skip=0`` one epoch, the pipeline's start (its first batch) included;
    with ``skip=1`` the epochs after the first, as many as fill ``min_seconds``
    (at least one): the steady rate a training run sees, less at the mercy of a
    shared machine's moment than one short epoch.
    """
    from dali_pipes import DALILoader
    from dali_pipes.pipelines import Features

    logging.getLogger("dali_pipes").setLevel(logging.WARNING)
    loader = DALILoader(dataset, Features(fields=(ROW_FIELD,)), batch_size=BATCH, device="cpu")
    try:
        for _ in range(skip):
            for _ in loader:
                pass
        started, epochs = time.perf_counter(), 0
        while True:
            for _ in loader:
                pass
            epochs += 1
            elapsed = time.perf_counter() - started
            if elapsed >= min_seconds:
                return elapsed / epochs
    finally:
        loader.close()


def run_scale(folder: str | os.PathLike, max_n: int = 1_000_000, workers: int | None = None) -> list[ScaleRow]:
    """Measure every step at every N of :data:`SIZES` up to ``max_n`` (also ``max_n`` itself if not one)."""
    folder = Path(folder)
    sizes = sorted({n for n in SIZES if n <= max_n} | {max_n})
    workers = workers or (os.cpu_count() or 1)
    rows: list[ScaleRow] = []
    for n in sizes:
        list_file, array_file = make_inputs(folder, n)
        named = folder / f"{ROW_FIELD}.npy"  # the .npy's stem is the field name
        named.unlink(missing_ok=True)
        named.symlink_to(array_file.name)
        steps = (
            (
                "convert list -> lmdb",
                _convert,
                ("list", str(list_file), "lmdb", str(folder / f"list-{n}.lmdb"), workers),
            ),
            (
                "convert arrays -> hdf5",
                _convert,
                ("arrays", str(named), "hdf5", str(folder / f"rows-{n}.hdf5"), workers),
            ),
            ("loader Features b1024", _load_features, (str(folder / f"rows-{n}.hdf5"),)),
            ("loader Features b1024, epochs 2+", _load_features, (str(folder / f"rows-{n}.hdf5"), 1, 2.0)),
        )
        for step, fn, args in steps:
            seconds, rss, child = _in_child(fn, *args)
            rows.append(ScaleRow(step, n, seconds, n / seconds, rss, child))
            log.info("%s at N=%d: %.1f s", step, n, seconds)
    first: dict[str, float] = {}
    for row in rows:
        first.setdefault(row.step, row.per_second)
        row.growth = row.per_second / first[row.step]
    return rows


def format_scale(rows: list[ScaleRow]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| step | N | time (s) | samples/s | peak RSS (MB): process / largest child | samples/s vs smallest N |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.step} | {r.n:,} | {r.seconds:.1f} | {r.per_second:,.0f} | {r.rss_mb:.0f} / "
            f"{f'{r.child_rss_mb:.0f}' if r.child_rss_mb else '-'} "
            f"| {r.growth:.2f}x |"
        )
    return "\n".join(lines)


def write_scale_json(rows: list[ScaleRow], path: str | os.PathLike) -> Path:
    """Every figure as JSON."""
    from dali_pipes.dataset.fileio import atomic_write_json

    return atomic_write_json(Path(path), {"suite": "scale", "rows": [r.__dict__ for r in rows]})
