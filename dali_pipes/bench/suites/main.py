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
from dali_pipes.bench.report import BenchReport, figure, ratio
from dali_pipes.bench.runner import Job, Target
from dali_pipes.bench.streams import (
    anchor_job,
    dali_job,
    dataloader_in_flight,
    dataloader_job,
    file_dataset,
    store_dataset,
)
from dali_pipes.bench.suites import SuiteRun

#: The row every other is compared with in the main table: what a user has today.
BASELINE = "DataLoader+PIL shards"
#: Plain DALI with every JPEG on the GPU's hardware decoder (DALI's default sends 0.65 of them).
HW_ANCHOR = "DALI readers.file gpu hw_decoder_load=1"
#: The decode-only rows: PIL on every pixel, or at the smallest DCT scale each crop allows.
DECODE_CEILING = {
    "full": "PIL decode only of the same JPEGs, one process per core",
    "reduced": "PIL decode only, with draft() to the smallest DCT scale the crop allows",
}


def run(bench: SuiteRun) -> BenchReport:
    """Every way to feed the same training augmentation, side by side (see the module docstring)."""
    from dali_pipes.bench.decode import reducible_fraction

    inputs, target = bench.inputs, bench.target
    report = bench.measure(
        "input pipelines: random-resized crop 224, flip, colour jitter, normalise",
        inputs.selected(_jobs(inputs, target)),
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
        fraction = reducible_fraction(str(inputs.dataset), inputs.spec)
        reduced.extra["reducible_fraction"] = fraction
        report.notes.append(
            f"decode-ceiling (reduced): {fraction:.0%} of the crops allow a reduced-scale decode on these images"
        )
    return report


def _jobs(inputs: BenchInputs, target: Target) -> list[Job]:
    """The main table's rows, in its order."""
    from dali_pipes.bench.backends import TorchvisionTrainTransform
    from dali_pipes.bench.decode import decode_stream

    spec, cores = inputs.spec, inputs.cores
    decode = functools.partial(decode_stream, str(inputs.dataset), workers=cores, chunk=inputs.batch_size, spec=spec)
    # The same comparison at the other resize quality: OpenCV (Albumentations) does not
    # antialias by default, DALI, torchvision and PIL do; both ways, each side alike.
    other = dataclasses.replace(inputs, spec=dataclasses.replace(spec, antialias=not spec.antialias))
    return [
        dali_job("dali-pipes gpu", inputs, "gpu", target),
        *(
            dali_job("dali-pipes cpu", these, "cpu", target, antialias=these.spec.antialias)
            for these in (inputs, other)
        ),
        dataloader_job(
            BASELINE,
            store_dataset(inputs),
            inputs,
            target,
            "DataLoader, PIL decode + torchvision-style PIL/numpy transforms, over the shards",
        ),
        dataloader_job(
            "DataLoader+PIL files", file_dataset(inputs), inputs, target, "the same, over the original image files"
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
        *(
            Job(
                f"decode-ceiling ({mode})",
                functools.partial(decode, mode=mode),
                what,
                {"processes": cores},
                in_flight=2 * cores,
            )
            for mode, what in DECODE_CEILING.items()
        ),
    ]


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
        in_flight=dataloader_in_flight(inputs.cores),
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
    """The project's targets, as ratios of the measured rows (``None`` where a row was not measured)."""

    def over(a: str, b: str, target: str, **params: Any) -> dict[str, Any]:
        return figure(ratio(report.row(a, **params), report.row(b, **params)), target)

    summary: dict[str, Any] = {
        "dali-pipes gpu / DALI readers.file gpu": over(
            "dali-pipes gpu",
            "DALI readers.file gpu",
            "at least 1.0x: DALI's own reader over the files, same graph, same GPU, each with its defaults",
        ),
        f"dali-pipes gpu / {HW_ANCHOR}": over(
            "dali-pipes gpu",
            HW_ANCHOR,
            "at least 1.0x: the same, DALI sending every JPEG to the hardware decoder as well",
        ),
        "dali-pipes cpu / DALI readers.file cpu": over(
            "dali-pipes cpu", "DALI readers.file cpu", "at least 1.0x: feeding from the shards costs nothing visible"
        ),
        **{
            f"dali-pipes cpu / DataLoader+Albumentations shards, antialias={aa} both": over(
                "dali-pipes cpu", "DataLoader+Albumentations shards", "at least 1.0x at equal quality", antialias=aa
            )
            for aa in (True, False)
        },
        "dali-pipes cpu / DataLoader+PIL shards": over("dali-pipes cpu", BASELINE, "at least 1.5x, aiming at 2.5x"),
        "dali-pipes cpu / decode-ceiling (full)": over("dali-pipes cpu", "decode-ceiling (full)", "aiming at 1.0x"),
    }
    gpu = report.row("dali-pipes gpu")
    if gpu is not None and gpu.images_per_s is not None:
        summary["dali-pipes gpu"] = figure(
            gpu.images_per_s, "one H200, 16 cores, float16: at least 22,000, aiming at 25,000", unit=" images/s"
        )
    return summary
