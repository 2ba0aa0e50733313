"""``dali-pipes bench DATASET --suite recipe``: the training recipe's cost, and what a lower resolution saves.

FFCV's fast ResNet-50 schedules train most epochs at about 160 px and end near
192 px; with this package a :class:`~dali_pipes.pipelines.ResolutionSchedule`
changes the size per epoch. This suite times the same loader at 160 and at 224
px, with the plain training graph and with the modern recipe on top
(RandomErasing, then MixUp/CutMix, label smoothing), on the GPU and the CPU; and,
on a GPU, a ResNet-50 training step at each size (bfloat16 autocast, synthetic
batch): most of what a lower resolution saves is the model's work, which falls
with the pixel count, while the loader still decodes whole JPEGs. Each row's
``epoch_s`` is the time one epoch of this dataset takes at the row's rate
(``num_samples / images_per_s``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterator

from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.runner import Job, Skipped, Target
from dali_pipes.bench.streams import per_device
from dali_pipes.bench.suites import SuiteRun

#: FFCV's low training resolution, and the usual one.
SIZES = (160, 224)
#: The reference row of each device: the usual graph at the usual size.
REFERENCE = "plain 224px"


def recipe_specs(spec: Any, num_classes: int) -> dict[str, Any]:
    """The suite's specs by row name: ``spec`` at each of :data:`SIZES`, plain and with the recipe."""
    from dali_pipes.pipelines import Mix, RandomErasing

    mix = Mix(mixup_alpha=0.8, cutmix_alpha=1.0, mode="batch", label_smoothing=0.1, num_classes=num_classes)
    erasing = RandomErasing(prob=0.25, mode="pixel")
    specs = {}
    for size in SIZES:
        specs[f"plain {size}px"] = dataclasses.replace(spec, size=size, mix=None, erasing=None)
        specs[f"recipe {size}px"] = dataclasses.replace(spec, size=size, mix=mix, erasing=erasing)
    return specs


def run(bench: SuiteRun) -> BenchReport:
    """Images/s and seconds per epoch at 160 and 224 px, plain and with MixUp/CutMix and RandomErasing."""
    inputs, target = bench.inputs, bench.target
    # Soft targets need a class count; a dataset without class names is taken as ImageNet's 1000.
    num_classes = max(2, len(inputs.manifest.classes or ())) if inputs.manifest.classes else 1000
    jobs = per_device(inputs, target, recipe_specs(inputs.spec, num_classes))
    description = "ResNet-50 training steps on one synthetic batch (bfloat16 autocast): the model's own speed"
    for size in SIZES:
        factory = functools.partial(_model_steps, size=size, batch_size=inputs.batch_size, target=target)
        jobs.append(Job(f"resnet50 step {size}px", factory, description, {"device": "gpu"}))
    report = bench.measure(
        "one epoch at 160 and 224 px, plain and with the recipe (RandomErasing, MixUp/CutMix)",
        jobs,
        reference=REFERENCE,
        reference_match=("device",),
        reference_label="plain 224px (loader rows)",
        columns=("epoch_s",),
    )
    for row in report.rows:
        if row.images_per_s:
            row.extra["epoch_s"] = round(inputs.num_samples / row.images_per_s, 2)
    report.notes.append(
        f"epoch_s: {inputs.num_samples} samples / images_per_s. Recipe: Mix(mixup_alpha=0.8, cutmix_alpha=1.0, "
        "label_smoothing=0.1, mode='batch'), RandomErasing(prob=0.25, mode='pixel'); the rest of the graph is the "
        "bench's training spec"
    )
    return report


@contextlib.contextmanager
def _model_steps(*, size: int, batch_size: int, target: Target) -> Iterator[Iterator[int]]:
    """ResNet-50 steps at ``size`` px on the GPU; skipped on a CPU, where they would take most of the run."""
    if not target.is_cuda:
        raise Skipped("ResNet-50 steps are timed on a GPU only (about 40 s per batch of 64 on a 2-core CPU)")
    from dali_pipes.bench.models import model_stream, training_model

    net, optimizer = training_model("resnet50", 1000, target.device)
    with model_stream(
        net, optimizer, batch_size=batch_size, size=size, num_classes=1000, device=target.device
    ) as steps:
        yield steps
