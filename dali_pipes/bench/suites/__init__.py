"""The benchmark suites of ``dali-pipes bench DATASET --suite NAME``: one module each, named as the suite.

Every suite declares its rows (:class:`~dali_pipes.bench.runner.Job`, mostly made by
:mod:`dali_pipes.bench.streams`) on the same shards, augmentation, batch and cores,
measures them side by side (:meth:`SuiteRun.measure`) and returns a
:class:`~dali_pipes.bench.report.BenchReport`:

- ``main``: every way to feed the same training augmentation (this package's loader,
  the ``DataLoader`` baselines, DALI's ``fn.readers.file``, the decode-only ceiling);
- ``feed``: the feed alone, this package's loader against ``fn.readers.file``, nothing decoded;
- ``gpu-decoder``: the GPU decoder split and the feed behind it, against plain DALI;
- ``albumentations``: Albumentations against torchvision-style PIL transforms (and torchvision);
- ``cpu-vs-gpu``: augmentation on the CPU and the GPU for growing image counts, start-up included;
- ``workers``: the ``DataLoader`` baseline over ``num_workers`` and batch sizes;
- ``formats``: the same images as files, LMDB, HDF5 and TFRecord;
- ``stages``: the loader with growing prefixes of the training graph, what each step adds;
- ``storage``: epochs 1 and 2 where the dataset is, staged in ``/dev/shm``, ``cache="ram"``; S3 staging;
- ``recipe``: an epoch at 160 against 224 px, plain and with RandomErasing and MixUp/CutMix;
- ``masks``: segmentation pipelines against the same pipeline without their masks;
- ``train``: a real model's training rate fed by each loader, against the model's own.

(``--suite scale``, conversion and loading at growing sample counts, has rows of
its own kind: :mod:`dali_pipes.bench.scale`.) A suite's module is imported only
when it runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dali_pipes.bench.inputs import BenchInputs, bench_inputs
from dali_pipes.bench.interleave import run_jobs
from dali_pipes.bench.report import BenchReport, suite_report
from dali_pipes.bench.runner import Job, Row, Target, TimingPlan, warm_page_cache

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
    module = importlib.import_module(f"{__name__}.{suite.replace('-', '_')}")
    report: BenchReport = module.run(SuiteRun(suite, inputs, plan, target, quick, progress))
    report.context.update({"target_device": target.device, "quick": quick, "timing": _timing(plan)})
    if suite != "storage":  # which drops the page cache before each epoch 1 on purpose
        report.notes.append("files and shards were read once before timing: every row reads from the page cache alike")
    if target.is_cuda:
        report.notes.append("every row delivers its batches to the GPU: host-to-device copies are inside the timing")
    if quick:
        report.notes.append("--quick: tiny timing windows; the figures only show that every row runs")
    return report


def _timing(plan: TimingPlan) -> dict[str, Any]:
    return {
        "warmup_batches": plan.warmup_batches,
        "warmup_seconds": plan.warmup_seconds,
        "repeats": plan.repeats,
        "min_batches_per_window": plan.min_batches,
        "min_seconds_per_window": plan.min_seconds,
    }


@dataclass(frozen=True)
class SuiteRun:
    """One run of a suite: its name, the inputs its rows share, how each row is timed and where batches go.

    A suite's module is a function ``run(bench: SuiteRun) -> BenchReport`` that declares its rows and measures
    them with :meth:`measure`.
    """

    name: str
    inputs: BenchInputs
    plan: TimingPlan
    target: Target
    quick: bool = False
    progress: bool = True

    def rows(self, jobs: Sequence[Job], plan: TimingPlan | None = None, title: str | None = None) -> list[Row]:
        """``jobs`` measured side by side with ``plan`` (default: the run's), under a progress bar called ``title``."""
        title = title or ("bench" if self.name == "main" else f"bench {self.name}")
        return run_jobs(jobs, plan or self.plan, self.target, progress=self.progress, title=title)

    def measure(self, title: str, jobs: Sequence[Job], *, plan: TimingPlan | None = None, **report: Any) -> BenchReport:
        """:meth:`rows` reported as this suite's table called ``title``; ``report`` takes
        :func:`~dali_pipes.bench.report.suite_report`'s options (``context``, ``reference``, ``columns``...)."""
        return suite_report(self.name, title, self.inputs, self.rows(jobs, plan), **report)
