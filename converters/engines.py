"""Where shard tasks run: a local process pool (the default) or a Dask distributed cluster.

An engine takes the calls of :func:`converters.runner.write_shard`, one a shard, runs
them, and yields each shard's record as it completes. Everything that makes a run
resumable lives in ``write_shard`` itself (it writes the shard under a temporary
name, renames it and only then writes its job record), so an engine need not know
about it: a task that dies leaves no record, and is redone by a retry or a re-run.

Dask is an optional extra (``pip install dali-pipes[dask]``), imported only when the
``dask`` engine is chosen. Its workers must see the output folder and the input
files at the same paths as this process: a shared filesystem.

When a task fails, the others must stop before the runner clears the output: the
local pool sets a shared event that its workers check between samples; on Dask the
run is marked stopped in every worker process (``client.run``), the futures are
cancelled, and the engine waits until no task of the run still executes (Dask
cannot interrupt a running task: a cancelled one runs on until it returns).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any, Callable, Iterator, Sequence

from converters.base import ConversionError
from converters.ctrl_c import CtrlC
from dali_pipes.remote.urls import redact_log_lines

log = logging.getLogger(__name__)

ENGINES = ("local", "dask")

#: One shard task: a key (the shard number), the function and its arguments. The function
#: also takes a keyword ``stop``: a callable that says whether to abandon the task. An engine's
#: ``shared`` arguments (the source) come first: sent once to each worker, not in every task.
Task = tuple[int, Callable[..., dict[str, Any]], tuple[Any, ...]]
Progress = Callable[[int], None]

#: How long a stopped local pool (a failure, or Ctrl-C) waits for its workers to give up before ending them.
STOP_GRACE = 5.0

#: How long a failed Dask run waits for its tasks still running on workers to give up.
DASK_STOP_TIMEOUT = 120.0


class WorkerDied(ConversionError):
    """A local worker process ended abruptly (a signal, such as a crash in a C library, or ``os._exit``).

    ``key`` is the task it was running (``None`` when unknown), ``how`` says how it ended.
    """

    def __init__(self, key: int | None, how: str) -> None:
        shard = "a shard" if key is None else f"shard {key}"
        super().__init__(f"the worker process writing {shard} died ({how})")
        self.key = key
        self.how = how

    def __reduce__(self):
        return (WorkerDied, (self.key, self.how))


class _TrackingSpawnContext(SpawnContext):
    """The spawn context, keeping every process it starts: their exit codes say which worker died how."""

    def __init__(self) -> None:
        super().__init__()
        self.processes: list[SpawnProcess] = []
        # A factory, not a subclass: spawn pickles the process object, so its class must be importable.
        self.Process = self._process  # type: ignore[assignment, method-assign]

    def _process(self, *args: Any, **kwargs: Any) -> SpawnProcess:
        process = SpawnProcess(*args, **kwargs)
        self.processes.append(process)
        return process


# In each local worker process: its row in the table of (pid, running task key) shared with the runner,
# and the arguments every task takes first (sent once, when the process starts).
_task_table: Any = None
_task_row: int | None = None
_shared_args: tuple[Any, ...] = ()


def _init_local_worker(
    table: Any, shared: tuple[Any, ...], initializer: Callable[..., None], queue: Any, stop: Any
) -> None:
    global _task_table, _task_row, _shared_args
    # A terminal's Ctrl-C goes to the whole process group. Only the runner acts on it (it sets ``stop``, which
    # the tasks check between samples), so a worker is never interrupted half-way through a shard or while
    # exiting, where it could wait for ever on a queue nobody reads any more.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the runner while it spawned this
    # Progress ticks still buffered when the worker exits are dropped rather than waited for: after a stop the
    # runner no longer reads the queue, and a full pipe would keep this process from exiting.
    queue.cancel_join_thread()
    # A spawned worker has no logging set up: its warnings (an input named by its URL) go to logging's last
    # resort, which must not print a URL's password any more than the parent's handlers do.
    redact_log_lines()
    _task_table = table
    _shared_args = shared
    with table.get_lock():
        for row in range(len(table) // 2):
            if table[2 * row] == 0:
                table[2 * row] = os.getpid()
                table[2 * row + 1] = -1
                _task_row = row
                break
    initializer(queue, stop)


def _run_local_task(key: int, fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> dict[str, Any]:
    """Run one task in a local worker, noting its key first (shared memory: visible even if this process crashes)."""
    if _task_row is not None:
        _task_table[2 * _task_row + 1] = key
    try:
        return fn(*_shared_args, *args)
    finally:
        if _task_row is not None:
            _task_table[2 * _task_row + 1] = -1


class LocalEngine:
    """A pool of ``workers`` spawned processes on this machine; progress comes per sample through a queue."""

    def __init__(self, workers: int, initializer: Callable[[Any, Any], None]) -> None:
        self.workers = workers
        self.initializer = initializer

    def run(
        self, tasks: Sequence[Task], progress: Progress, shared: tuple[Any, ...] = ()
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Run ``tasks`` and yield ``(key, record)`` as each completes; the first failure is raised.

        ``shared`` is pickled once per worker process (with its initializer) and passed first to every task.

        A worker that dies (a crash in a C library, a signal) raises :class:`WorkerDied`
        naming the task it was running, once every worker has ended.
        """
        ctx = _TrackingSpawnContext()  # spawn: fork is unsafe once DALI or torch threads exist in this process
        queue = ctx.Queue()
        stop = ctx.Event()
        workers = min(self.workers, len(tasks))
        # (pid, key) per worker process; a pool never starts more processes than workers.
        table = ctx.Array("q", 2 * workers)
        broken: BrokenProcessPool | None = None
        initargs = (table, tuple(shared), self.initializer, queue, stop)
        pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_local_worker, initargs=initargs)
        ctrl_c = CtrlC()
        ctrl_c.hold()
        try:
            with _sigint_blocked():  # the first submit spawns the workers
                pending: dict[Future, int] = {
                    pool.submit(_run_local_task, key, fn, args): key for key, fn, args in tasks
                }
            while pending and broken is None:
                finished, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(queue, progress)
                ctrl_c.deliver()  # here, between calls into the pool: KeyboardInterrupt by default
                for future in finished:
                    key = pending.pop(future)
                    try:
                        record = future.result()
                    except BrokenProcessPool as exc:
                        broken = exc
                        break
                    with ctrl_c.released():  # the caller's own code, between records, is interrupted as usual
                        yield key, record
            pool.shutdown(wait=True)
            _drain(queue, progress)
        except BaseException:
            # A failure, or Ctrl-C (KeyboardInterrupt): running workers abandon their shards, the rest never start.
            # A second Ctrl-C meanwhile is only noted (the handler is still held here; hold() only makes sure):
            # the stop is bounded (STOP_GRACE), and cut short it would leave workers running.
            ctrl_c.hold()
            stop.set()
            _stop_pool(pool, ctx.processes, queue, progress)
            raise
        finally:
            ctrl_c.release()
        ctrl_c.deliver()  # one that came while the pool ended (every shard is written, but the caller is told)
        if broken is not None:
            # The pool has joined every process by now, so each has its exit code.
            raise _death(ctx.processes, table) from broken


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while it spawns workers, which start with the mask of the thread that spawned them.

    Blocked, a Ctrl-C that arrives while a worker is still importing stays pending there, and is dropped once
    its initializer ignores SIGINT (otherwise it would end the start-up with a traceback). This process's own
    Ctrl-C meanwhile is only noted by :class:`~converters.ctrl_c.CtrlC` (when another of its threads takes it,
    or once the mask is put back) and raised after every worker is started, so that none is left half-way through its start-up
    handshake, which ends it with an ``EOFError`` traceback.
    """
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)


def _stop_pool(pool: ProcessPoolExecutor, processes: Sequence[SpawnProcess], queue: Any, progress: Progress) -> None:
    """End the pool within :data:`STOP_GRACE` seconds, whatever state its workers are in.

    The workers were told to stop (they check between samples, and finish publishing a shard already being
    renamed into place); the queue is drained meanwhile so that none waits on a full pipe. A worker still
    alive after the grace period (a sample that takes long to decode, a start-up interrupted half-way) is
    terminated, then killed: what it leaves is a temporary file, which the next run removes.
    """
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + STOP_GRACE
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        _drain(queue, progress)
        time.sleep(0.05)
    for ending in (SpawnProcess.terminate, SpawnProcess.kill):
        alive = [p for p in processes if p.is_alive()]
        for process in alive:
            ending(process)
        for process in alive:
            process.join(timeout=2.0)
    _drain(queue, progress)
    pool.shutdown(wait=True)  # every process has ended: the pool's own thread notices and returns


def _death(processes: Sequence[SpawnProcess], table: Any) -> WorkerDied:
    """Which worker died first, running which task, and how.

    When one worker dies the pool terminates the others (SIGTERM), so a death by
    another signal, or a non-zero exit, is the cause.
    """
    dead = [p for p in processes if p.exitcode not in (0, None)]
    dead.sort(key=lambda p: p.exitcode == -signal.SIGTERM)
    if not dead:
        return WorkerDied(None, "it ended without an exit code")
    first = dead[0]
    key = None
    for row in range(len(table) // 2):
        if table[2 * row] == first.pid and table[2 * row + 1] >= 0:
            key = int(table[2 * row + 1])
    return WorkerDied(key, _exit_reason(first.exitcode))


def _exit_reason(code: int) -> str:
    """``'signal SIGSEGV: Segmentation fault'`` for a death by signal, ``'exit status 3'`` otherwise."""
    if code >= 0:
        return f"exit status {code}"
    try:
        number = signal.Signals(-code)
    except ValueError:
        return f"signal {-code}"
    return f"signal {number.name}: {signal.strsignal(number)}"


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

    def run(
        self, tasks: Sequence[Task], progress: Progress, shared: tuple[Any, ...] = ()
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Run ``tasks`` on the cluster and yield ``(key, record)`` as each completes.

        ``shared`` is scattered to every worker once and passed first to every task.
        """
        distributed = _import_distributed()
        try:
            # How long to try is Dask's own setting, distributed.comm.timeouts.connect (30 s by default).
            client = distributed.Client(self.scheduler, set_as_default=False)
        except (OSError, TimeoutError) as exc:
            raise ConversionError(f"cannot reach the Dask scheduler at {self.scheduler}: {exc}") from exc
        with client:
            # Keys unique to this run: the scheduler must not hand back a result held from an earlier run.
            run_id = uuid.uuid4().hex[:12]
            prefix = f"dali-pipes-{run_id}-"
            # Wrapped in a list: scatter would spread a collection (a dataset that is a list) element by element.
            on_workers = [client.scatter([arg], broadcast=True, hash=False)[0] for arg in shared]
            futures = {
                client.submit(
                    _run_dask_task, run_id, fn, args, *on_workers, key=f"{prefix}shard-{key:05d}", pure=False
                ): key
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
                    progress(record.inputs_done)
                    yield futures[future], record
            except BaseException:
                _stop_dask_run(client, run_id, prefix, list(futures))
                raise


# In each Dask worker process: the runs told to stop (a set, since one worker may serve several runs).
_stopped_runs: set[str] = set()


def _run_dask_task(
    run_id: str, fn: Callable[..., dict[str, Any]], args: tuple[Any, ...], *shared: Any
) -> dict[str, Any]:
    """Run one task on a Dask worker (``shared``: the scattered arguments); it gives up as soon as its run is stopped."""
    return fn(*shared, *args, stop=functools.partial(_run_stopped, run_id))


def _run_stopped(run_id: str) -> bool:
    return run_id in _stopped_runs


def _stop_run_here(run_id: str) -> None:
    """On each worker (through ``client.run``): make this run's tasks give up at their next sample."""
    _stopped_runs.add(run_id)


def _running_here(prefix: str, dask_worker: Any) -> list[str]:
    """On each worker: the keys of this run still executing (a cancelled task runs on until it returns)."""
    return [str(ts.key) for ts in dask_worker.state.executing if str(ts.key).startswith(prefix)]


def _stop_dask_run(client: Any, run_id: str, prefix: str, futures: list[Any]) -> None:
    """After a failure: stop the run's running tasks, cancel the rest, and wait until none runs any more.

    Dask cannot interrupt a running task, and one that ran on would write its shard
    into a folder the runner is about to clear, so the runner waits for them.
    """
    try:
        client.run(_stop_run_here, run_id)
    except Exception as exc:  # noqa: BLE001 - a worker lost meanwhile; its tasks died with it
        log.debug("telling the Dask workers to stop failed: %s", exc)
    client.cancel(futures)
    deadline = time.monotonic() + DASK_STOP_TIMEOUT
    while True:
        try:
            running = [key for keys in client.run(_running_here, prefix).values() for key in keys]
        except Exception as exc:  # noqa: BLE001 - as above
            log.debug("asking the Dask workers what still runs failed: %s", exc)
            running = []
        if not running:
            return
        if time.monotonic() > deadline:
            log.warning(
                "Dask tasks %s still run after %.0f s; they may write into the output", running, DASK_STOP_TIMEOUT
            )
            return
        time.sleep(0.1)


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
