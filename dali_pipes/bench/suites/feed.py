"""The feed alone: each sample read and handed to DALI, nothing decoded (``dali-pipes bench DATASET --suite feed``).

On a GPU the decoder needs the CPU threads that feed it (nvJPEG's CUDA path
decodes Huffman on the CPU), so what the feed costs the cores is taken from the
decoder. This suite measures that cost on any machine, GPU or not: both sides run
the same graph, which only takes the shapes of the encoded bytes
(:class:`~dali_pipes.bench.suites.stages.GraphPrefix` with no step), on the CPU with the
same DALI thread count and batch size:

- ``DALI readers.file feed``: DALI's C++ file reader over the original JPEG files
  (``random_shuffle=True``), as DALI's documentation shows it;
- ``dali-pipes feed``: :class:`~dali_pipes.DALILoader` over the shards with its
  defaults (exact per-rank epochs, ``is_pad``, record CRCs checked);
- ``dali-pipes feed`` read the other way: by Python worker processes where the
  default reads in the loader's process (LMDB, HDF5), in the loader's process
  where it has workers (the default where the GPU decodes, on 8 cores or more a rank).

The summary gives our rate and CPU seconds per 1,000 images against DALI's
reader: the goal is at least 1.0x its rate at no more CPU per image.
"""

from __future__ import annotations

import dataclasses

from dali_pipes.bench.report import BenchReport, figure, ratio
from dali_pipes.bench.streams import anchor_job, dali_job
from dali_pipes.bench.suites import SuiteRun
from dali_pipes.bench.suites.stages import GraphPrefix
from dali_pipes.loading.options import default_py_num_workers

#: The rows' names.
OURS, ANCHOR = "dali-pipes feed", "DALI readers.file feed"


def run(bench: SuiteRun) -> BenchReport:
    """Our feed against ``fn.readers.file``'s, read-only graphs on the CPU (see the module docstring)."""
    inputs, target = bench.inputs, bench.target
    feed = dataclasses.replace(inputs, spec=GraphPrefix(inputs.spec, 0))
    default_workers = inputs.loader_settings.get("py_num_workers", 0)
    # The other way of reading: worker processes where the default reads in the loader's thread (LMDB, HDF5), the
    # loader's thread where it has workers (another format, or a tuned file's workers).
    other = default_py_num_workers(inputs.manifest.format, False, inputs.cores) if default_workers == 0 else 0
    jobs = [
        anchor_job(ANCHOR, feed, "cpu", target),
        dali_job(OURS, feed, "cpu", target),
        dali_job(OURS, feed, "cpu", target, settings={**inputs.loader_settings, "py_num_workers": other}),
    ]
    title = "the feed alone: samples read and handed to DALI, nothing decoded (shapes of the encoded bytes)"
    report = bench.measure(title, jobs, reference=ANCHOR)
    ours, anchor = report.row(OURS, **inputs.loader_settings), report.row(ANCHOR)
    cpu = None
    if ratio(ours, anchor) is not None:
        ours_cpu, anchor_cpu = ours.timing.cpu_seconds_per_1k, anchor.timing.cpu_seconds_per_1k
        cpu = ours_cpu / anchor_cpu if ours_cpu is not None and anchor_cpu else None
    report.summary = {
        f"{OURS} / {ANCHOR}, images/s": figure(ratio(ours, anchor), "at least 1.0x"),
        f"{OURS} / {ANCHOR}, CPU s per 1,000 images": figure(cpu, "at most 1.0x"),
    }
    report.notes.append(
        "both sides: the same DALI thread count and batch size, graph on the CPU; CPU s/1k is the whole "
        "process tree's (DALI's threads, the loader's thread, any worker processes)"
    )
    return report
