"""The main benchmark (``dali-pipes bench DATASET``): every way to feed the same training augmentation.

This package's loader on the GPU and the CPU (at both resize qualities), the
``DataLoader`` baselines (PIL over the shards and over the original files,
torchvision, Albumentations at both resize qualities), torchvision's batched GPU
decode, DALI's ``fn.readers.file`` over the files (the anchor: the same graph,
fed by DALI's own reader), and the decode-only ceiling of the same JPEGs; all
measured side by side, each with its CPU cost.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from dali_pipes.bench.inputs import BenchInputs
from dali_pipes.bench.interleave import run_jobs
from dali_pipes.bench.jobs import (
    anchor_job,
    dali_job,
    dataloader_job,
    file_dataset,
    original_files,
    pil_transform,
    store_dataset,
    suite_report,
)
from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.runner import Job, Target, TimingPlan

#: The row every other is compared with in the main table: what a user has today.
BASELINE = "DataLoader+PIL shards"
#: Plain DALI with every JPEG on the GPU's hardware decoder (DALI's default sends 0.65 of them).
HW_ANCHOR = "DALI readers.file gpu hw_decoder_load=1"


def main_suite(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    """Every way to feed the same training augmentation, side by side (see the module docstring)."""
    from dali_pipes.bench.backends import TorchvisionTrainTransform
    from dali_pipes.bench.decode import decode_stream, reducible_fraction

    spec, cores = inputs.spec, inputs.cores
    files = functools.partial(original_files, inputs)
    decode = functools.partial(decode_stream, str(inputs.dataset), workers=cores, chunk=inputs.batch_size, spec=spec)
    # The same comparison at the other resize quality: OpenCV (Albumentations) does not
    # antialias by default, DALI, torchvision and PIL do; both ways, each side alike.
    other = dataclasses.replace(inputs, spec=dataclasses.replace(spec, antialias=not spec.antialias))
    jobs = [
        dali_job("dali-pipes gpu", inputs, "gpu", target),
        dali_job("dali-pipes cpu", inputs, "cpu", target, antialias=spec.antialias),
        dali_job("dali-pipes cpu", other, "cpu", target, antialias=other.spec.antialias),
        dataloader_job(
            BASELINE,
            store_dataset(inputs, lambda: pil_transform(inputs)),
            inputs,
            target,
            "DataLoader, PIL decode + torchvision-style PIL/numpy transforms, over the shards",
        ),
        dataloader_job(
            "DataLoader+PIL files",
            file_dataset(files, lambda: pil_transform(inputs)),
            inputs,
            target,
            "the same, over the original image files",
        ),
        dataloader_job(
            "DataLoader+torchvision shards",
            store_dataset(inputs, lambda: TorchvisionTrainTransform(spec)),
            inputs,
            target,
            "DataLoader, PIL decode + torchvision transforms, over the shards",
        ),
        *(_albumentations_job(these, target) for these in (inputs, other)),
        _torchvision_gpu_job(inputs, target),
        anchor_job("DALI readers.file gpu", inputs, "gpu", target),
        anchor_job(HW_ANCHOR, inputs.with_decoder_load(1.0), "gpu", target, hw_decoder_load=1.0),
        anchor_job("DALI readers.file cpu", inputs, "cpu", target),
        Job(
            "decode-ceiling (full)",
            functools.partial(decode, mode="full"),
            "PIL decode only of the same JPEGs, one process per core",
            {"processes": cores},
            in_flight=2 * cores,
        ),
        Job(
            "decode-ceiling (reduced)",
            functools.partial(decode, mode="reduced"),
            "PIL decode only, with draft() to the smallest DCT scale the crop allows",
            {"processes": cores},
            in_flight=2 * cores,
        ),
    ]
    report = suite_report(
        "main",
        "input pipelines: random-resized crop 224, flip, colour jitter, normalise",
        inputs,
        run_jobs(inputs.selected(jobs), plan, target, progress=progress, title="bench"),
        reference=BASELINE,
        columns=("gpu_mb",) if target.is_cuda else (),
    )
    report.summary = _main_summary(report)
    if target.is_cuda:
        report.notes.append(
            "gpu_mb: GPU memory (MB, from the driver) the row took while it opened and warmed up; "
            "every row stays open while the others run, so the first DALI row opened also holds DALI's and "
            "nvJPEG's one-time allocations for the process (on an H200 the same anchor graph took 851 MB opened "
            "first and 579 MB opened last)"
        )
    reduced = report.row("decode-ceiling (reduced)")
    if reduced is not None and reduced.timing is not None:
        fraction = reducible_fraction(str(inputs.dataset), spec)
        reduced.extra["reducible_fraction"] = fraction
        report.notes.append(
            f"decode-ceiling (reduced): {fraction:.0%} of the crops allow a reduced-scale decode on these images"
        )
    return report


def _torchvision_gpu_job(inputs: BenchInputs, target: Target) -> Job:
    """The row of torchvision's batched GPU JPEG decode and ``transforms.v2`` on the GPU (no DALI)."""
    from dali_pipes.bench.torchvision_gpu import torchvision_gpu_stream

    factory = functools.partial(
        torchvision_gpu_stream,
        inputs.dataset,
        inputs.spec,
        batch_size=inputs.batch_size,
        num_workers=inputs.cores,
        target=target,
    )
    return Job(
        "torchvision gpu",
        factory,
        "DataLoader reading the encoded bytes; torchvision.io.decode_jpeg of the batch on the GPU, then "
        "transforms.v2 crop, resize, flip and jitter one image at a time on the GPU (a few small kernels per image: "
        "that is its cost; a batched crop-and-resize, such as DALI's, avoids it)",
        {"num_workers": inputs.cores},
        in_flight=2 * inputs.cores + 1,
    )


def _albumentations_job(inputs: BenchInputs, target: Target) -> Job:
    """The Albumentations row at the resize quality of ``inputs.spec`` (its ``antialias``)."""
    from dali_pipes.bench.backends import AlbumentationsTrainTransform

    return dataloader_job(
        "DataLoader+Albumentations shards",
        store_dataset(inputs, functools.partial(AlbumentationsTrainTransform, inputs.spec)),
        inputs,
        target,
        "DataLoader, OpenCV decode + Albumentations transforms, over the shards "
        "(resize: INTER_AREA with antialias, else INTER_LINEAR)",
        antialias=inputs.spec.antialias,
    )


def _main_summary(report: BenchReport) -> dict[str, Any]:
    """The issue's targets, as ratios of the measured rows (``None`` where a row was not measured)."""

    def ratio(a: str, b: str, **params: Any) -> float | None:
        ra, rb = report.row(a, **params), report.row(b, **params)
        if ra is None or rb is None or ra.images_per_s is None or rb.images_per_s is None:
            return None
        return ra.images_per_s / rb.images_per_s

    summary: dict[str, Any] = {
        "dali-pipes gpu / DALI readers.file gpu": {
            "value": ratio("dali-pipes gpu", "DALI readers.file gpu"),
            "unit": "x",
            "target": "at least 1.0x: DALI's own reader over the files, same graph, same GPU, each with its defaults",
        },
        f"dali-pipes gpu / {HW_ANCHOR}": {
            "value": ratio("dali-pipes gpu", HW_ANCHOR),
            "unit": "x",
            "target": "at least 1.0x: the same, DALI sending every JPEG to the hardware decoder as well",
        },
        "dali-pipes cpu / DALI readers.file cpu": {
            "value": ratio("dali-pipes cpu", "DALI readers.file cpu"),
            "unit": "x",
            "target": "at least 1.0x: feeding from the shards costs nothing visible",
        },
        **{
            f"dali-pipes cpu / DataLoader+Albumentations shards, antialias={aa} both": {
                "value": ratio("dali-pipes cpu", "DataLoader+Albumentations shards", antialias=aa),
                "unit": "x",
                "target": "at least 1.0x at equal quality",
            }
            for aa in (True, False)
        },
        "dali-pipes cpu / DataLoader+PIL shards": {
            "value": ratio("dali-pipes cpu", BASELINE),
            "unit": "x",
            "target": "at least 1.5x, aiming at 2.5x",
        },
        "dali-pipes cpu / decode-ceiling (full)": {
            "value": ratio("dali-pipes cpu", "decode-ceiling (full)"),
            "unit": "x",
            "target": "aiming at 1.0x",
        },
    }
    gpu = report.row("dali-pipes gpu")
    if gpu is not None and gpu.images_per_s is not None:
        summary["dali-pipes gpu"] = {
            "value": gpu.images_per_s,
            "unit": " images/s",
            "target": "one H200, 16 cores, float16: at least 22,000, aiming at 25,000",
        }
    return summary
