"""The storage suite's streaming rows: one loader over a staged copy against one streaming through a bounded cache.

Both rows read the dataset from the local S3 server behind the latency proxy
(:func:`dali_pipes.bench.object_storage.local_s3`), each from start, side by side in the same run, with
the suite's read-only graph and the same loader settings:

- ``s3 staged``: ``DataOptions(stage_to=TMP)``: the whole dataset is downloaded before the first batch;
- ``s3 stream cache=10%``: ``DataOptions(stream=StreamOptions(cache_limit=a tenth of the shards' bytes,
  folder=TMP, loaders=1))`` from an empty cache: shards downloaded while the epochs are read, each epoch again.

Each pair runs with the same reader processes (:data:`READERS`: 0, in the loader's own process, and 2), so
that where the shards come from, not the number of processes, is what a pair compares; the rows read with
processes are named ``... workers=2``. Each row reports
``first_batch_s`` (from the loader's construction to its first batch, the staging included) and
``MB_at_first_batch`` (staged: the bytes copied; streamed: the bytes in the cache), and, as its
images/s, the steady rate: the staged row's over the epochs after the first, the streamed row's over
the rest of epoch 1 and the later epochs (downloads run during all of them: the cache holds a tenth).
The streamed row adds ``ratio`` (its steady rate over the staged row's), the cache's ``peak_MB``,
``limit_MB``, ``shard_MB`` (the largest shard), ``peak_ok`` (peak <= limit + one shard) and ``blocked_share``
(the share of its steady seconds reading waited for downloads: ``Streamer.blocked_s``, the reader processes' waits
over their seconds together).

The streamed row is the node's one loader of the dataset (``StreamOptions(loaders=1)``: the rows run one after
the other), so its windows take the whole cache. A dataset whose shards are too large for a tenth of it
(streaming needs three of the largest in the cache: two windows of one shard and a read outside them) gets the
streamed row skipped, saying which ``--samples-per-shard`` would do.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from dali_pipes.bench.object_storage import LATENCY_MS, local_s3, missing
from dali_pipes.bench.runner import Row, Skipped, Timing
from dali_pipes.bench.streams import open_loader

if TYPE_CHECKING:
    from dali_pipes.bench.inputs import BenchInputs

log = logging.getLogger(__name__)

#: The streaming cache's limit, a share of the bytes of the dataset's shards.
CACHE_SHARE = 0.10
STAGED = "s3 staged"
STREAM = f"s3 stream cache={CACHE_SHARE:.0%}"
#: Loaders of the dataset reading on the node at once: the streamed row's alone.
LOADERS = 1
#: Epochs read after the first in each run.
LATER_EPOCHS = 3


#: Reader processes of the rows' loaders: each count a staged and a streamed row, compared with each other.
READERS = (0, 2)


def row_name(kind: str, workers: int) -> str:
    """The row of ``kind`` (:data:`STAGED` or :data:`STREAM`) read with ``workers`` reader processes."""
    return kind if workers == 0 else f"{kind} workers={workers}"


def row_names(readers: tuple[int, ...] = READERS) -> list[str]:
    return [row_name(kind, w) for w in readers for kind in (STAGED, STREAM)]


def s3_stream_rows(
    inputs: "BenchInputs",
    spec: Any,
    repeats: int = 1,
    later_epochs: int = LATER_EPOCHS,
    readers: tuple[int, ...] = READERS,
    device: str = "cpu",
) -> list[Row]:
    """The staged and the streamed row for each count of ``readers`` (see the module docstring), each run
    ``repeats`` times from start; ``device="gpu"`` decodes there (the training graph at the GPU's rate)."""
    dataset = Path(inputs.dataset)
    rows = [Row(row_name(kind, w), _text(kind, w)) for w in readers for kind in (STAGED, STREAM)]
    why = missing(dataset)
    if why:
        for row in rows:
            row.skipped = why
        return rows
    shards = shard_bytes(dataset, inputs.manifest)
    limit = max(1, int(sum(shards) * CACHE_SHARE))
    for row in rows[1::2]:
        row.skipped = too_small(limit, shards, inputs.manifest)
    runs: dict[str, list[dict[str, Any]]] = {row.name: [] for row in rows}
    try:
        with local_s3(dataset) as (url, _, options):
            for _ in range(repeats):  # the rows alternate: a busier moment of the machine falls on all of them
                for i, row in enumerate(rows):
                    if row.skipped is None and row.error is None:
                        settings = {**inputs.settings_for(device), "py_num_workers": readers[i // 2]}
                        stream_limit = limit if i % 2 else None
                        _run_row(row, runs, url, options, inputs, spec, settings, stream_limit, later_epochs, device)
    except Exception as exc:  # noqa: BLE001 - a failing row is shown, the suite's other rows still run
        log.warning("bench storage: the streaming rows failed", exc_info=True)
        for row in rows:
            if row.skipped is None:
                row.error = f"{type(exc).__name__}: {exc}"
        return rows
    for i in range(0, len(rows), 2):
        _fill(rows[i : i + 2], runs, limit, shards, inputs.num_samples)
    return rows


def shard_bytes(dataset: Path, manifest: Any) -> list[int]:
    """The bytes each shard of ``dataset`` takes in a cache (with its index file, as the cache counts it)."""
    return [
        sum((dataset / rel).stat().st_size for rel in (shard.path, shard.index_path) if rel)
        for shard in manifest.shards
    ]


def too_small(limit: int, shards: list[int], manifest: Any) -> str | None:
    """Why a cache of ``limit`` bytes cannot stream these shards (it needs three of the largest:
    :func:`~dali_pipes.sampling.node_room.least_cache_limit`); ``None`` if it can."""
    from dali_pipes.sampling.node_room import least_cache_limit

    least = least_cache_limit(shards, LOADERS)
    if limit >= least:
        return None
    largest = max(shards)
    per_shard = max(shard.num_samples for shard in manifest.shards)
    fits = max(1, int(per_shard * limit / least))
    return (
        f"a cache of {CACHE_SHARE:.0%} of the dataset ({limit} bytes) holds fewer than three of its largest shard "
        f"({largest} bytes), and streaming needs three: convert the dataset into smaller shards "
        f"(dali-pipes convert ... --samples-per-shard {fits} or fewer; now up to {per_shard} a shard)"
    )


def _text(kind: str, workers: int) -> str:
    """A row's description: how its loader reads, with ``workers`` reader processes."""
    if kind == STAGED:
        return (
            f"DataOptions(stage_to=TMP) from the S3 server (first byte {LATENCY_MS:g} ms late): the whole copy before "
            f"the first batch, then the epochs after the first; py_num_workers={workers}"
        )
    return (
        f"DataOptions(stream=StreamOptions(cache_limit={CACHE_SHARE:.0%} of the shards' bytes, folder=TMP, "
        f"loaders={LOADERS})) from an empty cache (first byte {LATENCY_MS:g} ms late); steady rate over epoch 1 "
        f"after its first batch and the later epochs, downloads included; py_num_workers={workers}"
    )


def _run_row(row: Row, runs: dict[str, list[dict[str, Any]]], *args: Any) -> None:
    """One run of ``row`` (:func:`_run`'s arguments) added to ``runs``; a loader that refuses or fails marks the row
    (a cache too small for its reader processes' batches, say) and the other rows still run."""
    try:
        runs[row.name].append(_run(*args))
    except Skipped as exc:  # the row cannot run here (device="gpu" without one): said in the row, no traceback
        row.skipped = str(exc)
    except Exception as exc:  # noqa: BLE001 - shown in the row
        log.warning("bench storage: %s failed", row.name, exc_info=True)
        row.error = f"{type(exc).__name__}: {exc}"


def _run(
    url: str,
    options: dict[str, Any],
    inputs: "BenchInputs",
    spec: Any,
    settings: dict[str, int],
    stream_limit: int | None,
    later_epochs: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """One loader from start over ``url``: staged (``stream_limit=None``) or streamed; its seconds and bytes."""
    with tempfile.TemporaryDirectory(prefix="dali-pipes-bench-s3-") as tmp:
        data = _data(tmp, options, stream_limit)
        start = time.perf_counter()
        with open_loader(
            url, spec, batch_size=inputs.batch_size, device=device, settings=settings, data=data
        ) as loader:
            batches = iter(loader)
            next(batches)
            first_s = time.perf_counter() - start
            at_first = loader.cache.cache.bytes_held if stream_limit else loader.staged.bytes_copied
            blocked_at_first = loader.cache.blocked_s if stream_limit else 0.0
            windows = [_timed(batches)]  # the rest of epoch 1
            windows += [_timed(iter(loader)) for _ in range(later_epochs)]
            peak = loader.cache.peak_bytes if stream_limit else None
            # The reading thread's waits for downloads after the first batch (the first window's are the start's).
            blocked = loader.cache.blocked_s - blocked_at_first if stream_limit else None
    # Staged: the epochs after the first (epoch 1 starts right after the copy); streamed: all but the first batch.
    steady = windows if stream_limit else windows[1:]
    readers = max(1, settings.get("py_num_workers") or 0)  # the processes whose waits blocked_s sums
    return {
        "first_s": first_s,
        "at_first": at_first,
        "steady": steady,
        "peak": peak,
        "blocked": blocked,
        "readers": readers,
    }


def _data(tmp: str, options: dict[str, Any], stream_limit: int | None) -> Any:
    from dali_pipes.loading.config import DataOptions, StreamOptions

    if stream_limit is None:
        return DataOptions(stage_to=str(Path(tmp) / "staged"), storage_options=options)
    stream = StreamOptions(cache_limit=stream_limit, folder=tmp, loaders=LOADERS)
    return DataOptions(stream=stream, storage_options=options)


def _count(batch: Any) -> int:
    return int(batch["label"].shape[0])


def _timed(batches: Iterator[Any]) -> tuple[int, float]:
    """``(images, seconds)`` of reading ``batches`` to their end."""
    start = time.perf_counter()
    images = sum(_count(batch) for batch in batches)
    return images, time.perf_counter() - start


def _fill(rows: list[Row], runs: dict[str, list[dict[str, Any]]], limit: int, shards: list[int], samples: int) -> None:
    """Each row's timing (one steady rate a run) and figures; the streamed row's ratio, peak and bound."""
    for row in rows:
        if not runs[row.name]:
            continue
        steady = [window for run in runs[row.name] for window in run["steady"]]
        values = tuple(sum(n for n, _ in run["steady"]) / sum(s for _, s in run["steady"]) for run in runs[row.name])
        row.timing = Timing(values, sum(n for n, _ in steady), sum(s for _, s in steady))
        row.extra.update(
            first_batch_s=round(min(run["first_s"] for run in runs[row.name]), 2),
            MB_at_first_batch=round(max(run["at_first"] for run in runs[row.name]) / 1e6, 2),
            # The shards' bytes gone through a second: what the streamed row downloads (its cache holds a tenth).
            MB_s=round(row.timing.median * sum(shards) / samples / 1e6, 1),
            latency_ms=LATENCY_MS,
        )
    staged, stream = rows
    largest = max(shards)
    stream.extra.update(limit_MB=round(limit / 1e6, 2), shard_MB=round(largest / 1e6, 2))
    if stream.timing is None:
        return
    streamed = runs[stream.name]
    peak = max(run["peak"] for run in streamed)
    stream.extra.update(peak_MB=round(peak / 1e6, 2), peak_bytes=peak, limit_bytes=limit, shard_bytes=largest)
    # The share of the steady seconds reading waited for downloads (Streamer.blocked_s: the reader processes' waits
    # summed, so over the seconds of each of them).
    blocked = sum(run["blocked"] for run in streamed)
    seconds = sum(s * run["readers"] for run in streamed for _, s in run["steady"])
    stream.extra["blocked_share"] = round(blocked / max(seconds, 1e-9), 3)
    stream.extra["peak_ok"] = peak <= limit + largest
    if staged.timing is not None:
        stream.extra["ratio"] = stream.timing.median / staged.timing.median


__all__ = [
    "CACHE_SHARE", "LATER_EPOCHS", "READERS", "STAGED", "STREAM", "row_name", "row_names", "s3_stream_rows",
    "shard_bytes", "too_small",
]  # fmt: skip
