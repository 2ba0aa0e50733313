"""Where shard tasks run: a local process pool (the default) or a Dask distributed cluster.

An engine takes the calls of :func:`converters.runner.write_shard`, one a shard, runs
them, and yields each shard's record as it completes. Everything that makes a run
resumable lives in ``write_shard`` itself (it writes the shard under a temporary
name, renames it and only then writes its job record), so an engine need not know
about it: a task that dies leaves no record, and is redone by a retry or a re-run.

Dask is an optional extra (``pip install dali-pipes[dask]``), imported only when the
``dask`` engine is chosen. Its workers must see the output folder and the input
files at the same paths as this process: a shared filesystem.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, Callable, Iterator, Sequence

from converters.base import ConversionError

log = logging.getLogger(__name__)

ENGINES = ("local", "dask")

#: One shard task: a key (the shard number), the function and its arguments.
Task = tuple[int, Callable[..., dict[str, Any]], tuple[Any, ...]]
Progress = Callable[[int], None]


class LocalEngine:
    """A pool of ``workers`` spawned processes on this machine; progress comes per sample through a queue."""

    def __init__(self, workers: int, initializer: Callable[[Any, Any], None]) -> None:
        self.workers = workers
        self.initializer = initializer

    def run(self, tasks: Sequence[Task], progress: Progress) -> Iterator[tuple[int, dict[str, Any]]]:
        """Run ``tasks`` and yield ``(key, record)`` as each completes; the first failure is raised."""
        ctx = mp.get_context("spawn")  # fork is unsafe once DALI or torch threads exist in this process
        queue = ctx.Queue()
        stop = ctx.Event()
        workers = min(self.workers, len(tasks))
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=self.initializer, initargs=(queue, stop)) as pool:
            pending: dict[Future, int] = {pool.submit(fn, *args): key for key, fn, args in tasks}
            try:
                while pending:
                    finished, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    _drain(queue, progress)
                    for future in finished:
                        key = pending.pop(future)
                        yield key, future.result()
            except BaseException:
                # Tell running workers to abandon their shards, and drop those not started.
                stop.set()
                for future in pending:
                    future.cancel()
                raise
            finally:
                _drain(queue, progress)


def _drain(queue: Any, progress: Progress) -> None:
    while True:
        try:
            progress(queue.get_nowait())
        except Exception:  # noqa: BLE001 - queue.Empty, or a closed queue at shutdown
            return


class DaskEngine:
    """The workers of the Dask cluster whose scheduler listens at ``scheduler``.

    Progress is reported per completed shard (its samples and left-out inputs at
    once). A worker that dies mid-shard makes the scheduler run that shard again
    elsewhere, up to its ``distributed.scheduler.allowed-failures``.
    """

    def __init__(self, scheduler: str) -> None:
        self.scheduler = scheduler

    def run(self, tasks: Sequence[Task], progress: Progress) -> Iterator[tuple[int, dict[str, Any]]]:
        """Run ``tasks`` on the cluster and yield ``(key, record)`` as each completes."""
        distributed = _import_distributed()
        try:
            # How long to try is Dask's own setting, distributed.comm.timeouts.connect (30 s by default).
            client = distributed.Client(self.scheduler, set_as_default=False)
        except (OSError, TimeoutError) as exc:
            raise ConversionError(f"cannot reach the Dask scheduler at {self.scheduler}: {exc}") from exc
        with client:
            # Keys unique to this run: the scheduler must not hand back a result held from an earlier run.
            run_id = uuid.uuid4().hex[:12]
            futures = {
                client.submit(fn, *args, key=f"dali-pipes-{run_id}-shard-{key:05d}", pure=False): key
                for key, fn, args in tasks
            }
            try:
                for future in distributed.as_completed(futures, loop=client.loop):
                    try:
                        record = future.result()
                    except distributed.KilledWorker as exc:
                        raise ConversionError(
                            f"shard-{futures[future]:05d}: every Dask worker that ran it died ({exc}); "
                            "the finished shards are kept: run the same command again to resume"
                        ) from exc
                    progress(record["num_samples"] + len(record["errors"]))
                    yield futures[future], record
            except BaseException:
                client.cancel(list(futures))
                raise


def _import_distributed() -> Any:
    try:
        import distributed
    except ImportError as exc:
        raise ConversionError(
            "--engine dask needs Dask distributed; install it with: pip install 'dali-pipes[dask]'"
        ) from exc
    return distributed


def make_engine(engine: str, *, workers: int, scheduler: str | None, initializer: Callable[[Any, Any], None]):
    """The engine named ``engine``, checking its options; raises :class:`ConversionError` for bad ones."""
    if engine not in ENGINES:
        raise ConversionError(f"unknown --engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "dask":
        if not scheduler:
            raise ConversionError("--engine dask needs --scheduler ADDRESS (e.g. tcp://10.0.0.1:8786)")
        _import_distributed()  # before the output folder is touched
        return DaskEngine(scheduler)
    if scheduler:
        raise ConversionError("--scheduler is only used with --engine dask")
    return LocalEngine(workers, initializer)
