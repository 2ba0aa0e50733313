"""Steady-state throughput: warm-up left out, the median of repeated windows, the spread kept.

Every benchmark row is a *stream*: an iterator that delivers one batch per step
and yields the number of images it delivered. "Delivered" means the batch is
where training needs it: on a CUDA machine a batch made on the host is copied to
the GPU inside the timed window (:class:`Target`), because that copy is part of
what an input pipeline costs; GPU work is synchronised at the window edges, so
asynchronous kernels are not mistaken for finished ones.

:func:`time_stream` first drops ``warmup_batches`` (pipeline build, worker
start-up, first-touch allocations), then times ``repeats`` consecutive windows,
each at least ``min_batches`` long and at least ``min_seconds``. A row reports
the median images/s of the windows and their range. Nothing is cached between
windows: each batch is read, decoded and augmented again (the stream cycles
through epochs).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Sequence

from dali_pipes.bench.procfs import tree_cpu_seconds

log = logging.getLogger(__name__)

#: A row's stream factory: a context manager (so that workers and pipelines are
#: always shut down) that yields an iterator of delivered image counts.
StreamFactory = Callable[[], ContextManager[Iterator[int]]]


class Skipped(Exception):
    """Raised by a stream factory when its row cannot run here; the message is the reason shown."""


def require_cuda() -> None:
    """Raise :class:`Skipped` when there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise Skipped("no CUDA device here (torch.cuda.is_available() is False)")


@dataclass(frozen=True)
class TimingPlan:
    """How long to warm up and how many windows to time."""

    warmup_batches: int = 5
    repeats: int = 5
    # Few, and at least min_seconds: the slowest rows take a large part of a second for a large batch.
    min_batches: int = 4
    min_seconds: float = 2.0
    warmup_seconds: float = 1.0

    def __post_init__(self) -> None:
        if (
            self.warmup_batches < 0
            or self.repeats < 1
            or self.min_batches < 1
            or self.min_seconds < 0
            or self.warmup_seconds < 0
        ):
            raise ValueError(
                f"timing plan needs warmup_batches >= 0, repeats >= 1, min_batches >= 1 and min_seconds >= 0, got {self}"
            )

    @classmethod
    def quick(cls) -> "TimingPlan":
        """Just enough to check that every row runs (tiny data, figures not meaningful)."""
        return cls(warmup_batches=1, repeats=3, min_batches=2, min_seconds=0.1, warmup_seconds=0.0)


@dataclass(frozen=True)
class Timing:
    """Images/s of each timed window, and what they add up to.

    ``cpu_seconds`` is the CPU time the whole process tree spent in the windows
    (see :mod:`dali_pipes.bench.procfs`), ``None`` where it cannot be read.
    """

    values: tuple[float, ...]
    images: int
    seconds: float
    cpu_seconds: float | None = None
    #: Each window's ``(start, end)`` on :func:`time.perf_counter`'s clock, to match samples taken beside it.
    spans: tuple[tuple[float, float], ...] = ()

    @property
    def median(self) -> float:
        """The reported figure: the median images/s over the windows."""
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> float:
        """Half the range of the windows, relative to the median (0.05 = +-5%)."""
        return (self.high - self.low) / 2 / self.median if self.median > 0 else 0.0

    @property
    def cpu_seconds_per_1k(self) -> float | None:
        """CPU seconds (all cores, whole process tree) per 1,000 delivered images: what the row costs."""
        if self.cpu_seconds is None or self.images <= 0:
            return None
        return 1000 * self.cpu_seconds / self.images

    @property
    def cores_busy(self) -> float | None:
        """CPU seconds over wall seconds in the windows: how many cores the row kept busy on average."""
        if self.cpu_seconds is None or self.seconds <= 0:
            return None
        return self.cpu_seconds / self.seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "images_per_s": self.median,
            "spread": {"min": self.low, "max": self.high, "relative": self.spread, "windows": list(self.values)},
            "timed_images": self.images,
            "timed_seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "cpu_seconds_per_1k_images": self.cpu_seconds_per_1k,
            "cores_busy": self.cores_busy,
        }


@dataclass
class Row:
    """One line of a benchmark table: measured (``timing``), skipped (``skipped``) or failed (``error``)."""

    name: str
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    timing: Timing | None = None
    skipped: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def images_per_s(self) -> float | None:
        return self.timing.median if self.timing is not None else None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "description": self.description, "params": dict(self.params)}
        if self.timing is not None:
            data.update(self.timing.to_json())
        else:
            data["images_per_s"] = None
        data["skipped"] = self.skipped
        data["error"] = self.error
        if self.extra:
            data["extra"] = dict(self.extra)
        return data


class Target:
    """Where batches must end up: the GPU when CUDA is there (the copy is timed), else the host."""

    def __init__(self, device: str | None = None) -> None:
        import torch

        self._torch = torch
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError(f"target device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        self.device = device

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def put(self, tensor: Any) -> Any:
        """``tensor`` on the target device (asynchronous from pinned memory; :meth:`sync` waits)."""
        if self.is_cuda and not tensor.is_cuda:
            return tensor.to(self.device, non_blocking=True)
        return tensor

    def sync(self) -> None:
        """Wait for queued GPU work (copies, DALI's GPU stages, kernels); a no-op on the host."""
        if self.is_cuda:
            self._torch.cuda.synchronize(self.device)

    def memory_used(self) -> int | None:
        """Bytes in use on the target GPU, by every process and allocator (DALI's pools included); ``None`` on the host.

        Read from the driver (``cudaMemGetInfo``): torch's own counters do not see what DALI allocates.
        """
        if not self.is_cuda:
            return None
        free, total = self._torch.cuda.mem_get_info(self._torch.device(self.device))
        return int(total - free)


def record_gpu_memory(row: "Row", before: int | None, target: Target) -> None:
    """Put the GPU memory the row took while it opened and warmed up in ``row.extra["gpu_mb"]`` (on a GPU)."""
    after = target.memory_used()
    if before is not None and after is not None:
        row.extra["gpu_mb"] = round((after - before) / 1e6, 1)


def delivered(pairs: Iterable[Sequence[Any]], target: Target) -> Iterator[int]:
    """Turn ``(images, labels, ...)`` batches into delivered image counts, copying them to ``target``."""
    for batch in pairs:
        images = target.put(batch[0])
        for other in batch[1:]:
            target.put(other)
        yield int(images.shape[0])


def cycle(loader: Iterable[Any]) -> Iterator[Any]:
    """Iterate ``loader`` epoch after epoch (each ``iter()`` is a new pass)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the loader yielded no batch in a whole epoch; is the dataset smaller than one batch?")


def time_stream(stream: Iterator[int], plan: TimingPlan, target: Target, *, in_flight: int = 0) -> Timing:
    """Time ``stream`` after its warm-up (``plan.warmup_batches + in_flight`` batches and ``plan.warmup_seconds``).

    Returns ``plan.repeats`` consecutive windows of images/s.
    """
    warm_up(stream, plan, target, in_flight)
    return timing_of([time_window(stream, plan, target) for _ in range(plan.repeats)])


def warm_up(stream: Iterator[int], plan: TimingPlan, target: Target, in_flight: int = 0) -> None:
    """Drop the first batches: ``plan.warmup_batches + in_flight`` of them and at least ``plan.warmup_seconds``."""
    start = time.perf_counter()
    warmed = 0
    # Both a batch count (queues filled at start-up drain) and a time (lazy
    # initialisation, JIT and allocator warm-up in the first steps).
    while warmed < plan.warmup_batches + in_flight or time.perf_counter() - start < plan.warmup_seconds:
        next(stream)
        warmed += 1
    target.sync()


@dataclass(frozen=True)
class Window:
    """One timed window: images delivered, wall seconds, CPU seconds of the process tree (or ``None``), and when
    it started (:func:`time.perf_counter`)."""

    images: int
    seconds: float
    cpu_seconds: float | None
    started: float | None = None


def time_window(stream: Iterator[int], plan: TimingPlan, target: Target) -> Window:
    """Time one window of at least ``plan.min_batches`` batches and ``plan.min_seconds``."""
    images, batches = 0, 0
    cpu_before = tree_cpu_seconds()
    start = time.perf_counter()
    while True:
        images += next(stream)
        batches += 1
        # The window's length is checked on host time; the figure uses the time
        # after the sync below, which also counts GPU work still queued.
        if batches >= plan.min_batches and time.perf_counter() - start >= plan.min_seconds:
            break
    target.sync()
    elapsed = time.perf_counter() - start
    return Window(images, elapsed, _cpu_since(cpu_before), start)


def time_cold(factory: StreamFactory, images: int, repeats: int, target: Target) -> Timing:
    """Time ``images`` images from a fresh stream, start-up included, ``repeats`` times.

    What a short job sees: building the pipeline and starting its workers count,
    because for few images they are most of the time. Shutting down is not timed.
    """
    windows = []
    for _ in range(repeats):
        collect_garbage()
        cpu_before = tree_cpu_seconds()
        start = time.perf_counter()
        with factory() as stream:
            done = 0
            while done < images:
                done += next(stream)
            target.sync()
            elapsed = time.perf_counter() - start
            cpu = _cpu_since(cpu_before)  # inside the with: the workers are alive and counted
        windows.append(Window(done, elapsed, cpu))
    return timing_of(windows)


def timing_of(windows: Sequence[Window]) -> Timing:
    """The :class:`Timing` of ``windows`` (CPU time ``None`` if any window lacks it)."""
    cpu = [w.cpu_seconds for w in windows]
    return Timing(
        tuple(w.images / w.seconds for w in windows),
        sum(w.images for w in windows),
        sum(w.seconds for w in windows),
        None if any(c is None for c in cpu) else sum(c for c in cpu if c is not None),
        tuple((w.started, w.started + w.seconds) for w in windows if w.started is not None),
    )


def _cpu_since(before: float | None) -> float | None:
    after = tree_cpu_seconds()
    return None if before is None or after is None else after - before


@dataclass
class Job:
    """A row to measure: its stream factory and how to time it (steady state, or cold for ``cold_images``).

    ``in_flight`` is how many batches the stream may hold ready ahead of the
    consumer (a DataLoader's ``num_workers * prefetch_factor``, DALI's queues):
    they are added to the warm-up, because batches made during start-up and
    handed over at once would count as instant.
    """

    name: str
    factory: StreamFactory
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    cold_images: int | None = None
    in_flight: int = 0
    #: Whether the row runs a DALI pipeline in this process (side by side, such rows open last).
    runs_dali: bool = False


def measure(job: Job, plan: TimingPlan, target: Target) -> Row:
    """Run one row: its stream timed, or the reason it was skipped, or the error it failed with.

    A failing row does not stop the others (a user still wants the other
    figures); its error is kept in the row and logged with the traceback.
    """
    name = job.name
    row = Row(name, job.description, dict(job.params))
    log.debug("bench: %s %s", name, job.params)
    try:
        collect_garbage()
        if job.cold_images is not None:
            row.timing = time_cold(job.factory, job.cold_images, plan.repeats, target)
        else:
            before = target.memory_used()
            with job.factory() as stream:
                row.timing = time_stream(stream, plan, target, in_flight=job.in_flight)
                record_gpu_memory(row, before, target)
    except Exception as exc:  # noqa: BLE001 - recorded in the row, shown in the table, exit status non-zero
        record_outcome(row, exc)
    return row


def record_outcome(row: Row, exc: Exception) -> None:
    """Put why ``row`` did not run in it: the reason of a :class:`Skipped`, else the error (logged with its traceback)."""
    if isinstance(exc, Skipped):
        row.skipped = str(exc)
        log.debug("bench: %s skipped: %s", row.name, exc)
    else:
        row.error = f"{type(exc).__name__}: {exc}"
        log.warning("bench: %s failed", row.name, exc_info=exc)


def collect_garbage() -> None:
    # Drop the previous row's pipelines before the next one starts: a worker forked
    # while an old DALI pipeline is uncollected garbage can hang finalizing it (see
    # DALILoader._build), and its threads and memory would burden the next row.
    gc.collect()


def warm_page_cache(paths: Iterable[Path]) -> int:
    """Read every file once so that all rows read from memory alike; return the bytes read."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    total += len(chunk)
    return total


@contextlib.contextmanager
def quiet(*names: str) -> Iterator[None]:
    """Hold these loggers at WARNING: a row that converts, stages or caches again each run would otherwise bury
    the table under the same INFO lines."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
