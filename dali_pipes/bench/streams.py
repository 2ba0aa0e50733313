"""The rows the suites declare: this package's loader, a PyTorch ``DataLoader``, DALI's own file reader.

Each kind of row comes as a stream factory (a context manager that yields an
endless iterator of delivered image counts, see :mod:`dali_pipes.bench.runner`,
and shuts its pipeline or workers down on exit) and as a :class:`Job` that a
suite puts in its table: :func:`dali_job`, :func:`dataloader_job`,
:func:`anchor_job`. The ``*_batches`` factories yield the batches themselves, for
rows that train on them (``--suite train``, ``doctor``). A kind of row that one
suite alone uses lives in that suite's module, or in a module of its own when it is
large (:mod:`~dali_pipes.bench.decode`, :mod:`~dali_pipes.bench.torchvision_gpu`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from dali_pipes.bench.runner import Job, Skipped, Target, cycle, delivered, require_cuda

if TYPE_CHECKING:
    from dali_pipes.bench.inputs import BenchInputs

#: Seconds a DataLoader row waits for one batch before it fails.
BATCH_TIMEOUT = 300.0
#: Batches DALI's own pipeline holds ready: its default ``prefetch_queue_depth``, and the one handed over.
ANCHOR_IN_FLIGHT = 2 + 1
#: The rows run on each device in this order: the GPU (skipped without CUDA), then the CPU.
DEVICES = ("gpu", "cpu")


def dali_in_flight(settings: Mapping[str, int]) -> int:
    """Batches a ``DALILoader`` holds ready ahead of its consumer: DALI's pipeline queue,
    the parallel source's own queue of the same depth, and the one being handed over."""
    return 2 * settings.get("prefetch", 2) + 1


def dataloader_in_flight(num_workers: int) -> int:
    """Batches a ``DataLoader`` holds ready: torch's ``prefetch_factor`` of two per worker, and one in hand."""
    return 2 * num_workers + 1


# --- this package's loader -----------------------------------------------------------------


@contextlib.contextmanager
def open_loader(
    dataset: str | os.PathLike,
    spec: Any,
    *,
    batch_size: int,
    device: str,
    settings: Mapping[str, int] | None = None,
    data: Any = None,
) -> Iterator[Any]:
    """:class:`~dali_pipes.DALILoader` as every row builds it: shuffled (seed 0) on ``device``, with ``settings``'
    counts (``num_threads``, ``py_num_workers``, ``prefetch``) in its ``RunOptions``; closed on exit."""
    from dali_pipes.loading.config import RunOptions
    from dali_pipes.loading.loader import DALILoader

    if device == "gpu":
        require_cuda()
    run = RunOptions(device=device, **dict(settings or {}))
    with DALILoader(dataset, spec, batch_size=batch_size, shuffle=True, seed=0, run=run, data=data) as loader:
        yield loader


@contextlib.contextmanager
def dali_batches(dataset: str | os.PathLike, spec: Any, **options: Any) -> Iterator[Iterator[tuple[Any, ...]]]:
    """``(image, *targets)`` batches of :func:`open_loader` (its keyword ``options``), epoch after epoch."""
    with open_loader(dataset, spec, **options) as loader:
        yield ((batch["image"], *targets(batch)) for batch in cycle(loader))


@contextlib.contextmanager
def dali_loader_stream(
    dataset: str | os.PathLike, spec: Any, *, target: Target, **options: Any
) -> Iterator[Iterator[int]]:
    """:func:`dali_batches` (:func:`open_loader`'s keyword ``options``), delivered to ``target``."""
    with dali_batches(dataset, spec, **options) as batches:
        yield delivered(batches, target)


def targets(batch: Mapping[str, Any]) -> list[Any]:
    """What a training step reads besides the image: the label, or a segmentation batch's boxes and masks."""
    if "label" in batch:
        return [batch["label"]]
    return [value for name, value in batch.items() if name not in ("image", "is_pad")]


def dali_job(
    name: str,
    inputs: BenchInputs,
    device: str,
    target: Target,
    dataset: Path | None = None,
    settings: Mapping[str, int] | None = None,
    **params: Any,
) -> Job:
    """A row of this package's loader over ``dataset`` (default: the inputs'), on ``device``, with ``settings``
    (default: the inputs' for that device, :meth:`BenchInputs.settings_for`); ``params`` join the settings in
    the row's params."""
    settings = dict(inputs.settings_for(device) if settings is None else settings)
    factory = functools.partial(
        dali_loader_stream,
        dataset or inputs.dataset,
        inputs.spec,
        batch_size=params.get("batch_size", inputs.batch_size),
        device=device,
        target=target,
        settings=settings,
    )
    where = "the GPU (mixed decoder)" if device == "gpu" else "the CPU"
    description = f"DALILoader over the shards, decode and augment on {where}"
    return Job(name, factory, description, {**settings, **params}, in_flight=dali_in_flight(settings), runs_dali=True)


def per_device(inputs: BenchInputs, target: Target, specs: Mapping[str, Any]) -> list[Job]:
    """:func:`dali_job` rows of each ``name: spec`` on each of :data:`DEVICES`, with ``device`` in their params."""
    jobs = []
    for device in DEVICES:
        for name, spec in specs.items():
            job = dali_job(name, dataclasses.replace(inputs, spec=spec), device, target)
            job.params["device"] = device  # the table's and the JSON's way to tell the two devices apart
            jobs.append(job)
    return jobs


# --- a PyTorch DataLoader --------------------------------------------------------------------


@contextlib.contextmanager
def dataloader_batches(dataset: Any, *, batch_size: int, num_workers: int) -> Iterator[Iterator[Any]]:
    """The baseline ``DataLoader`` (:func:`~dali_pipes.bench.baselines.pil_dataloader`) over ``dataset``, epoch
    after epoch; its workers stopped on exit."""
    from dali_pipes.bench.baselines import pil_dataloader

    # A worker that hangs (a library deadlocked by fork) becomes a failed row, not a stuck benchmark.
    loader = pil_dataloader(dataset, batch_size=batch_size, num_workers=num_workers, timeout=BATCH_TIMEOUT)
    batches = cycle(loader)
    try:
        yield batches
    finally:
        batches.close()
        shutdown_workers(loader)


@contextlib.contextmanager
def dataloader_stream(dataset: Any, *, batch_size: int, num_workers: int, target: Target) -> Iterator[Iterator[int]]:
    """:func:`dataloader_batches`, delivered to ``target``."""
    with dataloader_batches(dataset, batch_size=batch_size, num_workers=num_workers) as batches:
        yield delivered(batches, target)


def shutdown_workers(loader: Any) -> None:
    """Stop a ``DataLoader``'s persistent workers now.

    They live as long as the loader's iterator; stopped here rather than when the
    garbage collector gets to it, so rows do not overlap.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def dataloader_job(
    name: str, make_dataset: Callable[[], Any], inputs: BenchInputs, target: Target, description: str, **params: Any
) -> Job:
    """A row of a PyTorch ``DataLoader`` over ``make_dataset()``, with ``num_workers`` = cores unless given."""
    num_workers = params.setdefault("num_workers", inputs.cores)
    batch_size = params.get("batch_size", inputs.batch_size)

    def factory() -> Any:
        # The dataset is made inside the row, so an optional backend that does not import skips it.
        return dataloader_stream(make_dataset(), batch_size=batch_size, num_workers=num_workers, target=target)

    return Job(name, factory, description, params, in_flight=dataloader_in_flight(num_workers))


def pil_transform(inputs: BenchInputs) -> Any:
    """The PIL transform equivalent to the inputs' spec."""
    from dali_pipes.bench.baselines import PilTrainTransform

    return PilTrainTransform.from_spec(inputs.spec)


def store_dataset(
    inputs: BenchInputs, transform: Callable[[], Any] | None = None, dataset: Path | None = None
) -> Callable[[], Any]:
    """A factory of the map-style dataset over the shards (``dataset``, default the inputs'), decoded with PIL and
    augmented by ``transform()`` (default: :func:`pil_transform`)."""
    from dali_pipes.bench.baselines import StoreImageDataset

    make = transform or functools.partial(pil_transform, inputs)
    return lambda: StoreImageDataset(dataset or inputs.dataset, make())


def file_dataset(inputs: BenchInputs, files: Callable[[], tuple] | None = None) -> Callable[[], Any]:
    """A factory of the map-style dataset over the original files (``files()``, default :func:`original_files`),
    decoded and augmented with PIL."""
    from dali_pipes.bench.baselines import FileImageDataset

    files = files or functools.partial(original_files, inputs)
    return lambda: FileImageDataset(files(), pil_transform(inputs))


# --- DALI's own reader over the original files ---------------------------------------------------


def original_files(inputs: BenchInputs) -> tuple:
    """The original image files the shards came from; skips the row when they are not known."""
    if not inputs.files:
        raise Skipped(inputs.files_reason or "no original image files")
    return inputs.files


def anchor_job(
    name: str, inputs: BenchInputs, device: str, target: Target, files: Callable[[], tuple] | None = None, **params: Any
) -> Job:
    """A row of DALI's ``fn.readers.file`` over the original files (:mod:`~dali_pipes.bench.anchor`), the same
    graph on ``device``, with as many threads as the ``dali-pipes`` rows."""
    from dali_pipes.bench.anchor import file_reader_stream

    threads = inputs.loader_settings.get("num_threads", inputs.cores)

    def factory() -> Any:
        return file_reader_stream(
            (files or functools.partial(original_files, inputs))(),
            inputs.spec,
            batch_size=inputs.batch_size,
            device=device,
            num_threads=threads,
            target=target,
        )

    return Job(
        name,
        factory,
        f"DALI fn.readers.file over the original files, the same graph on the {device.upper()}",
        {"num_threads": threads, **params},
        in_flight=ANCHOR_IN_FLIGHT,
        runs_dali=True,
    )
