"""``dali-pipes demo``: the main job end to end on a built-in synthetic dataset.

Makes an ImageNet-like image folder (or takes the user's), converts it to LMDB
shards, runs the training pipeline through :class:`~dali_pipes.DALILoader` on the
GPU when there is one (the CPU otherwise), measures its throughput against a
``DataLoader`` with PIL transforms on the same shards and cores, and writes a
grid of augmented samples as a PNG.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dali_pipes.cli.show import write_grid  # the grid moved to `dali-pipes show`; kept importable from here

log = logging.getLogger(__name__)

#: Batches left out of every timing: pipeline start-up and worker spawn are not throughput.
WARMUP_BATCHES = 3


@dataclass
class DemoReport:
    """Where the demo's files went and what it measured."""

    workdir: Path
    images: Path
    dataset: Path
    grid: Path
    device: str
    cores: int
    batch_size: int
    dali_images_per_s: float
    baseline_images_per_s: float

    @property
    def speedup(self) -> float:
        return self.dali_images_per_s / self.baseline_images_per_s if self.baseline_images_per_s else float("nan")


def run_demo(
    data: str | os.PathLike | None = None,
    *,
    workdir: str | os.PathLike | None = None,
    num_images: int = 512,
    batches: int = 200,
    baseline_batches: int = 40,
    batch_size: int = 32,
    device: str = "auto",
) -> DemoReport:
    """Run the demo; ``data`` is an image folder (default: a synthetic one made in ``workdir``)."""
    from converters.runner import convert
    from converters.sources import ImageFolderSource
    from converters.synth import make_imagefolder
    from dali_pipes.bench.baselines import StoreImageDataset, pil_dataloader
    from dali_pipes.bench.runner import cycle
    from dali_pipes.loading.loader import DALILoader
    from dali_pipes.pipelines import ClassificationTrain

    workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="dali-pipes-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    if data is None:
        images = workdir / "images"
        if not images.exists():
            log.info("making %d synthetic ImageNet-like images in %s", num_images, images)
            make_imagefolder(images, num_images, size=(500, 375), classes=10)
    else:
        images = Path(data)
    dataset = workdir / "shards"
    log.info("converting %s to LMDB shards in %s", images, dataset)
    converted = convert(ImageFolderSource(images), dataset, format="lmdb", workers=cores)
    if converted.errors:
        log.warning("left out %d input(s) of %s, listed in %s", len(converted.errors), images, dataset / "errors.jsonl")

    spec = ClassificationTrain(size=224)
    loader = DALILoader(dataset, spec, batch_size=batch_size, device=device, seed=0)
    log.info("DALI training pipeline on %s: %d batches of %d", loader.device, batches, batch_size)
    first_batch, dali_rate = _throughput(cycle(loader), batches, key="image")

    baseline = pil_dataloader(StoreImageDataset(dataset), batch_size=batch_size, num_workers=cores)
    log.info("baseline DataLoader(num_workers=%d) with PIL: %d batches", cores, baseline_batches)
    _, baseline_rate = _throughput(cycle(baseline), baseline_batches, key=0)

    grid = write_grid(
        first_batch["image"], first_batch["label"], workdir / "augmented.png", classes=loader.store.manifest.classes
    )
    return DemoReport(workdir, images, dataset, grid, loader.device, cores, batch_size, dali_rate, baseline_rate)


def _throughput(batches: Iterable, count: int, *, key) -> tuple[object, float]:
    """Images per second over ``count`` batches after the warm-up; also the first batch."""
    iterator = iter(batches)
    first = next(iterator)
    for _ in range(WARMUP_BATCHES - 1):
        next(iterator)
    images = 0
    start = time.perf_counter()
    for _ in range(count):
        batch = next(iterator)
        images += len(batch[key])
    return first, images / (time.perf_counter() - start)


def format_report(report: DemoReport) -> str:
    """What the demo prints for a person."""
    return "\n".join(
        [
            f"images     {report.images}",
            f"shards     {report.dataset}   (dali-pipes inspect {report.dataset})",
            f"grid       {report.grid}   (augmented training samples with their labels)",
            f"machine    {report.cores} cores, DALI on {report.device}, batch {report.batch_size}",
            f"DALILoader {report.dali_images_per_s:8.1f} images/s  (random-resized crop 224, flip, colour jitter, normalise)",
            f"DataLoader {report.baseline_images_per_s:8.1f} images/s  (PIL, the same augmentation, num_workers={report.cores})",
            f"speed-up   {report.speedup:.2f}x",
        ]
    )
