"""The rows a benchmark suite measures (:class:`~dali_pipes.bench.runner.Job` factories), shared by the suites.

``dali_job``: this package's loader; ``dataloader_job``: a PyTorch ``DataLoader``
over a dataset made inside the row (so a backend that does not import skips
only its row); ``anchor_job``: DALI's ``fn.readers.file`` over the original files.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Mapping

from dali_pipes.bench.inputs import BenchInputs
from dali_pipes.bench.report import BenchReport, machine_description
from dali_pipes.bench.runner import Job, Skipped, Target
from dali_pipes.bench.streams import dali_in_flight


def suite_report(suite: str, title: str, inputs: BenchInputs, rows: list, **kwargs: Any) -> BenchReport:
    """A suite's report: its rows, with the inputs and the machine they were measured on."""
    return BenchReport(suite, title, rows, inputs.describe(), machine_description(), **kwargs)


# --- row factories ---------------------------------------------------------------------------


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
    (default: the inputs' for that device, :meth:`BenchInputs.settings_for`)."""
    from dali_pipes.bench.streams import dali_loader_stream

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
    in_flight = dali_in_flight(settings)
    return Job(
        name,
        factory,
        f"DALILoader over the shards, decode and augment on {where}",
        {**settings, **params},
        in_flight=in_flight,
        runs_dali=True,
    )


def dataloader_job(
    name: str, make_dataset: Callable[[], Any], inputs: BenchInputs, target: Target, description: str, **params: Any
) -> Job:
    """A row of a PyTorch ``DataLoader`` over ``make_dataset()``, with ``num_workers`` = cores unless given."""
    from dali_pipes.bench.streams import dataloader_stream

    num_workers = params.setdefault("num_workers", inputs.cores)
    batch_size = params.get("batch_size", inputs.batch_size)

    def factory():
        # The dataset is made inside the row, so an optional backend that does not import skips it.
        return dataloader_stream(make_dataset(), batch_size=batch_size, num_workers=num_workers, target=target)

    # torch's default prefetch_factor: two batches per worker; one in the main process.
    return Job(name, factory, description, params, in_flight=2 * num_workers + 1)


def original_files(inputs: BenchInputs) -> tuple:
    """The original image files the shards came from; skips the row when they are not known."""
    if not inputs.files:
        raise Skipped(inputs.files_reason or "no original image files")
    return inputs.files


def anchor_job(
    name: str, inputs: BenchInputs, device: str, target: Target, files: Callable[[], tuple] | None = None, **params: Any
) -> Job:
    """A row of DALI's ``fn.readers.file`` over the original files, the same graph on ``device``."""
    from dali_pipes.bench.anchor import file_reader_stream

    def factory():
        return file_reader_stream(
            (files or functools.partial(original_files, inputs))(),
            inputs.spec,
            batch_size=inputs.batch_size,
            device=device,
            num_threads=inputs.loader_settings.get("num_threads", inputs.cores),
            target=target,
        )

    return Job(
        name,
        factory,
        f"DALI fn.readers.file over the original files, the same graph on the {device.upper()}",
        {"num_threads": inputs.loader_settings.get("num_threads", inputs.cores), **params},
        in_flight=2 + 1,  # DALI's default prefetch_queue_depth
        runs_dali=True,
    )


def pil_transform(inputs: BenchInputs):
    """The PIL transform equivalent to the inputs' spec."""
    from dali_pipes.bench.baselines import PilTrainTransform

    return PilTrainTransform.from_spec(inputs.spec)


def store_dataset(inputs: BenchInputs, transform: Callable[[], Any], dataset: Path | None = None) -> Callable[[], Any]:
    """A factory of the map-style dataset over the shards, decoded with PIL."""
    from dali_pipes.bench.baselines import StoreImageDataset

    return lambda: StoreImageDataset(dataset or inputs.dataset, transform())


def file_dataset(files: Callable[[], tuple], transform: Callable[[], Any]) -> Callable[[], Any]:
    """A factory of the map-style dataset over the original files, decoded with PIL."""
    from dali_pipes.bench.baselines import FileImageDataset

    return lambda: FileImageDataset(files(), transform())
