"""The ``DataLoader`` + PIL baseline over its settings (``dali-pipes bench DATASET --suite workers``).

``num_workers`` from 0 to twice the cores at the run's batch size, then batch
sizes from 16 to 256 (those the dataset fills) with a worker per core; ``x ref``
is each row over the baseline in one process at the run's batch size.
"""

from __future__ import annotations

from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.streams import dataloader_job, store_dataset
from dali_pipes.bench.suites import SuiteRun
from dali_pipes.bench.suites.main import BASELINE


def run(bench: SuiteRun) -> BenchReport:
    """The ``DataLoader`` + PIL baseline over ``num_workers`` (at the batch size) and batch sizes (at the cores)."""
    inputs, target = bench.inputs, bench.target
    cores, b, n = inputs.cores, inputs.batch_size, inputs.num_samples
    worker_counts = sorted({0, cores}) if bench.quick else sorted({0, 1, 2, max(1, cores // 2), cores, 2 * cores})
    batch_sizes = (
        sorted({max(1, b // 2), b}) if bench.quick else sorted({s for s in (16, 32, 64, 128, 256) if s <= n} | {b})
    )
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
    return bench.measure(title, jobs, reference=BASELINE, reference_label=label)
