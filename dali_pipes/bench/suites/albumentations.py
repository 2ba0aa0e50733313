"""Augmentation libraries in a ``DataLoader`` over the shards (``dali-pipes bench DATASET --suite albumentations``).

Albumentations (OpenCV decode) against torchvision-style PIL transforms and
torchvision itself, the same augmentation in the same ``DataLoader``, each in one
process (``num_workers=0``) and with a worker per core; ``x ref`` is each row over
the PIL row with the same ``num_workers``.
"""

from __future__ import annotations

from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.streams import dataloader_job, store_dataset
from dali_pipes.bench.suites import SuiteRun

REFERENCE = "PIL (torchvision-style)"


def run(bench: SuiteRun) -> BenchReport:
    """Albumentations against torchvision-style PIL transforms (and torchvision), in one process and on every core."""
    from dali_pipes.bench.backends import AlbumentationsTrainTransform, TorchvisionTrainTransform

    inputs, target = bench.inputs, bench.target
    spec = inputs.spec
    backends = [
        (REFERENCE, None, "PIL decode + PIL/numpy transforms"),
        ("torchvision", lambda: TorchvisionTrainTransform(spec), "PIL decode + torchvision transforms"),
        ("Albumentations", lambda: AlbumentationsTrainTransform(spec), "OpenCV decode + Albumentations transforms"),
    ]
    jobs = [
        dataloader_job(name, store_dataset(inputs, make), inputs, target, description, num_workers=workers)
        for workers in sorted({0, inputs.cores})
        for name, make, description in backends
    ]
    title = "augmentation libraries in a DataLoader over the shards"
    return bench.measure(
        title,
        jobs,
        reference=REFERENCE,
        reference_match=("num_workers",),
    )
