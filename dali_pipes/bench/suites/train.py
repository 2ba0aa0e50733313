"""``dali-pipes bench DATASET --suite train``: how fast a real model trains, fed by each loader a user would pick.

A user buys a faster training run, not a loader's images per second. This suite
runs the same training step (forward, backward, SGD with momentum; on a GPU in
bfloat16 autocast with ``channels_last`` and cuDNN's autotuner on, as a
competent PyTorch user trains) fed by:

- ``model alone``: one synthetic batch already on the device, no input pipeline
  at all: the model's own rate, which no loader can beat;
- ``dali-pipes``: :class:`~dali_pipes.DALILoader` over the shards with its defaults
  (or a ``--settings`` file's);
- ``DALI readers.file``: a plain DALI pipeline (``fn.readers.file`` over the
  original files, the same graph, DALI's default decoder load, one thread per core);
- ``DataLoader+PIL``: ``torch.utils.data.DataLoader`` with PIL decoding and the same
  augmentation, ``num_workers`` = the cores, ``pin_memory`` and
  ``persistent_workers`` (over the original files where they are known, else the shards).

Models (:data:`GPU_MODELS`): a ResNet-50 at 224 px, and a ResNet-18 at 160 px,
where the model is cheap and the input matters most; torchvision's when it
imports, else the same architecture from :mod:`dali_pipes.bench.models`. On a
machine without CUDA a small model (:data:`CPU_MODELS`) trains instead, so
that the suite runs and is tested anywhere.

Columns: ``x ref`` is the row's rate over the model's own (how much of the
GPU's training capacity the loader lets the run use); ``gpu_busy`` the GPU's
utilisation while the row ran (NVML's share of time with a kernel running, decoding
included; on a GPU with ``nvidia-ml-py``); ``bound_by`` which side holds the run
back (``input`` below :data:`~dali_pipes.bench.doctor.DATA_BOUND` of the model's
rate, as ``dali-pipes doctor`` says it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import threading
import time
from typing import Any, Callable, ContextManager, Iterator

from dali_pipes.bench.doctor import DATA_BOUND
from dali_pipes.bench.inputs import BenchInputs
from dali_pipes.bench.models import model_source, train_step, training_model
from dali_pipes.bench.report import BenchReport, figure, ratio, suite_report
from dali_pipes.bench.runner import Job, Row, Target
from dali_pipes.bench.streams import (
    ANCHOR_IN_FLIGHT,
    dali_batches,
    dali_in_flight,
    dataloader_batches,
    dataloader_in_flight,
    original_files,
)
from dali_pipes.bench.suites import SuiteRun

log = logging.getLogger(__name__)

#: ``(model, image size)`` trained on a GPU: the usual ImageNet run, and a cheap model at a low resolution.
GPU_MODELS: tuple[tuple[str, int], ...] = (("resnet50", 224), ("resnet18", 160))
#: What trains on a machine without CUDA: small enough for two cores.
CPU_MODELS: tuple[tuple[str, int], ...] = (("tiny", 64),)

MODEL_ALONE = "model alone"
OURS = "dali-pipes"
PLAIN_DALI = "DALI readers.file"
DATALOADER = "DataLoader+PIL"

Batches = Callable[[], ContextManager[Iterator[tuple[Any, Any]]]]


def run(bench: SuiteRun) -> BenchReport:
    """Training images/s of each model fed by each loader, side by side per model (see the module docstring)."""
    import torch

    inputs, target = bench.inputs, bench.target
    if target.is_cuda:
        torch.backends.cudnn.benchmark = True  # what a training script sets for fixed-size batches
    models = GPU_MODELS if target.is_cuda else CPU_MODELS
    num_classes = len(inputs.manifest.classes or ()) or 1000
    # Few batches a window: a DataLoader row's large batches come slowly; the windows' seconds still hold.
    plan = dataclasses.replace(bench.plan, min_batches=min(bench.plan.min_batches, 3))
    rows: list[Row] = []
    for model, size in models:
        these = dataclasses.replace(inputs, spec=dataclasses.replace(inputs.spec, size=size))
        with GpuBusy(target) as busy:
            measured = bench.rows(_jobs(these, model, num_classes, target), plan, title=f"bench train {model}")
        for row in measured:
            row.extra["gpu_busy"] = busy.share(row)
        rows += measured
    report = suite_report(
        "train",
        "training throughput: the same training step fed by each loader",
        inputs,
        rows,
        reference=MODEL_ALONE,
        reference_match=("model", "size"),
        reference_label=f"{MODEL_ALONE} (the model's own rate)",
        columns=("gpu_busy", "bound_by"),
    )
    for row in rows:
        share = report.ratio(row)
        if share is not None and row.name != MODEL_ALONE:
            row.extra["bound_by"] = "model" if share >= DATA_BOUND else "input"
    report.summary = _summary(report, models)
    report.context["models"] = [{"model": m, "size": s, "source": model_source(m)} for m, s in models]
    report.notes.append(
        "the step: forward, cross-entropy, backward, SGD (momentum 0.9)"
        + ("; bfloat16 autocast, channels_last, cudnn.benchmark" if target.is_cuda else "; float32 on the CPU")
        + f". gpu_busy: NVML's share of time with a GPU kernel running (decoding included). bound_by: 'input' below "
        f"{DATA_BOUND:.0%} of the model's own rate"
    )
    return report


def _jobs(inputs: BenchInputs, model: str, num_classes: int, target: Target) -> list[Job]:
    """The four rows of one model: alone, and fed by each loader."""
    from dali_pipes.bench.anchor import file_reader_batches
    from dali_pipes.bench.baselines import FileImageDataset, PilTrainTransform, StoreImageDataset

    device = "gpu" if target.is_cuda else "cpu"
    ours = inputs.settings_for(device) if inputs.tuned else {}
    batch, workers = inputs.batch_size, inputs.cores
    transform = PilTrainTransform.from_spec(inputs.spec)
    files = inputs.files

    def row(name: str, batches: Batches | None, description: str, in_flight: int, runs_dali: bool) -> Job:
        factory = functools.partial(training_stream, batches, model, num_classes, inputs, target)
        params = {"model": model, "size": inputs.spec.size}
        return Job(name, factory, description, params, in_flight=in_flight, runs_dali=runs_dali)

    return [
        row(MODEL_ALONE, None, f"{model} training steps on one synthetic batch already on the device", 0, False),
        row(
            OURS,
            functools.partial(
                dali_batches, inputs.dataset, inputs.spec, batch_size=batch, device=device, settings=ours
            ),
            "DALILoader over the shards, " + ("its tuned settings" if ours else "its defaults"),
            dali_in_flight(ours),
            True,
        ),
        row(
            PLAIN_DALI,
            lambda: file_reader_batches(
                original_files(inputs), inputs.spec, batch_size=batch, device=device, num_threads=workers
            ),
            f"fn.readers.file over the original files, the same graph, DALI's defaults, {workers} threads",
            ANCHOR_IN_FLIGHT,
            True,
        ),
        row(
            DATALOADER,
            lambda: dataloader_batches(
                FileImageDataset(files, transform) if files else StoreImageDataset(inputs.dataset, transform),
                batch_size=batch,
                num_workers=workers,
            ),
            f"DataLoader + PIL, num_workers={workers}, pin_memory, persistent_workers",
            dataloader_in_flight(workers),
            False,
        ),
    ]


@contextlib.contextmanager
def training_stream(
    batches: Batches | None, model: str, num_classes: int, inputs: BenchInputs, target: Target
) -> Iterator[Iterator[int]]:
    """Training steps of a fresh ``model`` on each batch of ``batches()`` (``None``: one synthetic batch on the device)."""
    import torch

    net, optimizer = training_model(model, num_classes, target.device)
    size, batch_size = inputs.spec.size, inputs.batch_size
    memory_format = torch.channels_last if target.is_cuda else torch.contiguous_format

    def steps(source: Iterator[tuple[Any, Any]]) -> Iterator[int]:
        for images, labels in source:
            images = target.put(images).contiguous(memory_format=memory_format)
            train_step(net, optimizer, images, target.put(labels).reshape(-1).long())
            yield int(images.shape[0])

    if batches is None:
        images = torch.randn(batch_size, 3, size, size, device=target.device)
        labels = torch.randint(0, num_classes, (batch_size,), device=target.device)
        yield steps(iter(lambda: (images, labels), None))
        return
    with batches() as source:
        yield steps(source)


# --- the GPU's utilisation ----------------------------------------------------------------------


class GpuBusy:
    """NVML's GPU utilisation sampled every ``interval`` seconds in a thread, averaged over a row's windows.

    ``share(row)`` is ``None`` without a GPU, without ``nvidia-ml-py``, or for a row not measured.
    """

    def __init__(self, target: Target, interval: float = 0.1) -> None:
        self._target = target
        self._interval = interval
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GpuBusy":
        if self._target.is_cuda and self._read() is not None:
            self._thread = threading.Thread(target=self._run, name="dali-pipes-gpu-busy", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _read(self) -> float | None:
        import torch

        try:
            return float(torch.cuda.utilization(torch.device(self._target.device)))
        except Exception as exc:  # noqa: BLE001 - no NVML (nvidia-ml-py) here: the column stays empty
            log.debug("bench train: no GPU utilisation readings: %s", exc)
            return None

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            value = self._read()
            if value is not None:
                self._samples.append((time.perf_counter(), value / 100))

    def share(self, row: Row) -> float | None:
        """The mean utilisation over ``row``'s timed windows, rounded to 0.01."""
        if row.timing is None:
            return None
        inside = [value for when, value in self._samples if any(a <= when <= b for a, b in row.timing.spans)]
        return round(statistics.mean(inside), 2) if inside else None


def _summary(report: BenchReport, models: tuple[tuple[str, int], ...]) -> dict[str, Any]:
    """Each loader's training rate over the model's own, and ours over the DataLoader's, per model."""
    summary: dict[str, Any] = {}
    for model, size in models:
        ours, alone, dataloader, plain = (
            report.row(name, model=model, size=size) for name in (OURS, MODEL_ALONE, DATALOADER, PLAIN_DALI)
        )
        key = f"{model} {size}px"
        summary[f"{key}: {OURS} / {MODEL_ALONE}"] = figure(ratio(ours, alone), "at least 0.95x (resnet50)")
        summary[f"{key}: {DATALOADER} / {MODEL_ALONE}"] = figure(ratio(dataloader, alone))
        summary[f"{key}: {OURS} / {DATALOADER}"] = figure(ratio(ours, dataloader), "at least 3x (resnet18 160px)")
        summary[f"{key}: {OURS} / {PLAIN_DALI}"] = figure(ratio(ours, plain))
    return summary
