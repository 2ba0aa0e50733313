"""``dali-pipes bench DATASET --suite storage``: where the shards are read from, epoch 1 and epoch 2.

Three ways to read the same dataset with the same loader settings:

- ``original``: the dataset where it is;
- ``staged /dev/shm``: staged into a tmpfs first (:mod:`dali_pipes.staging.stage`); the
  copy is part of epoch 1, as it is for a training job;
- ``cache=ram``: ``DataOptions(cache="ram")`` (:mod:`dali_pipes.staging.ramcache`); the
  copy into memory is part of epoch 1 too;

and, from a local S3 server, the copy alone: ``s3fs get`` against ``s3 stage workers=1/4/16``
(:mod:`dali_pipes.bench.object_storage`); then a loader over a staged copy against one streaming through a
cache of a tenth of the dataset, side by side: ``s3 staged`` and ``s3 stream cache=10%``
(:mod:`dali_pipes.bench.stream_rows`).

Every row runs the loader's read-only graph (the stages suite's "read shards"
row: the shards are read and nothing is decoded), so that storage, not
decoding, is what differs. Before each epoch 1 the dataset's pages are dropped
from the OS page cache (``posix_fadvise(DONTNEED)``, no root needed), so epoch 1
reads the disk; epoch 2 then shows what each way gives once the data is in
memory (for ``original``: the page cache). A tmpfs source cannot be dropped:
then epoch 1 reads memory as well. Memory used: ``shm_MB`` is what the row
holds in the tmpfs; ``workers_pss_MB`` the proportional set size of the DALI
worker processes (shared pages split between the processes that map them).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from dali_pipes.bench.inputs import BenchInputs
from dali_pipes.bench.object_storage import CONNECTION_MB_S, LATENCY_MS, s3_stage_rows
from dali_pipes.bench.procfs import drop_page_cache, pss_bytes
from dali_pipes.bench.report import BenchReport, figure, suite_report
from dali_pipes.bench.runner import Row, Timing, quiet
from dali_pipes.bench.stream_rows import READERS, row_name, s3_stream_rows
from dali_pipes.bench.stream_rows import STAGED as S3_STAGED
from dali_pipes.bench.stream_rows import STREAM as S3_STREAM
from dali_pipes.bench.streams import open_loader
from dali_pipes.bench.suites import SuiteRun
from dali_pipes.bench.suites.stages import GraphPrefix
from dali_pipes.dataset.progress import bar_disabled
from dali_pipes.staging.tmpfs import TMPFS, OwnedFolder

log = logging.getLogger(__name__)

ORIGINAL, STAGED, CACHED = "original", f"staged {TMPFS}", "cache=ram"
MODES = {
    ORIGINAL: "read where it is (epoch 1 from the disk, epoch 2 from the page cache)",
    STAGED: f"dali-pipes stage into {TMPFS} first (the copy counts in epoch 1)",
    CACHED: "DALILoader(data=DataOptions(cache='ram')) (the copy into memory counts in epoch 1)",
}
#: Prefix of the staged row's folder in the tmpfs; one left by a killed bench is removed by the next.
STAGE_PREFIX = "dali-pipes-bench-stage-"
#: Loggers held at WARNING: each row stages, caches or opens a stream again, logging the same INFO lines.
QUIET = (
    "dali_pipes.staging.stage",
    "dali_pipes.staging.ramcache",
    "dali_pipes.loading.streaming",
    "dali_pipes.loading.stream_setup",
)
#: Epochs timed after the first, each one window of the epoch=2 row (one epoch of a small set is short).
LATER_EPOCHS = 3


def run(bench: SuiteRun) -> BenchReport:
    """Epoch 1 and epoch 2 images/s of the read-only graph for each way to store the shards."""
    from dali_pipes.dataset.progress import tqdm

    inputs, quick = bench.inputs, bench.quick
    spec = GraphPrefix(inputs.spec, 0)
    repeats = 1 if quick else bench.plan.repeats
    rows = []
    with (
        quiet(*QUIET),
        tqdm(list(MODES), desc="bench storage", unit="row", disable=bar_disabled(bench.progress), leave=False) as bar,
    ):
        for mode in bar:
            bar.set_postfix_str(mode)
            rows.extend(_measure_mode(mode, inputs, spec, repeats))
        bar.set_postfix_str("object storage")
        rows.extend(s3_stage_rows(Path(inputs.dataset), inputs.num_samples, repeats=1 if quick else 2))
        bar.set_postfix_str("streaming")
        readers = READERS[:1] if quick else READERS  # --quick: in the loader's process only
        rows.extend(s3_stream_rows(inputs, spec, 1 if quick else 2, 1 if quick else LATER_EPOCHS, readers))
    report = suite_report(
        "storage",
        "where the shards are read from: epoch 1 (cold, copy included) and epoch 2, read-only graph",
        inputs,
        rows,
        reference=ORIGINAL,
        reference_match=("epoch",),
        columns=("shm_MB", "workers_pss_MB", "MB_s", "first_batch_s", "ratio", "peak_MB"),
    )
    _streaming_notes(report)
    report.notes.append(
        f"each row: median of {repeats} runs; epoch 1 starts with the dataset's pages dropped from the page "
        "cache and includes staging or caching; epoch=2: epochs 2 to "
        f"{1 + LATER_EPOCHS}, each one window; the read-only graph decodes nothing (see the stages suite's "
        "'read shards' row)"
    )
    report.notes.append(
        "shm_MB: memory held in /dev/shm by the row; workers_pss_MB: proportional set size of the DALI workers"
    )
    report.notes.append(
        "s3 rows: the dataset's files brought back from a local S3 server (moto, 127.0.0.1) into a new folder; "
        "images/s is samples copied per second, MB_s the dataset's bytes over the seconds of the copy "
        "(best run); 's3fs get' copies one file after another; every answer went through a proxy that holds its "
        f"first byte {LATENCY_MS:g} ms (a real S3 region's latency; DALI_PIPES_BENCH_S3_LATENCY_MS)"
        + (f" and caps each connection at {CONNECTION_MB_S:g} MB/s" if CONNECTION_MB_S else "")
        + " (DALI_PIPES_BENCH_S3_MB_S)"
    )
    return report


def _streaming_notes(report: BenchReport) -> None:
    """Each streamed row's ratio to its staged one (same reader processes) in the summary; what the rows measure,
    and each cache's bound."""
    for workers in READERS:
        staged, stream = row_name(S3_STAGED, workers), row_name(S3_STREAM, workers)
        row = report.row(stream)
        if row is None and workers:
            continue  # --quick
        ratio = row.extra.get("ratio") if row is not None else None
        report.summary[f"{stream} / {staged} (steady images/s)"] = figure(ratio, target=">= 0.9")
        if row is not None and "peak_bytes" in row.extra:
            extra = row.extra
            report.notes.append(
                f"{stream}: cache peak {extra['peak_bytes']} bytes, limit {extra['limit_bytes']} bytes, largest "
                f"shard {extra['shard_bytes']} bytes: peak <= limit + one shard: {extra['peak_ok']}; the reading "
                f"thread waited for downloads {extra['blocked_share']:.1%} of its steady time"
            )
    report.notes.append(
        f"'{S3_STAGED}' and '{S3_STREAM}' (each with 0 and 2 reader processes, '... workers=2'): a loader from start "
        "over the S3 URL (same graph, same reader processes in a pair), the first staged into a temporary folder, "
        "the second streamed through a cache of a tenth of the shards' bytes; first_batch_s from the loader's "
        "construction (the staged row's includes the whole copy); images/s: steady rate (staged: the epochs after "
        "the first; streamed: after its first batch, downloads included); MB_s: the shards' bytes read per second; "
        "ratio: streamed over staged"
    )


def _measure_mode(mode: str, inputs: BenchInputs, spec: Any, repeats: int) -> list[Row]:
    """Two rows (epoch 1, epoch 2) for one way of storing the shards."""
    rows = [Row(mode, MODES[mode], {"epoch": epoch}) for epoch in (1, 2)]
    runs = []
    try:
        for _ in range(repeats):
            runs.append(_epochs(mode, inputs, spec))
    except Exception as exc:  # noqa: BLE001 - a failing row is shown, the others still run
        log.warning("bench storage: %s failed", mode, exc_info=True)
        for row in rows:
            row.error = f"{type(exc).__name__}: {exc}"
        return rows
    for row, part in zip(rows, (slice(0, 1), slice(1, None))):
        windows = [epoch for run in runs for epoch in run["epochs"][part]]
        values = tuple(images / seconds for images, seconds in windows)
        row.timing = Timing(values, sum(images for images, _ in windows), sum(seconds for _, seconds in windows))
        for key in ("shm_MB", "workers_pss_MB"):
            row.extra[key] = round(statistics.median(run[key] for run in runs), 1)
    return rows


def _epochs(mode: str, inputs: BenchInputs, spec: Any) -> dict[str, Any]:
    """Time a loader's epoch 1 (from a dropped page cache) and later epochs; the memory it held at the end."""
    from dali_pipes.loading.config import DataOptions

    drop_page_cache(p for p in Path(inputs.dataset).rglob("*") if p.is_file())
    with contextlib.ExitStack() as stack:
        start = time.perf_counter()
        path, shm = inputs.dataset, 0
        if mode == STAGED:
            from dali_pipes.staging.stage import stage_dataset

            folder = OwnedFolder(STAGE_PREFIX)  # removed at the end, or by the next bench if this one is killed
            stack.callback(folder.close)
            staged = stage_dataset(inputs.dataset, folder.path, progress=False)
            path, shm = staged.path, staged.bytes_copied
        data = DataOptions(cache="ram") if mode == CACHED else None
        options = dict(batch_size=inputs.batch_size, device="cpu", settings=inputs.loader_settings, data=data)
        loader = stack.enter_context(open_loader(path, spec, **options))
        first = _epoch(loader)
        epochs = [(first, time.perf_counter() - start)]
        for _ in range(LATER_EPOCHS):
            start = time.perf_counter()
            epochs.append((_epoch(loader), time.perf_counter() - start))
        if loader.cache is not None:
            shm = loader.cache.bytes
        pss = sum(pss_bytes(pid) for pid in loader.worker_pids)
    return {"epochs": epochs, "shm_MB": shm / 1e6, "workers_pss_MB": pss / 1e6}


def _epoch(loader: Any) -> int:
    return sum(int(batch["label"].shape[0]) for batch in loader)
