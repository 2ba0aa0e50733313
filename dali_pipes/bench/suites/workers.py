"""The ``DataLoader`` + PIL baseline over its settings (``dali-pipes bench DATASET --suite workers``).

``num_workers`` from 0 to twice the cores at the run's batch size, then batch
sizes from 16 to 256 (those the dataset fills) with a worker per core; ``x ref``
is each row over the baseline in one process at the run's batch size.
"""

from __future__ import annotations

from dali_pipes.bench.inputs import BenchInputs
from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.runner import Target, TimingPlan
from dali_pipes.bench.streams import dataloader_job, store_dataset
from dali_pipes.bench.suites import measure
from dali_pipes.bench.suites.main import BASELINE


def run(inputs: BenchInputs, plan: TimingPlan, target: Target, quick: bool, progress: bool) -> BenchReport:
    """The ``DataLoader`` + PIL baseline over ``num_workers`` (at the batch size) and batch sizes (at the cores)."""
    cores, b, n = inputs.cores, inputs.batch_size, inputs.num_samples
    worker_counts = sorted({0, cores}) if quick else sorted({0, 1, 2, max(1, cores // 2), cores, 2 * cores})
    batch_sizes = sorted({max(1, b // 2), b}) if quick else sorted({s for s in (16, 32, 64, 128, 256) if s <= n} | {b})
    settings = [(w, b) for w in worker_counts] + [(cores, s) for s in batch_sizes if s != b]
    dataset = store_dataset(inputs)
    jobs = [
        dataloader_job(
            BASELINE, dataset, inputs, target, "DataLoader + PIL over the shards", num_workers=w, batch_size=s
        )
        for w, s in settings
    ]
    title = "DataLoader num_workers and batch size sweeps (PIL over the shards)"
    label = f"{BASELINE} [num_workers=0 batch_size={b}]"
    return measure("workers", title, inputs, jobs, plan, target, progress, reference=BASELINE, reference_label=label)
