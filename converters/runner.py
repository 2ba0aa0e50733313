"""The parallel, resumable conversion of a :class:`~converters.base.Source` into shards.

How a run proceeds, and why it survives a crash or a kill at any point:

1. The input is enumerated and cut into shards (:mod:`converters.planner`). The
   job's identity (source, options, format and plan) is hashed into a digest and
   kept in ``OUT/.dali-pipes-job/job.json``.
2. Each shard is written by a worker process under ``shard-NNNNN.EXT.tmp``, flushed,
   renamed to its final name, and only then recorded as done by an atomic
   ``.dali-pipes-job/shard-NNNNN.json``. A shard without that record is redone.
3. When every shard is done, ``errors.jsonl`` and then ``index.json`` are written
   atomically, and the job folder is removed. A dataset is complete exactly when
   its ``index.json`` exists.

Re-running the same command after a crash skips the recorded shards and writes the
rest; since each shard depends only on its own items, the result is byte for byte
what an uninterrupted run writes, whatever the worker count.

Faults end the job with one line naming the shard: a full disk or file-size limit
(whatever error type the writer's library wraps it in; the message says which limit
and how much space the output folder has left), or a worker process that died (a
signal, with its name). Neither leaves anything of that shard, and the shards
recorded as done stay, so the same command continues once the cause is gone.
With ``--on-error fail`` the first bad input stops every other shard (local or on
Dask) before the job's files are removed, so nothing is written afterwards.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm import tqdm

from converters.base import ConversionError, Item, SampleError, Source
from converters.diskfull import disk_full_errno, disk_full_why, free_space, is_disk_full
from converters.engines import LocalEngine, WorkerDied, make_engine
from converters.planner import ShardPlan, plan_shards
from converters.writers import writer_class
from dali_pipes import __version__
from dali_pipes._fileio import atomic_write_bytes, fsync_dir, sha256_file
from dali_pipes.manifest import (
    ERRORS_NAME,
    FORMATS,
    JOB_DIR,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    Shard,
    load_manifest,
    write_manifest,
)

log = logging.getLogger(__name__)

LOCK_NAME = ".dali-pipes.lock"
ON_ERROR = ("skip", "fail")
_TMP_SUFFIX = ".tmp"
_PROGRESS_EVERY = 8  # samples between progress messages from a worker


@dataclass
class ConvertResult:
    """What a conversion produced: the dataset folder, its manifest and the inputs left out."""

    out: Path
    manifest: Manifest
    errors: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    resumed_shards: int = 0
    already_complete: bool = False

    @property
    def num_samples(self) -> int:
        return self.manifest.num_samples

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.manifest.shards)


def shard_name(number: int, suffix: str) -> str:
    """The file name of shard ``number``: ``shard-00042.lmdb``."""
    return f"shard-{number:05d}{suffix}"


def convert(
    source: Source,
    out: str | os.PathLike,
    *,
    format: str,
    samples_per_shard: int | None = None,
    shard_size: int | None = None,
    workers: int | None = None,
    on_error: str = "skip",
    progress: bool = True,
    engine: str = "local",
    scheduler: str | None = None,
) -> ConvertResult:
    """Convert ``source`` into a dataset folder ``out`` of ``format`` shards.

    ``workers`` processes write shards in parallel (default: all cores; ``1`` runs
    in this process). ``on_error="skip"`` leaves bad inputs out and lists them in
    ``errors.jsonl``; ``"fail"`` stops at the first one, removes what this job
    wrote, and raises :class:`SampleError`. Re-running an interrupted conversion
    with the same arguments completes it. Raises :class:`ConversionError` for a
    job that cannot start (bad option, empty input, output holding something else).

    ``engine="dask"`` runs the shards on the Dask cluster at ``scheduler`` instead
    (``workers`` is then unused); the output is the same bytes, and either engine
    resumes what the other left unfinished.
    """
    started = time.perf_counter()
    if format not in FORMATS:
        raise ConversionError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if on_error not in ON_ERROR:
        raise ConversionError(f"unknown --on-error {on_error!r}; choose skip or fail")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ConversionError(f"--workers must be at least 1, got {workers}")
    runner = make_engine(engine, workers=workers, scheduler=scheduler, initializer=_init_worker)

    out = Path(out)
    items = source.items()
    plans = plan_shards(
        items, samples_per_shard=samples_per_shard, shard_size=shard_size, boundaries=source.input_boundaries()
    )
    digest = _job_digest(source, format, items, plans)

    finished = _finished_dataset(out, digest)
    if finished is not None:
        # Said once, by the caller (the CLI's summary line); here only for debugging.
        log.debug("%s is already a complete conversion of this input; nothing to do", out)
        return ConvertResult(out, finished, _read_errors(out), time.perf_counter() - started, already_complete=True)

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    job_dir = out / JOB_DIR
    with OutputLock(out):
        _claim_output(out, f"{digest}:layout-{SHARD_LAYOUT_VERSION}", source, format, created)
        suffix = writer_class(format).suffix
        _remove_temporaries(out)
        results = {p.number: r for p in plans if (r := _done_record(out, p, suffix)) is not None}
        if results:
            log.info("resuming: %d of %d shards were already written", len(results), len(plans))
        todo = [p for p in plans if p.number not in results]
        try:
            _run_shards(source, format, items, todo, out, on_error, runner, progress, results, len(items))
        except SampleError:
            # --on-error fail: nothing of this job may look usable afterwards.
            _discard_job(out, created)
            raise
        manifest = _assemble(out, source, format, plans, results, digest)
        shutil.rmtree(job_dir, ignore_errors=True)
    errors = [e for p in plans for e in results[p.number]["errors"]]
    result = ConvertResult(out, manifest, errors, time.perf_counter() - started, resumed_shards=len(plans) - len(todo))
    log.debug(  # the caller reports the result (the CLI's summary line); this is for debugging only
        "wrote %d samples in %d shards to %s (%d inputs left out) in %.1f s",
        manifest.num_samples,
        len(manifest.shards),
        out,
        len(errors),
        result.seconds,
    )
    return result


# --- the job and its output folder -------------------------------------------------------


#: Bumped whenever a writer's bytes change for the same input (2: HDF5 written through
#: GuardedFile; 3: TFRecord arrays in int64/float lists, and a CRC32C per field of each sample in LMDB
#: and HDF5 shards). It is part of an unfinished job's record, so a job started by another
#: version is refused instead of resumed into a mix of old and new shards; a dataset that
#: another version finished is still recognised as complete (it is a valid dataset).
SHARD_LAYOUT_VERSION = 3


def _job_digest(source: Source, fmt: str, items: Sequence[Item], plans: Sequence[ShardPlan]) -> str:
    """A hash of everything that determines the output bytes, to recognise the same job on a re-run."""
    digest = hashlib.sha256()
    header = {
        "format": fmt,
        "source": source.describe(),
        "shards": [[p.start, p.stop] for p in plans],
    }
    digest.update(json.dumps(header, sort_keys=True, default=str).encode())
    for item in items:
        digest.update(f"{item.name}\0{item.size}\n".encode())
    return digest.hexdigest()


def _finished_dataset(out: Path, digest: str) -> Manifest | None:
    """The manifest of ``out`` when it is a complete conversion of this very job."""
    if not (out / MANIFEST_NAME).exists():
        return None
    try:
        manifest = load_manifest(out)
    except ManifestError as exc:
        raise ConversionError(
            f"{out} already holds a dataset whose manifest cannot be read ({exc}); choose another output folder"
        ) from exc
    if manifest.source.get("job") != digest:
        raise ConversionError(
            f"{out} already holds a different dataset; choose another output folder or delete this one"
        )
    return manifest


def _claim_output(out: Path, digest: str, source: Source, fmt: str, created: bool) -> None:
    """Make ``out`` this job's folder, or refuse when it holds anything else."""
    job_file = out / JOB_DIR / "job.json"
    if job_file.exists():
        try:
            previous = json.loads(job_file.read_text())
        except (OSError, json.JSONDecodeError):
            previous = {}
        if previous.get("digest") != digest:
            raise ConversionError(
                f"{out} holds an unfinished conversion of a different input, with other options or by "
                "another version of dali-pipes; re-run that command to finish it, or choose another output folder"
            )
        return
    others = [p.name for p in out.iterdir() if p.name not in (JOB_DIR, LOCK_NAME)]
    if others:
        raise ConversionError(
            f"{out} exists and is not empty ({', '.join(sorted(others)[:3])}...); choose a new or empty output folder"
        )
    (out / JOB_DIR).mkdir(exist_ok=True)
    record = {"digest": digest, "format": fmt, "source": source.describe(), "created_output": created}
    atomic_write_bytes(job_file, json.dumps(record, indent=1, default=str).encode())


class OutputLock:
    """An exclusive lock on the output folder: two conversions into one folder refuse to run at once."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK_NAME
        self.fd: int | None = None

    def __enter__(self) -> "OutputLock":
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise ConversionError(
                f"another conversion is writing into {self.path.parent} right now; wait for it to finish"
            ) from None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


def _remove_temporaries(out: Path) -> None:
    """Delete shard files a killed run left half-written."""
    for path in out.glob(f"shard-*{_TMP_SUFFIX}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _done_record(out: Path, plan: ShardPlan, suffix: str) -> dict[str, Any] | None:
    """The recorded result of a shard finished by an earlier run, if its files are intact."""
    record_file = out / JOB_DIR / f"{shard_name(plan.number, '')}.json"
    if not record_file.exists():
        return None
    try:
        record = json.loads(record_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    shard_file = out / record["path"]
    if not shard_file.exists() or shard_file.stat().st_size != record["bytes"]:
        return None
    if record.get("index_path") and not (out / record["index_path"]).exists():
        return None
    return record


def _discard_job(out: Path, created: bool) -> None:
    """Remove everything this job wrote (after ``--on-error fail``)."""
    for path in out.glob("shard-*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    shutil.rmtree(out / JOB_DIR, ignore_errors=True)
    (out / LOCK_NAME).unlink(missing_ok=True)
    if created:
        try:
            out.rmdir()
        except OSError:
            pass


def _assemble(out: Path, source: Source, fmt: str, plans, results, digest: str) -> Manifest:
    """Write ``errors.jsonl`` and then the manifest, in shard order."""
    shards = []
    errors = []
    for plan in plans:
        record = results[plan.number]
        shards.append(
            Shard(
                path=record["path"],
                num_samples=record["num_samples"],
                bytes=record["bytes"],
                sha256=record["sha256"],
                index_path=record.get("index_path"),
                index_sha256=record.get("index_sha256"),
            )
        )
        errors.extend(record["errors"])
    if sum(s.num_samples for s in shards) == 0:
        raise ConversionError(f"no input could be converted: all {len(errors)} inputs failed (see the messages above)")
    lines = "".join(json.dumps(e, sort_keys=True) + "\n" for e in errors)
    atomic_write_bytes(out / ERRORS_NAME, lines.encode())
    manifest = Manifest(
        format=fmt,
        fields=source.fields(),
        shards=tuple(shards),
        source={**source.describe(), "job": digest},
        classes=source.classes(),
        extra=source.extra(),
        created_by=f"dali-pipes {__version__}",
    )
    write_manifest(out, manifest)
    return manifest


def _read_errors(out: Path) -> list[dict[str, str]]:
    path = out / ERRORS_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- running shards ------------------------------------------------------------------------

# Set in each worker process by _init_worker: where to report progress, and when to stop early.
_progress_queue: Any = None
_stop_event: Any = None


def _init_worker(progress_queue: Any, stop_event: Any) -> None:
    global _progress_queue, _stop_event
    _progress_queue = progress_queue
    _stop_event = stop_event


class _Stopped(Exception):
    """Another worker failed with --on-error fail; this shard is abandoned."""


def _run_shards(source, fmt, items, todo, out, on_error, engine, progress, results, total) -> None:
    """Write the shards of ``todo`` with ``engine`` (or in this process when there is one worker or shard)."""
    done_before = sum(results[n]["num_samples"] + len(results[n]["errors"]) for n in results)
    bar = tqdm(
        total=total, initial=done_before, unit="img", desc=f"convert {fmt}", disable=not progress, smoothing=0.05
    )
    try:
        if isinstance(engine, LocalEngine) and (engine.workers == 1 or len(todo) <= 1):
            _init_worker(None, None)
            for plan in todo:
                record = write_shard(source, fmt, plan, items[plan.start : plan.stop], out, on_error, bar.update)
                results[plan.number] = record
            return
        # An absolute output path, so that workers started elsewhere (a Dask cluster) write to the same folder.
        tasks = shard_tasks(source, fmt, items, todo, out.absolute(), on_error)
        try:
            for number, record in engine.run(tasks, bar.update, shared=(source,)):
                results[number] = record
        except WorkerDied as exc:
            # Every worker has ended: what they left half-written is garbage. Say which shard killed its worker.
            _remove_temporaries(out)
            which = "a shard" if exc.key is None else str(out / shard_name(exc.key, writer_class(fmt).suffix))
            raise ConversionError(
                f"{which}: the worker writing this shard died ({exc.how}); nothing of it was kept "
                f"({free_space(out)}: if the disk is full, free space first). The finished shards are kept: "
                "run the same command again to continue"
            ) from exc
    finally:
        bar.close()


def shard_tasks(
    source: Source, fmt: str, items: Sequence[Item], plans: Sequence[ShardPlan], out: Path, on_error: str
) -> list[tuple[int, Callable[..., dict[str, Any]], tuple[Any, ...]]]:
    """One engine task per shard: its :func:`write_shard` call, carrying only that shard's items.

    The source is not in the tasks: the engine sends it to each worker once and
    passes it first (``engine.run(..., shared=(source,))``), since a dataset may be
    large to pickle. Its fields are asked for first, in this process: a source that
    works them out lazily (a list file's labels) then carries the answer to the
    workers instead of each task re-reading the whole input to find it.
    """
    source.fields()
    return [(plan.number, write_shard, (fmt, plan, items[plan.start : plan.stop], out, on_error)) for plan in plans]


def write_shard(
    source: Source,
    fmt: str,
    plan: ShardPlan,
    items: Sequence[Item],
    out: Path,
    on_error: str,
    on_progress=None,
    *,
    stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Write one shard under a temporary name, rename it into place, and record it as done.

    ``stop`` says whether to abandon the shard (another shard failed with
    ``--on-error fail``); without it, the stop event of this worker process is asked.
    Returns the shard's record: path, count, size, hashes and the inputs left out.
    """
    writer_cls = writer_class(fmt)
    final = out / shard_name(plan.number, writer_cls.suffix)
    tmp = final.with_name(final.name + _TMP_SUFFIX)
    fields = source.fields()
    errors: list[dict[str, str]] = []
    count = 0
    unreported = 0
    if stop is None:
        stop = _stop_requested
    # A retried task (a Dask worker died mid-shard) finds the dead attempt's half-written files.
    for stale in out.glob(f"{glob.escape(tmp.name)}*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    writer = None
    try:
        _check_job_alive(out, stop)
        writer = writer_cls(tmp, fields)
        for item in items:
            if stop():
                raise _Stopped()
            try:
                sample = source.load(item)
            except SampleError as exc:
                if on_error == "fail":
                    raise
                log.warning("left out %s: %s", exc.name, exc.reason)
                errors.append({"input": exc.name, "reason": exc.reason, "shard": final.name})
            else:
                if sample.keys() != fields.keys():
                    raise ValueError(f"{item.name}: the source gave fields {sorted(sample)}, expected {sorted(fields)}")
                writer.write(sample)
                count += 1
            unreported += 1
            if unreported >= _PROGRESS_EVERY:
                _report(unreported, on_progress)
                unreported = 0
        writer.close()
        # The job may have been given up while this shard was written (a Dask task that ran on).
        _check_job_alive(out, stop)
    except BaseException as exc:
        if writer is not None:
            try:
                writer.abort()
            except Exception as abort_exc:  # noqa: BLE001 - closing may flush, and fail again (disk full)
                # The shard is discarded anyway: its removal below, and the first error, are what matter.
                log.debug("closing the abandoned %s failed too: %s", tmp.name, abort_exc)
        for leftover in out.glob(f"{glob.escape(tmp.name)}*"):  # the shard and its sidecar index
            leftover.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise ConversionError(disk_full_message(final, out, exc)) from exc
        raise
    _report(unreported, on_progress)

    record: dict[str, Any] = {
        "path": final.name,
        "num_samples": count,
        "bytes": tmp.stat().st_size,
        "sha256": sha256_file(tmp),
        "index_path": None,
        "index_sha256": None,
        "errors": errors,
    }
    tmp_index = writer.index_path()
    if tmp_index is not None:
        final_index = final.with_name(final.name + tmp_index.name[len(tmp.name) :])
        record["index_path"] = final_index.name
        record["index_sha256"] = sha256_file(tmp_index)
        os.replace(tmp_index, final_index)
    os.replace(tmp, final)
    fsync_dir(out)
    atomic_write_bytes(out / JOB_DIR / f"{shard_name(plan.number, '')}.json", json.dumps(record).encode())
    return record


def _stop_requested() -> bool:
    """Whether this worker process was told to abandon its shard (the local engine's stop event)."""
    return _stop_event is not None and _stop_event.is_set()


def _check_job_alive(out: Path, stop: Callable[[], bool]) -> None:
    """Refuse to start or finish a shard of a job that was stopped or whose folder was discarded."""
    if stop() or not (out / JOB_DIR).is_dir():
        raise _Stopped()


def _report(count: int, on_progress) -> None:
    if not count:
        return
    if on_progress is not None:
        on_progress(count)
    elif _progress_queue is not None:
        _progress_queue.put(count)


def disk_full_message(final: Path, out: Path, exc: BaseException) -> str:
    """One line for a shard that ran out of space: which shard, why (disk, quota or file-size limit), what is free."""
    todo = "raise the limit (or use smaller shards)" if disk_full_errno(exc) == errno.EFBIG else "free space"
    return (
        f"{final}: disk full while writing this shard ({disk_full_why(exc)}; {free_space(out)}); nothing of it was "
        f"kept. The finished shards are kept: {todo} and run the same command again to continue"
    )
