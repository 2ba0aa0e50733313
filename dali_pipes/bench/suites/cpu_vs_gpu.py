"""Augmentation on the CPU and on the GPU for growing image counts (``dali-pipes bench DATASET --suite cpu-vs-gpu``).

What a short job sees: each row times N images from a cold start, building the
pipeline and starting its workers included (they are most of the time for few
images), for N of 1, 4, 16 and 64 batches: the ``DataLoader`` + PIL baseline and
this package's loader on the CPU and the GPU. The ``seconds`` column is the time
of N images.
"""

from __future__ import annotations

from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.runner import TimingPlan
from dali_pipes.bench.streams import dali_job, dataloader_job, store_dataset
from dali_pipes.bench.suites import SuiteRun

REFERENCE = "DataLoader+PIL cpu"


def run(bench: SuiteRun) -> BenchReport:
    """Augmentation on the CPU and on the GPU for growing image counts, start-up included."""
    inputs, target = bench.inputs, bench.target
    b = inputs.batch_size
    counts = [b, 4 * b] if bench.quick else [b, 4 * b, 16 * b, 64 * b]
    repeats = min(bench.plan.repeats, 3)
    jobs = []
    for count in counts:
        for job in (
            dataloader_job(
                REFERENCE,
                store_dataset(inputs),
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
    title = "CPU against GPU augmentation: N images from a cold start (build + workers included)"
    report = bench.measure(
        title,
        jobs,
        plan=cold,
        reference=REFERENCE,
        reference_match=("images",),
        columns=("seconds",),
    )
    for row in report.rows:
        if row.images_per_s:
            row.extra["seconds"] = row.params["images"] / row.images_per_s
    report.notes.append(f"each row: median of {repeats} cold runs; seconds for N = images / (images/s)")
    return report
