"""The :class:`~dali_pipes.loading.loader.DALILoader` arguments that need filling in or checking before anything starts.

Kept apart from the loader so that its constructor reads as: check the
arguments, resolve world and device, prepare the store, bind the spec, build.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping

from dali_pipes.remote.urls import check_dataset_path, redact
from dali_pipes.sampling import LAST_BATCH_POLICIES, check_int

if TYPE_CHECKING:
    from dali_pipes.loading.config import DataOptions, RunOptions
    from dali_pipes.pipelines.base import PipelineSpec

log = logging.getLogger(__name__)


#: The keywords :class:`~dali_pipes.DALILoader` took before dali-pipes 0.2.0, which grouped them (issue 47), and the
#: option group each went into: ``DALILoader(..., device="cpu")`` is ``DALILoader(..., run=RunOptions(device="cpu"))``.
FORMER_KEYWORDS: dict[str, str] = {
    **dict.fromkeys(
        ("device", "rank", "world_size", "num_threads", "py_num_workers", "prefetch", "py_start_method", "settings"),
        "run=RunOptions",
    ),
    "batch_reads": "run=RunOptions",
    **dict.fromkeys(("stage_to", "cache", "cache_bytes", "storage_options"), "data=DataOptions"),
    "with_index": "batch_format=BatchFormat",
}


def refuse_former_keywords(given: Mapping[str, Any]) -> None:
    """A :class:`TypeError` naming the new home of each keyword of ``given`` that the loader took before 0.2.0
    (:data:`FORMER_KEYWORDS`), so that last month's script says what to write; nothing for other keywords.
    Values are not shown: ``storage_options`` holds credentials."""
    moved = [name for name in given if name in FORMER_KEYWORDS]
    if not moved:
        return
    homes: dict[str, list[str]] = {}
    for name in moved:
        homes.setdefault(FORMER_KEYWORDS[name], []).append(f"{name}=...")
    fixes = ", ".join(f"{home}({', '.join(names)})" for home, names in homes.items())
    raise TypeError(
        f"DALILoader() takes {', '.join(f'{name}=' for name in moved)} no longer: since dali-pipes 0.2.0 they are "
        f"grouped in option objects; pass {fixes} (the repository's CHANGELOG.md, 0.2.0, says how to move)"
    )


def resolve_counts(pipeline: "PipelineSpec", run: "RunOptions") -> tuple["PipelineSpec", "RunOptions"]:
    """``(pipeline, run)`` with what ``run`` left unset filled in where it can be already.

    A ``settings`` file saved by ``dali-pipes tune`` fills in first (and its
    decoder hints go to the spec); then the spec's ``py_num_workers_by_default``
    where it has one (``Features``: 0, the training process reads); ``prefetch`` defaults to 2.
    ``num_threads`` and ``py_num_workers`` stay ``None`` when nothing set them: they
    depend on the device and the dataset's format (:func:`choose_counts`), known once
    the device is chosen and the store is open.
    """
    if isinstance(pipeline, type):
        raise TypeError(
            f"DALILoader: pass a pipeline spec instance, {pipeline.__name__}(), not the class {pipeline.__name__}"
        )
    counts = {"num_threads": run.num_threads, "py_num_workers": run.py_num_workers, "prefetch": run.prefetch}
    if run.settings is not None:
        from dali_pipes.settings import apply_settings, load_settings

        tuned = load_settings(run.settings)
        counts = {name: tuned.get(name) if given is None else given for name, given in counts.items()}
        pipeline = apply_settings(pipeline, run.settings)
    if counts["py_num_workers"] is None:
        counts["py_num_workers"] = getattr(pipeline, "py_num_workers_by_default", None)
    counts["prefetch"] = 2 if counts["prefetch"] is None else counts["prefetch"]
    return pipeline, dataclasses.replace(run, **counts)  # checked again by RunOptions


#: DALI threads by default where the CPU decodes: a few, leaving the rank's other cores to the training process.
CPU_DECODE_THREADS = 4


def default_num_threads(cpus: int | None = None, *, gpu_images: bool = False) -> int:
    """DALI's CPU threads when the caller sets none, for ``cpus`` cores (default :func:`cores_per_rank`).

    Where the GPU decodes the images (``gpu_images``) the threads feed its decoders (the
    Huffman stage of nvJPEG's CUDA path, the hardware decoder's submissions, the host side
    of every operator) and the training process needs little CPU beside them, so they are
    this rank's whole share of the cores (measured against the former 4 in the bench README's
    GPU section). Where the CPU decodes, :data:`CPU_DECODE_THREADS` at most, so that the
    training step keeps cores.
    Never more than the rank's share: eight ranks on a 16-core node get 2 threads each.
    """
    cpus = cpus or cores_per_rank()
    return max(1, cpus if gpu_images else min(CPU_DECODE_THREADS, cpus))


def cores_per_rank() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's), divided among the ranks of this
    node (``LOCAL_WORLD_SIZE``, which torchrun sets) only when that affinity is the whole node's: a launcher that
    pinned each rank to its share already divided them (``world.rank_cores``); never more than the rank's share of a
    container's CPU quota (``world.quota_cpus``). What one loader's defaults may count on.
    """
    from dali_pipes.loading.world import node_cpus, quota_cpus, rank_cores

    try:
        affinity = frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = frozenset(range(os.cpu_count() or 1))
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        local_ranks = 1
    cores = rank_cores(affinity, node_cpus() | affinity, local_ranks)
    quota = quota_cpus()  # a CPU limit (Kubernetes) below the cores the node shows, shared by its ranks
    return cores if quota is None else max(1, min(cores, quota // local_ranks))


def choose_counts(
    threads: int | None,
    workers: int | None,
    fmt: str,
    batch_reads: bool,
    gpu_images: bool,
    *,
    refusal: Callable[[int], str | None] | None = None,
) -> tuple[int, int]:
    """``(num_threads, py_num_workers)``: as given, else the defaults for the device, format and cores; one INFO
    line says what was chosen and why. ``refusal(n)``: why ``n`` reader processes cannot read the dataset (a
    streamed one whose cache is too small for their batches): then the default is none, said in that line (reader
    processes the caller chose are refused when the pipeline is built)."""
    cpus = cores_per_rank()  # read once: it reads the cgroup and cpuset files
    chosen_workers = default_py_num_workers(fmt, batch_reads, cpus, workers=workers, gpu_images=gpu_images)
    chosen_threads = default_num_threads(cpus, gpu_images=gpu_images) if threads is None else threads
    why = _counts_reason(workers, gpu_images, cpus)
    refused = refusal(chosen_workers) if refusal is not None and chosen_workers and workers is None else None
    if refused is not None:
        chosen_workers, why = 0, f"none by default here: {refused}"
    log.info(
        "DALILoader: %d DALI threads (%s) and %d reader processes (%s)",
        chosen_threads,
        _counts_reason(threads, gpu_images, cpus),
        chosen_workers,
        why,
    )
    return chosen_threads, chosen_workers


def _counts_reason(given: int | None, gpu_images: bool, cpus: int) -> str:
    if given is not None:
        return "set by the caller, a settings file or the pipeline spec"
    where = "the GPU decodes the images" if gpu_images else "the CPU decodes"
    return f"the default for {cpus} cores per rank where {where}"


#: Reader processes for batch reads that feed the GPU decoder, on at least GPU_FEED_MIN_CORES cores per rank:
#: one per GPU_FEED_CORES_PER_WORKER cores, between GPU_FEED_MIN_WORKERS and GPU_FEED_MAX_WORKERS.
GPU_FEED_MIN_CORES = 8
GPU_FEED_CORES_PER_WORKER = 4
GPU_FEED_MIN_WORKERS = 2
GPU_FEED_MAX_WORKERS = 8


def gpu_feed_workers(cpus: int) -> int:
    """Reader processes that feed the GPU decoder on ``cpus`` cores per rank (0 below :data:`GPU_FEED_MIN_CORES`)."""
    if cpus < GPU_FEED_MIN_CORES:
        return 0
    return max(GPU_FEED_MIN_WORKERS, min(GPU_FEED_MAX_WORKERS, cpus // GPU_FEED_CORES_PER_WORKER))


def default_py_num_workers(
    fmt: str, batch_reads: bool, cpus: int | None = None, *, workers: int | None = None, gpu_images: bool = False
) -> int:
    """DALI's Python reader processes: ``workers`` when chosen, else by the format, the device and the cores.

    Batch reads of a format whose readers copy records straight out of a memory
    map (LMDB, HDF5: ``ShardReader.cheap_batch_reads``) cost a few microseconds a
    sample, so on the CPU they run in the loader's process: a worker would add a
    copy into shared memory and the same per-sample work in this process to take
    it back. Where images are decoded on the GPU (``gpu_images``) with at least
    :data:`GPU_FEED_MIN_CORES` cores per rank (``cpus``, default :func:`cores_per_rank`),
    the loader's one thread is the limit instead: DALI calls the source in the
    training loop's thread, which cannot feed the GPU decoders as fast as
    ``fn.readers.file`` does. So one process per :data:`GPU_FEED_CORES_PER_WORKER`
    cores of the rank (:func:`gpu_feed_workers`: 4 on 16 cores, 8 on 32 or more),
    each kept busy with a batch in flight (``pipeline_build.source_options``). Other
    formats and per-sample reads get a few workers, leaving cores for the training
    process. The bench README's GPU sections have the measurements behind these counts
    (``dali-pipes bench --suite feed`` and ``--suite gpu-decoder``).
    """
    from dali_pipes.stores import reader_class

    if workers is not None:
        return workers
    cpus = cpus or cores_per_rank()
    if batch_reads and reader_class(fmt).cheap_batch_reads:
        return gpu_feed_workers(cpus) if gpu_images else 0
    return max(1, min(4, cpus // 2))


def check_options(batch_size: int, seed: int, last_batch: str, path: Any = None) -> None:
    """Refuse, with a message naming the argument, values the loader cannot work with; ``path`` a ``scheme://`` that
    is no object storage (``https://``), before it is taken for a local folder (``remote.urls.check_dataset_path``)."""
    check_dataset_path(path)
    check_int("batch_size", batch_size, 1)
    check_int("seed", seed, 0)
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")


def source_description(path: Any, root: Any, data: "DataOptions") -> str:
    """The dataset as the loader's start-up line names it: a streamed one by what was given (a URL, its secrets
    taken out), then the cache folder it is read through; any other by the folder read (``root``)."""
    if data.stream is None:
        return str(root)
    return f"{redact(str(path), data.storage_options)} (cache {root})"


def device_description(device: str, device_id: int | None) -> str:
    """What the loader runs on, for its start-up log line (and why, with ``device='auto'``)."""
    chosen = f"GPU {device_id}" if device_id is not None else "CPU"
    if device == "auto":
        chosen += " (device='auto': " + ("CUDA is available)" if device_id is not None else "no CUDA here)")
    return chosen
