"""The parallel, resumable conversion of a :class:`~converters.base.Source` into shards.

How a run proceeds, and why it survives a crash or a kill at any point:

1. The input is enumerated and cut into shards (:mod:`converters.planner`), in its
   order or a seeded shuffle of it (:mod:`converters.order`). The job's identity
   (source, options, format, order and plan) is hashed into a digest and kept in
   ``OUT/.dali-pipes-job/job.json``.
2. Each shard is written by a worker process under ``shard-NNNNN.EXT.tmp-<attempt>``, flushed,
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

import gc
import glob
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from converters.base import ConversionError, Item, NothingConverted, SampleError, Source
from converters.diskfull import disk_full_message, free_space, is_disk_full
from converters.engines import LocalEngine, WorkerDied, make_engine
from converters.input_plan import InputPlan, plan_input, shard_items
from converters.jobdir import (
    TMP_SUFFIX,
    OutputLock,
    ShardRecord,
    claim_output,
    discard_job,
    done_record,
    finished_dataset,
    job_digest,
    legacy_job_digest,
    make_output,
    read_errors,
    refuse_output_inside_input,
    remove_paths,
    remove_temporaries,
    save_record,
    shard_name,
    tidy_finished,
)
from converters.order import choose_order
from converters.planner import ShardPlan
from converters.writers import writer_class
from dali_pipes._version import __version__
from dali_pipes.dataset.fileio import atomic_write_bytes, fsync_dir, sha256_file
from dali_pipes.dataset.manifest import ERRORS_NAME, FORMATS, JOB_DIR, Manifest, write_manifest
from dali_pipes.dataset.progress import bar_disabled, tqdm
from dali_pipes.remote.urls import redact_urls

log = logging.getLogger(__name__)

ON_ERROR = ("skip", "fail")
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
    uploader: Any = None,
    order: str = "auto",
    order_seed: int = 0,
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
    ``uploader``: see :func:`converters.upload.convert_to_url` (each shard uploaded once written).
    ``order``/``order_seed``: the samples' order, recorded in the manifest (:func:`converters.order.choose_order`).
    """
    started = time.perf_counter()
    workers = _checked_options(format, on_error, workers)
    runner = make_engine(engine, workers=workers, scheduler=scheduler, initializer=_init_worker)
    out = Path(out)
    refuse_output_inside_input(source, out)
    inputs, digest, finished = _planned(source, format, out, samples_per_shard, shard_size, order, order_seed)
    plans = inputs.plans
    if finished is not None:
        # Said once, by the caller (the CLI's summary line); here only for debugging.
        log.debug("%s is already a complete conversion of this input; nothing to do", out)
        tidy_finished(out)
        return ConvertResult(out, finished, read_errors(out), time.perf_counter() - started, already_complete=True)
    created = make_output(out)
    job_dir = out / JOB_DIR
    with OutputLock(out):
        claim_output(out, f"{digest}:layout-{SHARD_LAYOUT_VERSION}", source, format, created)
        results, todo = _resume(out, format, plans, uploader)
        inputs = inputs.spilled(source, job_dir, todo)  # a shuffled order: each shard's items, in the job folder
        try:
            write = write_shard if uploader is None else uploader.after(write_shard)
            _run_shards(_Job(source, format, inputs, out, on_error, write), todo, runner, progress, results)
        except SampleError:
            # --on-error fail: nothing of this job may look usable afterwards.
            discard_job(out, created)
            raise
        manifest = _assemble(out, source, format, inputs, results, digest, created)
        shutil.rmtree(job_dir, ignore_errors=True)
    return _written(out, manifest, plans, results, len(plans) - len(todo), started)


def _planned(
    source: Source, fmt: str, out: Path, per_shard: int | None, size: int | None, order: str, seed: int
) -> tuple[InputPlan, str, Manifest | None]:
    """The input's plan, the job's digest, and the manifest of ``out`` when it is this job finished already."""
    inputs = plan_input(source, samples_per_shard=per_shard, shard_size=size, order=choose_order(source, order, seed))
    digest = job_digest(source, fmt, inputs.plans, inputs.identity)
    return inputs, digest, finished_dataset(out, digest, _legacy_digest(source, fmt, inputs), inputs.order)


def _legacy_digest(source: Source, fmt: str, inputs: InputPlan) -> Callable[[], str] | None:
    """How to compute the digest versions before streamed planning wrote for this job (none for a shuffled order:
    they wrote none)."""
    if inputs.order.shuffled:
        return None
    return lambda: legacy_job_digest(source, fmt, inputs.stream(source), inputs.plans)


def _resume(
    out: Path, fmt: str, plans: Sequence[ShardPlan], uploader: Any
) -> tuple[dict[int, ShardRecord], list[ShardPlan]]:
    """Clear half-written files; the shards recorded as done (and, with ``uploader``, held there) and those to write."""
    suffix = writer_class(fmt).suffix
    remove_temporaries(out)
    remote = uploader.holds if uploader is not None else None
    results = {p.number: r for p in plans if (r := done_record(out, p, suffix, remote)) is not None}
    if results:
        log.info("resuming: %d of %d shards were already written", len(results), len(plans))
    return results, [p for p in plans if p.number not in results]


def _written(out: Path, manifest: Manifest, plans, results, resumed: int, started: float) -> ConvertResult:
    """The result of a job that wrote ``manifest``, with the inputs left out in shard order."""
    errors = [e for p in plans for e in results[p.number].errors]
    result = ConvertResult(out, manifest, errors, time.perf_counter() - started, resumed_shards=resumed)
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


def _assemble(out: Path, source: Source, fmt: str, inputs, results, digest: str, created: bool) -> Manifest:
    """Write ``errors.jsonl`` and then the manifest, in shard order; or refuse the result, leaving nothing behind."""
    shards = []
    errors = []
    for plan in inputs.plans:
        record = results[plan.number]
        shards.append(record.shard())
        errors.extend(record.errors)
    try:
        if sum(s.num_samples for s in shards) == 0:
            raise NothingConverted(errors)  # asked first: allowing what the source refuses would not help
        source.check_result({e["input"]: e["reason"] for e in errors if "part" not in e})
    except ConversionError:
        # The same command would be refused again, so its shards could never become a dataset, and a job folder
        # left here would tell `inspect` (and the user) to resume it: leave nothing behind, as --on-error fail does.
        discard_job(out, created)
        raise
    lines = "".join(json.dumps(e, sort_keys=True) + "\n" for e in errors)
    atomic_write_bytes(out / ERRORS_NAME, lines.encode())
    manifest = Manifest(
        format=fmt,
        fields=source.fields(),
        shards=tuple(shards),
        source={**source.recorded(), "job": digest},
        classes=source.classes(),
        extra=source.extra(),
        created_by=f"dali-pipes {__version__}",
        order=inputs.order,
    )
    write_manifest(out, manifest)
    return manifest


# --- running shards ------------------------------------------------------------------------

# Set in each worker process by _init_worker: where to report progress, and when to stop early.
_progress_queue: Any = None
_stop_event: Any = None


def _checked_options(format: str, on_error: str, workers: int | None) -> int:
    """The worker count (default: all cores), once the format, bad-input policy and count are known good."""
    if format not in FORMATS:
        raise ConversionError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if on_error not in ON_ERROR:
        raise ConversionError(f"unknown --on-error {on_error!r}; choose skip or fail")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ConversionError(f"--workers must be at least 1, got {workers}")
    return workers


def _init_worker(progress_queue: Any, stop_event: Any) -> None:
    global _progress_queue, _stop_event
    _progress_queue = progress_queue
    _stop_event = stop_event


class _Stopped(Exception):
    """Another worker failed with --on-error fail; this shard is abandoned."""


@dataclass(frozen=True)
class _Job:
    """What every shard of one conversion shares: the input, the format, the output folder, the bad-input policy."""

    source: Source
    fmt: str
    inputs: InputPlan
    out: Path
    on_error: str
    write: Callable[..., ShardRecord]  # write_shard, or write_shard then its upload


def _run_shards(
    job: _Job, todo: Sequence[ShardPlan], engine: Any, progress: bool, results: dict[int, ShardRecord]
) -> None:
    """Write the shards of ``todo`` with ``engine`` (or in this process when there is one worker or shard)."""
    source, fmt, inputs, out, on_error = job.source, job.fmt, job.inputs, job.out, job.on_error
    done_before = sum(r.inputs_done for r in results.values())
    bar = tqdm(
        total=inputs.count,
        initial=done_before,
        unit="sample",
        desc=f"convert {fmt}",
        disable=bar_disabled(progress),
        smoothing=0.05,
    )
    try:
        if isinstance(engine, LocalEngine) and (engine.workers == 1 or len(todo) <= 1):
            _init_worker(None, None)
            for plan in todo:
                record = job.write(source, fmt, plan, inputs.items_for(plan), out, on_error, bar.update)
                results[plan.number] = record
            return
        # An absolute output path, so that workers started elsewhere (a Dask cluster) write to the same folder.
        tasks = [
            (k, job.write, args) for k, _, args in shard_tasks(source, fmt, inputs, todo, out.absolute(), on_error)
        ]
        try:
            for number, record in engine.run(tasks, bar.update, shared=(source,)):
                results[number] = record
        except WorkerDied as exc:
            # Every worker has ended: what they left half-written is garbage. Say which shard killed its worker.
            remove_temporaries(out)
            which = "a shard" if exc.key is None else str(out / shard_name(exc.key, writer_class(fmt).suffix))
            raise ConversionError(
                f"{which}: the worker writing this shard died ({exc.how}); nothing of it was kept "
                f"({free_space(out)}: if the disk is full, free space first). The finished shards are kept: "
                "run the same command again to continue"
            ) from exc
    finally:
        bar.close()


def shard_tasks(
    source: Source, fmt: str, inputs: InputPlan, plans: Sequence[ShardPlan], out: Path, on_error: str
) -> list[tuple[int, Callable[..., ShardRecord], tuple[Any, ...]]]:
    """One engine task per shard: its :func:`write_shard` call, carrying only that shard's plan (and its items
    when they are held in this process; a streaming source's task reads them from the input).

    The source is not in the tasks: the engine sends it to each worker once and
    passes it first (``engine.run(..., shared=(source,))``), since a dataset may be
    large to pickle. Its fields are asked for first, in this process: a source that
    works them out lazily (a list file's labels) then carries the answer to the
    workers instead of each task re-reading the whole input to find it.
    """
    source.fields()
    return [(plan.number, write_shard, (fmt, plan, inputs.items_for(plan), out, on_error)) for plan in plans]


def write_shard(
    source: Source,
    fmt: str,
    plan: ShardPlan,
    items: Sequence[Item] | None,
    out: Path,
    on_error: str,
    on_progress=None,
    *,
    stop: Callable[[], bool] | None = None,
) -> ShardRecord:
    """Write one shard under a temporary name, rename it into place, and record it as done.

    ``items``: the shard's items, or ``None`` to read them from a streaming source's input (:func:`shard_items`).
    ``stop`` says whether to abandon the shard (another shard failed with
    ``--on-error fail``); without it, the stop event of this worker process is asked.
    Returns the shard's record: path, count, size, hashes and the inputs left out.
    """
    writer_cls = writer_class(fmt)
    final = out / shard_name(plan.number, writer_cls.suffix)
    # A name of this attempt's own: an attempt that runs on after its job was given up (a Dask task cannot be
    # interrupted, and a Ctrl-C'd client leaves it running) must never rename another attempt's half-written file
    # into place, nor write into the same file.
    tmp = final.with_name(f"{final.name}{TMP_SUFFIX}-{uuid.uuid4().hex[:12]}")
    if stop is None:
        stop = _stop_requested
    # A retried task (a Dask worker died mid-shard) finds the dead attempts' half-written files.
    remove_paths(out.glob(f"{glob.escape(final.name + TMP_SUFFIX)}*"))
    writer = None
    try:
        _check_job_alive(out, stop)
        writer = writer_cls(tmp, source.fields())
        inputs = shard_items(source, plan, items)
        count, errors = _write_samples(writer, source, inputs, on_error, final.name, stop, on_progress)
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
        remove_paths(out.glob(f"{glob.escape(tmp.name)}*"))  # the shard and its sidecar index
        if is_disk_full(exc):
            raise ConversionError(disk_full_message(final, out, exc)) from exc
        raise
    finally:
        source.shard_done()
        # An HDF5 writer's file object is in a reference cycle with h5py's file: without a collection, a worker
        # would keep a finished shard's buffers until the cyclic collector ran, rarely.
        gc.collect()
    return _publish_shard(writer, tmp, final, out, plan, count, errors)


def _write_samples(
    writer: Any,
    source: Source,
    items: Iterable[Item],
    on_error: str,
    shard: str,
    stop: Callable[[], bool],
    on_progress,
) -> tuple[int, list[dict[str, str]]]:
    """Load and write each item; returns the samples written and the inputs left out (``--on-error skip``)."""
    fields = source.fields()
    errors: list[dict[str, str]] = []
    count = 0
    unreported = 0
    for item in items:
        if stop():
            raise _Stopped()
        try:
            sample = source.load(item)
        except SampleError as exc:
            if on_error == "fail":
                raise
            # Listed once, at the end (errors.jsonl, the CLI's summary, ConvertResult.errors), not here as well.
            log.debug("left out %s: %s", exc.name, exc.reason)
            errors.append({"input": redact_urls(exc.name), "reason": redact_urls(exc.reason), "shard": shard})
        else:
            if sample.keys() != fields.keys():
                raise ValueError(f"{item.name}: the source gave fields {sorted(sample)}, expected {sorted(fields)}")
            writer.write(sample)
            count += 1
            # Listed like inputs left out, naming the part: the input itself is kept, not quietly made smaller.
            for part, why in source.left_out_parts(item):
                errors.append(
                    {"input": redact_urls(item.name), "part": part, "reason": redact_urls(why), "shard": shard}
                )
        unreported += 1
        if unreported >= _PROGRESS_EVERY:
            _report(unreported, on_progress)
            unreported = 0
    _report(unreported, on_progress)
    return count, errors


def _publish_shard(
    writer: Any, tmp: Path, final: Path, out: Path, plan: ShardPlan, count: int, errors: list[dict[str, str]]
) -> ShardRecord:
    """Hash the written shard (and its index), rename them into place, and save the shard's job record."""
    index_path = index_sha256 = None
    tmp_index = writer.index_path()
    if tmp_index is not None:
        final_index = final.with_name(final.name + tmp_index.name[len(tmp.name) :])
        index_path, index_sha256 = final_index.name, sha256_file(tmp_index)
        os.replace(tmp_index, final_index)
    record = ShardRecord(
        path=final.name,
        num_samples=count,
        bytes=tmp.stat().st_size,
        sha256=sha256_file(tmp),
        index_path=index_path,
        index_sha256=index_sha256,
        errors=errors,
    )
    os.replace(tmp, final)
    fsync_dir(out)
    save_record(out, plan.number, record)
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
