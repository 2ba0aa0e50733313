"""The benchmark suites: which rows each one measures, on the same shards, augmentation, batch and cores.

- ``main`` (``dali-pipes bench DATASET``): this package's loader on the GPU and
  the CPU, the ``DataLoader`` baselines (PIL over the shards and over the
  original files, torchvision, Albumentations), DALI's ``fn.readers.file`` over
  the files (the anchor), and the decode-only ceiling of the same JPEGs;
- ``feed``: the feed alone, this package's loader against DALI's
  ``fn.readers.file``, nothing decoded (see :mod:`dali_pipes.bench.feed`);
- ``albumentations``: Albumentations against torchvision-style PIL transforms
  (and torchvision itself), in one process and with ``num_workers`` = cores;
- ``cpu-vs-gpu``: augmentation on the CPU and the GPU for growing image counts,
  start-up included (what a short job sees);
- ``workers``: the ``DataLoader`` baseline over ``num_workers`` and batch sizes;
- ``formats``: the same images as files, LMDB, HDF5 and TFRecord (converted into
  a temporary folder), read raw, through DALI and through the ``DataLoader``;
- ``stages``: this package's loader with growing prefixes of the training graph
  (read, decode, resize, jitter, normalise), on the CPU and the GPU, and what
  each step adds per image (see :mod:`dali_pipes.bench.stages`);
- ``storage``: epoch 1 and 2 reading the dataset where it is, staged into
  ``/dev/shm``, and with ``cache="ram"`` (see :mod:`dali_pipes.bench.storage`);
- ``recipe``: an epoch at 160 against 224 px, plain and with RandomErasing and
  MixUp/CutMix (see :mod:`dali_pipes.bench.recipe`);
- ``masks``: instance or semantic segmentation against the same pipeline without
  its masks, on the GPU and the CPU (see :mod:`dali_pipes.bench.masks`);
- ``train``: a real model's training throughput fed by this loader, a plain DALI
  pipeline and the ``DataLoader``, against the model's own rate (see
  :mod:`dali_pipes.bench.train`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from dali_pipes.bench.inputs import BenchInputs, bench_inputs
from dali_pipes.bench.interleave import run_jobs
from dali_pipes.bench.jobs import (
    anchor_job,
    dali_job,
    dataloader_job,
    file_dataset,
    pil_transform,
    store_dataset,
    suite_report,
)
from dali_pipes.bench.main_suite import BASELINE, main_suite
from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.runner import Job, Target, TimingPlan, warm_page_cache

log = logging.getLogger(__name__)

SUITES: tuple[str, ...] = (
    "main",
    "feed",
    "gpu-decoder",
    "albumentations",
    "cpu-vs-gpu",
    "workers",
    "formats",
    "stages",
    "storage",
    "recipe",
    "masks",
    "train",
)

Suite = Callable[[BenchInputs, TimingPlan, Target, bool, bool], BenchReport]


def run_bench(
    dataset: str | os.PathLike,
    *,
    suite: str = "main",
    batch_size: int = 64,
    images: str | os.PathLike | None = None,
    quick: bool = False,
    settings: str | os.PathLike | None = None,
    dtype: str = "float32",
    cores: int | None = None,
    progress: bool = True,
    rows: Sequence[str] = (),
    repeats: int | None = None,
) -> BenchReport:
    """Run one suite on ``dataset`` and return its report (see the module docstring).

    ``images`` is the original image folder (default: the manifest's imagefolder
    source); ``settings`` a file saved by ``dali-pipes tune`` for the
    ``dali-pipes`` rows; ``quick`` times just enough to check that every row runs;
    ``rows`` (main suite) the names of the rows to measure, for a shorter run;
    ``repeats`` the timed windows per row (default :class:`TimingPlan`'s 5; 3 fits a GPU lease).
    """
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    if rows and suite != "main":
        # The other suites' figures are differences or ratios between their rows: a subset would misreport them.
        raise ValueError(f"--rows applies to the main suite, not to --suite {suite}")
    inputs = bench_inputs(
        dataset, batch_size=batch_size, images=images, cores=cores, dtype=dtype, settings=settings, rows=rows
    )
    plan = TimingPlan.quick() if quick else TimingPlan()
    if repeats is not None:
        plan = dataclasses.replace(plan, repeats=repeats)
    target = Target()
    # Every row then reads from memory alike, whichever runs first.
    warm_page_cache(sorted(p for p in Path(dataset).rglob("*") if p.is_file()))
    warm_page_cache(path for path, _ in inputs.files)
    report = _SUITES[suite](inputs, plan, target, quick, progress)
    report.context.update(
        {
            "target_device": target.device,
            "quick": quick,
            "timing": {
                "warmup_batches": plan.warmup_batches,
                "warmup_seconds": plan.warmup_seconds,
                "repeats": plan.repeats,
                "min_batches_per_window": plan.min_batches,
                "min_seconds_per_window": plan.min_seconds,
            },
        }
    )
    if suite != "storage":  # which drops the page cache before each epoch 1 on purpose
        report.notes.append("files and shards were read once before timing: every row reads from the page cache alike")
    if target.is_cuda:
        report.notes.append("every row delivers its batches to the GPU: host-to-device copies are inside the timing")
    if quick:
        report.notes.append("--quick: tiny timing windows; the figures only show that every row runs")
    return report


# --- suites ----------------------------------------------------------------------------------


def albumentations_suite(
    inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool
) -> BenchReport:
    """Albumentations against torchvision-style PIL transforms (and torchvision), in one process and on every core."""
    from dali_pipes.bench.backends import AlbumentationsTrainTransform, TorchvisionTrainTransform

    spec = inputs.spec
    backends = [
        ("PIL (torchvision-style)", lambda: pil_transform(inputs), "PIL decode + PIL/numpy transforms"),
        ("torchvision", lambda: TorchvisionTrainTransform(spec), "PIL decode + torchvision transforms"),
        ("Albumentations", lambda: AlbumentationsTrainTransform(spec), "OpenCV decode + Albumentations transforms"),
    ]
    jobs = [
        dataloader_job(name, store_dataset(inputs, make), inputs, target, description, num_workers=workers)
        for workers in sorted({0, inputs.cores})
        for name, make, description in backends
    ]
    return suite_report(
        "albumentations",
        "augmentation libraries in a DataLoader over the shards",
        inputs,
        run_jobs(jobs, plan, target, progress=progress, title="albumentations"),
        reference="PIL (torchvision-style)",
        reference_match=("num_workers",),
    )


def cpu_vs_gpu_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    """Augmentation on the CPU and on the GPU for growing image counts, start-up included."""
    b = inputs.batch_size
    counts = [b, 4 * b] if quick else [b, 4 * b, 16 * b, 64 * b]
    repeats = min(plan.repeats, 3)
    jobs = []
    for count in counts:
        for job in (
            dataloader_job(
                "DataLoader+PIL cpu",
                store_dataset(inputs, lambda: pil_transform(inputs)),
                inputs,
                target,
                "DataLoader + PIL over the shards, workers started in the timing",
            ),
            dali_job("dali-pipes cpu", inputs, "cpu", target),
            dali_job("dali-pipes gpu", inputs, "gpu", target),
        ):
            job.params = {"images": count}
            job.cold_images = count
            jobs.append(job)
    cold = TimingPlan(warmup_batches=0, repeats=repeats, min_batches=1, min_seconds=0.0)
    rows = run_jobs(jobs, cold, target, progress=progress, title="cpu-vs-gpu")
    for row in rows:
        if row.images_per_s:
            row.extra["seconds"] = row.params["images"] / row.images_per_s
    report = suite_report(
        "cpu-vs-gpu",
        "CPU against GPU augmentation: N images from a cold start (build + workers included)",
        inputs,
        rows,
        reference="DataLoader+PIL cpu",
        reference_match=("images",),
        columns=("seconds",),
    )
    report.notes.append(f"each row: median of {repeats} cold runs; seconds for N = images / (images/s)")
    return report


def workers_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    """The ``DataLoader`` + PIL baseline over ``num_workers`` (at the batch size) and batch sizes (at the cores)."""
    cores, b, n = inputs.cores, inputs.batch_size, inputs.num_samples
    worker_counts = sorted({0, cores}) if quick else sorted({0, 1, 2, max(1, cores // 2), cores, 2 * cores})
    batch_sizes = sorted({max(1, b // 2), b}) if quick else sorted({s for s in (16, 32, 64, 128, 256) if s <= n} | {b})
    settings = [(w, b) for w in worker_counts] + [(cores, s) for s in batch_sizes if s != b]
    jobs = [
        dataloader_job(
            BASELINE,
            store_dataset(inputs, lambda: pil_transform(inputs)),
            inputs,
            target,
            "DataLoader + PIL over the shards",
            num_workers=w,
            batch_size=s,
        )
        for w, s in settings
    ]
    return suite_report(
        "workers",
        "DataLoader num_workers and batch size sweeps (PIL over the shards)",
        inputs,
        run_jobs(jobs, plan, target, progress=progress, title="workers"),
        reference=BASELINE,
        reference_label=f"{BASELINE} [num_workers=0 batch_size={b}]",
    )


def formats_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    """The same images as files, LMDB, HDF5 and TFRecord: raw reads, DALI, and the DataLoader baseline."""
    import torch

    from dali_pipes.bench.formats import equal_content
    from dali_pipes.bench.streams import file_read_stream, store_read_stream

    # Enough images for steady windows, few enough to copy four times into a temporary folder.
    limit = max(inputs.batch_size * 4, 64) if quick else 1000
    device = "gpu" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="dali-pipes-formats-") as tmp:
        copies = equal_content(inputs.dataset, Path(tmp), limit=limit, workers=inputs.cores, progress=progress)
        warm_page_cache(p for d in copies.datasets.values() for p in d.iterdir() if p.is_file())
        warm_page_cache(path for path, _ in copies.files)
        b = inputs.batch_size
        files = lambda: copies.files  # noqa: E731 - a factory, as the row helpers take
        jobs = [
            Job(
                "files",
                functools.partial(file_read_stream, copies.files, batch_size=b),
                "read the encoded bytes only, one process",
                {"reader": "read-only"},
            ),
            anchor_job("files", inputs, device, target, files=files, reader=f"dali {device}"),
            dataloader_job(
                "files",
                file_dataset(files, lambda: pil_transform(inputs)),
                inputs,
                target,
                "DataLoader + PIL",
                reader="DataLoader+PIL",
            ),
        ]
        for fmt, dataset in copies.datasets.items():
            jobs += [
                Job(
                    fmt,
                    functools.partial(store_read_stream, dataset, batch_size=b),
                    "read the encoded bytes only, one process",
                    {"reader": "read-only"},
                ),
                dali_job(fmt, inputs, device, target, dataset=dataset, reader=f"dali {device}"),
                dataloader_job(
                    fmt,
                    store_dataset(inputs, lambda: pil_transform(inputs), dataset),
                    inputs,
                    target,
                    "DataLoader + PIL",
                    reader="DataLoader+PIL",
                ),
            ]
        for job in jobs:  # the table groups by reader; the loader settings are in the context
            job.params = {"reader": job.params["reader"]}
        rows = run_jobs(jobs, plan, target, progress=progress, title="formats")
        size = copies.bytes
    report = suite_report(
        "formats",
        f"storage formats at equal content ({copies.count} images, {size / 1e6:.1f} MB)",
        inputs,
        rows,
        reference="files",
        reference_match=("reader",),
    )
    report.context["formats_images"] = copies.count
    report.notes.append("files through DALI: fn.readers.file (the dali-pipes loader reads shards only)")
    return report


def stages_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    """The loader with the first k steps of the training graph, for every k, on the GPU and the CPU."""

    from dali_pipes.bench.stages import GraphPrefix, stage_names, step_costs, step_differences

    if not hasattr(inputs.spec, "image_stages"):
        raise ValueError(f"the stages suite needs a spec with image_stages(); {type(inputs.spec).__name__} has none")
    names = stage_names(inputs.spec)
    jobs = []
    for device in ("gpu", "cpu"):
        for steps, name in enumerate(names):
            job = dali_job(name, dataclasses.replace(inputs, spec=GraphPrefix(inputs.spec, steps)), device, target)
            job.params["device"] = device  # the table's and the JSON's way to tell the two devices apart
            jobs.append(job)
    rows = run_jobs(jobs, plan, target, progress=progress, title="bench stages")
    for device in ("gpu", "cpu"):
        mine = [row for row in rows if row.params.get("device") == device]
        for row, cost in zip(mine, step_costs([row.images_per_s for row in mine])):
            if cost is not None:
                row.extra["ms_per_image_added"] = round(cost, 3)
        cpu = [row.timing.cpu_seconds_per_1k if row.timing else None for row in mine]
        for row, cost in zip(mine, step_differences(cpu)):
            if cost is not None:
                row.extra["cpu_ms_added"] = round(cost, 3)
    report = suite_report(
        "stages",
        "what each step of the training graph costs: the loader with its first k steps",
        inputs,
        rows,
        reference=names[-1],
        reference_match=("device",),
        reference_label="whole graph",
        columns=("ms_per_image_added", "cpu_ms_added"),
    )
    report.notes.append(
        "ms_per_image_added: wall time per image this row adds to the row above it (same device). "
        "Rows before the last hand out 1x1 crops; the last also pays for copying whole images out. "
        "Work that overlaps the slowest step (Python reads, DALI threads, the GPU) shows as about 0, "
        "or below 0 within the spread: these are marginal costs, not each step's time alone. "
        "cpu_ms_added: the same in CPU milliseconds of the whole process tree (every core, workers included): "
        "what the step costs the cores, which a change of the machine's load moves far less"
    )
    return report


def _storage_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    from dali_pipes.bench.storage import storage_suite

    return storage_suite(inputs, plan, target, quick, progress)


def _recipe_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    from dali_pipes.bench.recipe import recipe_suite

    return recipe_suite(inputs, plan, target, quick, progress)


def _feed_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    from dali_pipes.bench.feed import feed_suite

    return feed_suite(inputs, plan, target, quick, progress)


def _gpu_decoder_suite(
    inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool
) -> BenchReport:
    from dali_pipes.bench.gpu_decoder import gpu_decoder_suite

    return gpu_decoder_suite(inputs, plan, target, quick, progress)


def _masks_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    from dali_pipes.bench.masks import masks_suite

    return masks_suite(inputs, plan, target, quick, progress)


def _train_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    from dali_pipes.bench.train import train_suite

    return train_suite(inputs, plan, target, quick, progress)


_SUITES: dict[str, Suite] = {
    "main": main_suite,
    "feed": _feed_suite,
    "gpu-decoder": _gpu_decoder_suite,
    "albumentations": albumentations_suite,
    "cpu-vs-gpu": cpu_vs_gpu_suite,
    "workers": workers_suite,
    "formats": formats_suite,
    "stages": stages_suite,
    "storage": _storage_suite,
    "recipe": _recipe_suite,
    "masks": _masks_suite,
    "train": _train_suite,
}
