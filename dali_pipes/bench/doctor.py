"""``dali-pipes doctor``: is this training bound by its data, by how much, and what to change first.

Three throughputs for one model and batch size, each timed like a benchmark row
(warm-up left out, median of windows, GPU synchronised):

- **loader**: :class:`~dali_pipes.DALILoader` alone, batches delivered to the
  training device;
- **model**: forward, backward and optimiser step on one synthetic batch that is
  already on the device (no input pipeline at all);
- **combined**: the loader feeding the training step, as in a real loop.

Training is data-bound when the loader alone is slower than the model alone:
then the combined rate is held near the loader's, and the report says how much
faster the model could go. When both are fast alone but slow together, they
compete for the same CPU cores.

A large model on a CPU can need many seconds a training step, and ``doctor`` runs
dozens of steps: one step is timed first, the whole run is estimated from it
(:func:`check_budget`), and a run longer than the user's limit is refused up front,
naming smaller models; a progress bar counts the steps (:func:`counted`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from dali_pipes.bench.model_names import MODELS
from dali_pipes.bench.runner import Job, Row, Target, TimingPlan, cycle, measure
from dali_pipes.bench.streams import dali_in_flight, dali_loader_stream, open_loader, targets
from dali_pipes.dataset.progress import bar_disabled

log = logging.getLogger(__name__)

#: Below this fraction of the model's rate the loader is called the bottleneck.
DATA_BOUND = 0.95
#: Combined below this fraction of the slower of the two alone means they contend for resources.
CONTENTION = 0.8
#: ``doctor``'s default limit on its own running time, in minutes.
MAX_MINUTES = 10.0


@dataclass
class DoctorReport:
    """The three measurements, the verdict in words, and the setting to change first."""

    model: str
    loader: Row
    model_only: Row
    combined: Row
    data_bound: bool | None
    verdict: str
    advice: str
    context: dict[str, Any]
    machine: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": "doctor",
            "model": self.model,
            "rows": [self.loader.to_json(), self.model_only.to_json(), self.combined.to_json()],
            "data_bound": self.data_bound,
            "verdict": self.verdict,
            "advice": self.advice,
            "figures": self.extra,
            "context": self.context,
            "machine": self.machine,
        }


@contextlib.contextmanager
def combined_stream(loader_factory: Any, model: Any, optimizer: Any, target: Target) -> Iterator[Iterator[int]]:
    """The loader feeding training steps: the real loop."""
    with loader_factory() as loader:

        def steps() -> Iterator[int]:
            import torch

            from dali_pipes.bench.models import train_step

            for batch in cycle(loader):
                images = target.put(batch["image"]).float()
                # A segmentation batch's targets are delivered as a training loop would; the classifier
                # standing in for the model learns class 0 (see segmentation_inputs).
                delivered = [target.put(value) for value in targets(batch)]
                if "label" in batch:
                    labels = delivered[0].long().reshape(-1)
                else:
                    labels = torch.zeros(images.shape[0], dtype=torch.long, device=images.device)
                train_step(model, optimizer, images, labels)
                yield int(images.shape[0])

        yield steps()


def run_doctor(
    dataset: str | os.PathLike,
    *,
    model: str = "resnet50",
    batch_size: int = 64,
    steps: int = 30,
    quick: bool = False,
    device: str = "auto",
    settings: str | os.PathLike | None = None,
    progress: bool = True,
    max_minutes: float = MAX_MINUTES,
) -> DoctorReport:
    """Measure loader, model and combined throughput and say which one bounds training.

    ``steps`` are the timed batches of each measurement (in three windows);
    ``settings`` a file from ``dali-pipes tune`` for the loader. One training step
    is timed first: the run's length is logged, and a run estimated to exceed
    ``max_minutes`` raises ValueError naming smaller models, before the long part.
    """
    from dali_pipes.bench.inputs import bench_inputs
    from dali_pipes.bench.models import training_model  # torch: imported when a doctor runs, not with the CLI
    from dali_pipes.bench.report import machine_description

    if steps < 3:
        raise ValueError(f"--steps must be at least 3 (three timed windows), got {steps}")
    inputs = segmentation_inputs(bench_inputs(dataset, batch_size=batch_size, settings=settings))
    loader_device, target = _devices(device)
    num_classes = len(inputs.manifest.classes or ()) or 1000
    net, optimizer = training_model(model, num_classes, target.device)
    plan = _doctor_plan(steps, quick)
    _check_time(model, net, optimizer, inputs, num_classes, plan, loader_device, target, max_minutes)
    jobs = _doctor_jobs(inputs, model, net, optimizer, batch_size, num_classes, loader_device, target)
    loader_row, model_row, combined_row = _measure(jobs, plan, target, progress)
    data_bound, verdict, advice, figures = diagnose(
        loader_row.images_per_s,
        model_row.images_per_s,
        combined_row.images_per_s,
        loader_device=loader_device,
        cuda=target.is_cuda,
        cores=inputs.cores,
        tuned=settings is not None,
    )
    context = {
        **inputs.describe(),
        "loader_device": loader_device,
        "model_device": target.device,
        "steps": steps,
        "quick": quick,
        "num_classes": num_classes,
    }
    return DoctorReport(
        model, loader_row, model_row, combined_row, data_bound, verdict, advice, context, machine_description(), figures
    )


def _check_time(
    model: str,
    net: Any,
    optimizer: Any,
    inputs: Any,
    num_classes: int,
    plan: TimingPlan,
    loader_device: str,
    target: Target,
    max_minutes: float,
) -> None:
    """Time one training step, log how long the run will take, and refuse it over ``max_minutes``."""
    batch_size = inputs.batch_size
    in_flight = dali_in_flight(inputs.settings_for(loader_device))
    per_job = plan.warmup_batches + plan.repeats * plan.min_batches
    step_s = _time_training_step(model, net, optimizer, batch_size, inputs.spec.size, num_classes, target)
    check_budget(
        model=model,
        smaller=MODELS[MODELS.index(model) + 1 :],
        device=target.device,
        batch_size=batch_size,
        step_s=step_s,
        steps=2 * per_job + in_flight,  # the model alone, then fed by the loader
        max_minutes=max_minutes,
    )


def _measure(jobs: list[Job], plan: TimingPlan, target: Target, progress: bool) -> list[Row]:
    """The rows measured one after another, a progress bar counting their steps."""
    from dali_pipes.dataset.progress import tqdm

    rows = []
    # No total: the warm-ups run for a time, not a step count, so any total would be wrong.
    with tqdm(desc="doctor", unit="step", disable=bar_disabled(progress)) as bar:
        for job in jobs:
            bar.set_postfix_str(job.name)
            job.factory = functools.partial(counted, job.factory, bar.update)
            rows.append(measure(job, plan, target))
    return rows


def segmentation_inputs(inputs: Any) -> Any:
    """``inputs`` with the spec a segmentation dataset trains with, at the doctor's 224 px, else unchanged.

    Instance masks (``convert coco --masks``): :class:`~dali_pipes.InstanceSegmentation`; label maps
    (``convert segmentation``): :class:`~dali_pipes.SemanticSegmentation`. The model trained beside it
    stays the ``--model`` classifier on the same images (it learns class 0): the doctor measures whether
    the loader keeps up with a model of that cost, masks and all delivered; it trains no mask head.
    """
    from dali_pipes.pipelines import InstanceSegmentation, SemanticSegmentation

    fields, size = inputs.manifest.fields, inputs.spec.size
    if {"masks", "mask_code"} <= set(fields):
        spec = InstanceSegmentation(size=size, max_size=size, dtype=inputs.spec.dtype).bind(inputs.manifest)
    elif "mask" in fields:
        spec = SemanticSegmentation(size=size, dtype=inputs.spec.dtype)
    else:
        return inputs
    return dataclasses.replace(inputs, spec=spec)


def _devices(device: str) -> tuple[str, Target]:
    """Where the loader runs (``gpu``/``cpu``), and the target the model trains on: the GPU the loader feeds.

    ``cuda:LOCAL_RANK`` (as :func:`~dali_pipes.loading.world.pick_gpu` chooses it), not the current device,
    so that the combined row never copies batches between GPUs.
    """
    import torch

    from dali_pipes.loading.world import pick_gpu, resolve_device

    local_rank = int(os.environ.get("LOCAL_RANK") or 0)
    loader_device, device_id = resolve_device(device, local_rank)
    if device_id is None and torch.cuda.is_available():
        device_id = pick_gpu(local_rank)
    return loader_device, Target("cpu" if device_id is None else f"cuda:{device_id}")


def _doctor_plan(steps: int, quick: bool) -> TimingPlan:
    """Three timed windows of ``steps // 3`` batches after the warm-up."""
    # A model's first steps are slow (allocator, oneDNN/cuDNN algorithm choice): warm up on time too.
    return TimingPlan(
        warmup_batches=3 if quick else 5,
        repeats=3,
        min_batches=max(1, steps // 3),
        min_seconds=0.0,
        warmup_seconds=0.5 if quick else 3.0,
    )


def _doctor_jobs(
    inputs: Any,
    model: str,
    net: Any,
    optimizer: Any,
    batch_size: int,
    num_classes: int,
    loader_device: str,
    target: Target,
) -> list[Job]:
    """The three rows of ``doctor``: the loader alone, the model alone, and the loader feeding the model."""
    from dali_pipes.bench.models import model_stream

    settings = inputs.settings_for(loader_device)
    in_flight = dali_in_flight(settings)
    loader = functools.partial(
        open_loader, inputs.dataset, inputs.spec, batch_size=batch_size, device=loader_device, settings=settings
    )
    alone = functools.partial(
        dali_loader_stream,
        inputs.dataset,
        inputs.spec,
        batch_size=batch_size,
        device=loader_device,
        target=target,
        settings=settings,
    )
    size, device = inputs.spec.size, target.device
    params = {"batch_size": batch_size}
    return [
        Job(
            "loader",
            alone,
            f"DALILoader alone on {loader_device}, batches delivered to {device}",
            params,
            in_flight=in_flight,
        ),
        Job(
            "model",
            lambda: model_stream(
                net, optimizer, batch_size=batch_size, size=size, num_classes=num_classes, device=device
            ),
            f"{model} forward + backward + SGD step on a synthetic batch already on {device}",
            dict(params),
        ),
        Job(
            "combined",
            lambda: combined_stream(loader, net, optimizer, target),
            f"DALILoader feeding {model} training steps",
            dict(params),
            in_flight=in_flight,
        ),
    ]


def _time_training_step(
    name: str, model: Any, optimizer: Any, batch_size: int, size: int, num_classes: int, target: Target
) -> float:
    """Seconds of one training step of ``model`` (called ``name``) on a synthetic batch on the training device."""
    import torch

    from dali_pipes.bench.models import train_step

    images = torch.randn(batch_size, 3, size, size, device=target.device)
    labels = torch.randint(0, num_classes, (batch_size,), device=target.device)
    log.info("doctor: timing one %s training step of batch %d to estimate the run", name, batch_size)

    def step() -> None:
        train_step(model, optimizer, images, labels)
        target.sync()

    return time_one_step(step)


def time_one_step(step: Callable[[], None]) -> float:
    """Seconds of one call of ``step`` after a first, untimed one (allocation, kernel choice)."""
    step()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def check_budget(
    *, model: str, smaller: tuple[str, ...], device: str, batch_size: int, step_s: float, steps: int, max_minutes: float
) -> float:
    """Estimated seconds of ``steps`` training steps of ``step_s`` each; ValueError when over ``max_minutes``.

    The estimate leaves out the loader's own time, so it is a lower bound on the CPU.
    """
    estimate = steps * step_s
    if estimate > max_minutes * 60:
        others = f"a smaller model (--model {' or '.join(smaller)}), " if smaller else ""
        raise ValueError(
            f"doctor would take about {estimate / 60:.0f} minutes: one {model} training step of batch {batch_size} "
            f"takes {step_s:.1f} s on the {device}, and it needs about {steps} of them; choose {others}a smaller "
            f"--batch-size or fewer --steps, or allow it with --max-minutes {estimate / 60 + 1:.0f}"
        )
    log.info(
        "doctor: about %s (%d training steps of %s at %.2f s each on the %s, plus the loader)",
        _minutes(estimate),
        steps,
        model,
        step_s,
        device,
    )
    return estimate


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


@contextlib.contextmanager
def counted(factory: Callable[[], Any], tick: Callable[[int], Any]) -> Iterator[Iterator[int]]:
    """``factory()``'s stream of batch sizes, calling ``tick(1)`` for every batch (a progress bar's update)."""
    with factory() as stream:

        def steps() -> Iterator[int]:
            for images in stream:
                tick(1)
                yield images

        yield steps()


def diagnose(
    loader: float | None,
    model: float | None,
    combined: float | None,
    *,
    loader_device: str,
    cuda: bool,
    cores: int,
    tuned: bool = False,
) -> tuple[bool | None, str, str, dict[str, Any]]:
    """``(data_bound, verdict, advice, figures)`` from the three images/s (``None``: not measured)."""
    if not (loader and model and combined):
        return (
            None,
            "not enough measurements for a verdict (see the failed rows)",
            "fix the failed measurement first",
            {},
        )
    figures = {
        "loader_over_model": loader / model,
        "combined_over_model": combined / model,
        "time_waiting_on_data": max(0.0, 1.0 - combined / model),
    }
    tune = "" if tuned else " (`dali-pipes tune DATASET` finds its best value, with py_num_workers and prefetch)"
    if loader < DATA_BOUND * model:
        figures["model_could_go_faster_by"] = model / combined
        verdict = (
            f"DATA-BOUND: the loader delivers {loader:,.0f} images/s but the model could train on {model:,.0f}; "
            f"training runs at {combined:,.0f} images/s, so the model waits for data about "
            f"{figures['time_waiting_on_data']:.0%} of the time and a faster input pipeline would make training up to "
            f"{model / combined:.1f}x faster."
        )
        if loader_device == "cpu" and cuda:
            advice = "device='gpu': decoding and augmentation on the CPU are the bottleneck; move them to the GPU"
        elif loader_device == "gpu":
            advice = "num_threads (the CPU threads that feed the GPU decoder)" + tune
        else:
            advice = (
                f"num_threads (DALI's decoding threads; this machine has {cores} cores){tune}; beyond what the cores "
                "give, only a GPU (device='gpu') changes the picture"
            )
        return True, verdict, advice, figures
    if combined < CONTENTION * min(loader, model):
        verdict = (
            f"NOT DATA-BOUND ALONE, BUT CONTENDED: the loader ({loader:,.0f} images/s) and the model ({model:,.0f}) are "
            f"each fast enough alone, yet together reach only {combined:,.0f}: they compete for the same "
            f"{cores} CPU cores."
        )
        advice = (
            "device='gpu' to take decoding off the CPU"
            if loader_device == "cpu" and cuda
            else "num_threads: give DALI fewer threads than cores so that the training step keeps some" + tune
        )
        return False, verdict, advice, figures
    verdict = (
        f"NOT DATA-BOUND: the model trains at {model:,.0f} images/s and the loader delivers {loader:,.0f} "
        f"({loader / model:.1f}x what the model needs); training runs at {combined:,.0f}."
    )
    advice = "the model, not the loader: mixed precision (torch.autocast), channels_last, or a larger batch"
    return False, verdict, advice, figures


def format_doctor(report: DoctorReport) -> str:
    """What ``dali-pipes doctor`` prints."""
    c = report.context
    lines = [
        f"doctor: {report.model}, batch {c['batch_size']}, {c['num_samples']} samples, loader on {c['loader_device']}, "
        f"model on {c['model_device']}, {c['cores']} cores",
    ]
    for row in (report.loader, report.model_only, report.combined):
        if row.timing is not None:
            figure = f"{row.timing.median:10.1f} images/s ±{100 * row.timing.spread:.0f}%"
        else:
            figure = f"failed: {row.error or row.skipped}"
        lines.append(f"  {row.name + '-only' if row.name != 'combined' else row.name:<12} {figure}   {row.description}")
    lines.append(report.verdict)
    lines.append(f"change first: {report.advice}")
    if c.get("quick"):
        lines.append("--quick: few timed steps; the figures only show that every measurement runs")
    return "\n".join(lines)
