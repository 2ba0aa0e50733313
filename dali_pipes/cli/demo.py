"""``dali-pipes demo``: the main job end to end on a built-in synthetic dataset.

Makes an ImageNet-like image folder (or takes the user's), converts it to LMDB
shards, runs the training pipeline through :class:`~dali_pipes.DALILoader` on the
GPU when there is one (the CPU otherwise), measures its throughput against a
``DataLoader`` with PIL transforms on the same shards and cores, and writes a
grid of augmented samples as a PNG.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dali_pipes.bench.runner import Timing
from dali_pipes.cli.show import write_grid  # the grid moved to `dali-pipes show`; kept importable from here
from dali_pipes.cli.words import counted

if TYPE_CHECKING:
    from dali_pipes.bench.runner import Job, Target

log = logging.getLogger(__name__)

#: Each row is timed in this many windows after its warm-up; the figure is their median, the spread half their range.
WINDOWS = 3


def default_workdir() -> Path:
    """``$XDG_CACHE_HOME/dali-pipes/demo`` (``~/.cache/...``): reused by every run, so runs do not pile up copies."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "dali-pipes" / "demo"


@dataclass
class DemoReport:
    """Where the demo's files went and what it measured (each rate a median of timed windows, with its spread)."""

    workdir: Path
    images: Path
    dataset: Path
    grid: Path
    device: str
    cores: int
    batch_size: int
    dali: Timing
    baseline: Timing

    @property
    def dali_images_per_s(self) -> float:
        return self.dali.median

    @property
    def baseline_images_per_s(self) -> float:
        return self.baseline.median

    @property
    def speedup(self) -> float:
        return self.dali.median / self.baseline.median if self.baseline.median else float("nan")


def run_demo(
    data: str | os.PathLike | None = None,
    *,
    workdir: str | os.PathLike | None = None,
    num_images: int = 512,
    seconds: float = 2.0,
    batch_size: int = 32,
    device: str = "auto",
) -> DemoReport:
    """Run the demo; ``data`` is an image folder (default: a synthetic one made in ``workdir``).

    Each loader warms up (at least 3 batches and ``seconds``), then the two take turns at :data:`WINDOWS`
    windows of at least ``seconds`` each (side by side: a change of the machine's load hits both alike). ``workdir`` defaults to :func:`default_workdir`, whose images and shards a later run
    reuses (the conversion finds its finished job).
    """
    from dali_pipes.bench.interleave import run_jobs
    from dali_pipes.bench.runner import Target, TimingPlan
    from dali_pipes.loading.config import RunOptions
    from dali_pipes.loading.loader import DALILoader
    from dali_pipes.pipelines import ClassificationTrain

    workdir = Path(workdir) if workdir is not None else default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    images, dataset, grid_path = _converted(data, workdir, num_images, cores)
    plan = TimingPlan(warmup_batches=3, repeats=WINDOWS, min_batches=2, min_seconds=seconds, warmup_seconds=seconds)
    target = Target()
    spec = ClassificationTrain(size=224)
    with DALILoader(dataset, spec, batch_size=batch_size, seed=0, run=RunOptions(device=device)) as loader:
        first_batch = next(iter(loader))
        grid = write_grid(first_batch["image"], first_batch["label"], grid_path, classes=loader.store.manifest.classes)
        used_device = loader.device
    log.info(
        "DALI training pipeline on %s against DataLoader(num_workers=%d) with PIL, batch %d: "
        "%d windows of %.1f s each, taken in turn",
        used_device,
        cores,
        batch_size,
        WINDOWS,
        seconds,
    )
    jobs = _jobs(dataset, spec, batch_size, used_device, cores, target)
    dali, base = run_jobs(jobs, plan, target, progress=False)
    for row in (dali, base):
        if row.timing is None:
            raise RuntimeError(f"demo: the {row.name} row did not run: {row.error or row.skipped}")
    return DemoReport(workdir, images, dataset, grid, used_device, cores, batch_size, dali.timing, base.timing)


def _jobs(dataset: Path, spec: Any, batch_size: int, device: str, cores: int, target: Target) -> list[Job]:
    """The two rows the demo times in turn: DALILoader with ``spec`` on ``device``, then DataLoader (PIL, ``cores`` workers).

    Both deliver to the same ``target``, so the interleaved windows measure them alike.
    """
    from dali_pipes.bench.baselines import StoreImageDataset
    from dali_pipes.bench.runner import Job
    from dali_pipes.bench.streams import dali_in_flight, dali_loader_stream, dataloader_stream

    return [
        Job(
            "DALILoader",
            functools.partial(dali_loader_stream, dataset, spec, batch_size=batch_size, device=device, target=target),
            in_flight=dali_in_flight({}),
            runs_dali=True,
        ),
        Job(
            "DataLoader",
            lambda: dataloader_stream(
                StoreImageDataset(dataset), batch_size=batch_size, num_workers=cores, target=target
            ),
            in_flight=2 * cores + 1,
        ),
    ]


def _converted(data: str | os.PathLike | None, workdir: Path, num_images: int, cores: int) -> tuple[Path, Path, Path]:
    """The image folder (``data``, or synthetic images made once in ``workdir``), its LMDB shards and the grid's path.

    Each data source has its own shards and grid in ``workdir`` (``-512`` for the
    built-in images, a hash of the folder's path for ``--data``): a run on your
    photos leaves the built-in demo's grid alone, and the other way round.
    """
    from converters.runner import convert
    from converters.sources import ImageFolderSource
    from converters.synth import make_imagefolder

    if data is None:
        tag = str(num_images)
        images = workdir / f"images-{tag}"
        if (images / ".complete").exists():
            log.info("reusing the %s in %s", counted(num_images, "synthetic image"), images)
        else:
            log.info("making %s in %s", counted(num_images, "synthetic ImageNet-like image"), images)
            shutil.rmtree(images, ignore_errors=True)
            make_imagefolder(images, num_images, size=(500, 375), classes=10)
            (images / ".complete").touch()  # hidden: not an input
    else:
        images = Path(data).absolute()
        tag = hashlib.sha1(str(images).encode()).hexdigest()[:12]
    dataset = workdir / f"shards-{tag}"
    # A finished conversion is found by the converter itself; before it runs, a manifest says one may be there.
    if not (dataset / "index.json").exists():
        log.info("converting %s to LMDB shards in %s", images, dataset)
    converted = convert(ImageFolderSource(images), dataset, format="lmdb", workers=cores)
    if converted.already_complete:
        log.info("reusing the shards in %s (converted from %s by an earlier run)", dataset, images)
    if converted.errors:
        log.warning("left out %d input(s) of %s, listed in %s", len(converted.errors), images, dataset / "errors.jsonl")
    return images, dataset, workdir / f"augmented-{tag}.png"


def _cost(timing: Timing) -> str:
    cost = timing.cpu_seconds_per_1k
    return f", {cost:.2f} CPU s/1k images" if cost is not None else ""


def format_report(report: DemoReport) -> str:
    """What the demo prints for a person."""
    return "\n".join(
        [
            f"images     {report.images}",
            f"shards     {report.dataset}   (dali-pipes inspect {report.dataset})",
            f"grid       {report.grid}   (augmented training samples with their labels)",
            f"machine    {counted(report.cores, 'core')}, DALI on {report.device}, batch {report.batch_size}",
            f"DALILoader {report.dali.median:8.1f} images/s ±{100 * report.dali.spread:.0f}%{_cost(report.dali)}  "
            "(random-resized crop 224, flip, colour jitter, normalise)",
            f"DataLoader {report.baseline.median:8.1f} images/s ±{100 * report.baseline.spread:.0f}%"
            f"{_cost(report.baseline)}  (PIL, the same augmentation, num_workers={report.cores})",
            f"speed-up   {report.speedup:.2f}x  (medians of {WINDOWS} timed windows each, taken in turn after a warm-up; "
            "± is half their range)",
        ]
    )
