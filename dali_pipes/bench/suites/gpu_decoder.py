"""The GPU decoder split and the feed behind it (``dali-pipes bench DATASET --suite gpu-decoder``).

On a GPU with hardware JPEG decoders (A100, H100, H200 and later), DALI's
``mixed`` decoder sends ``hw_decoder_load`` of the JPEGs to the hardware engines
and the rest to nvJPEG's CUDA path, whose Huffman decoding runs on the pipeline's
CPU threads; the threads also serve the feed. This suite shows what each choice
is worth, side by side in one run, the training graph of the main suite on the GPU:

- ``DALI readers.file gpu``: DALI's own reader over the original files, at DALI's
  default load (0.65) and at 1.0: a plain DALI pipeline as its documentation shows;
- ``dali-pipes gpu``: this package's loader with its defaults (the load chosen for
  the machine, :meth:`~dali_pipes.pipelines.DecoderHints.chosen_load`, and the reader
  processes :func:`~dali_pipes.loading.options.default_py_num_workers` chooses), then
  at DALI's default load, then with :data:`SPLIT_LOAD` (the hardware engines and
  nvJPEG's CUDA path on the SMs decoding side by side), then with the former
  default of :data:`FORMER_THREADS` DALI threads, then reading in the loader's
  process (``py_num_workers=0``) and with 8 reader processes.

The summary gives our defaults against the plain pipeline at DALI's default and at
1.0. GPU only: on a machine without CUDA every row is skipped, saying so.
"""

from __future__ import annotations

from dali_pipes.bench.report import BenchReport, figure, ratio
from dali_pipes.bench.streams import anchor_job, dali_job
from dali_pipes.bench.suites import SuiteRun
from dali_pipes.pipelines.config import DALI_HW_DECODER_LOAD

OURS, ANCHOR = "dali-pipes gpu", "DALI readers.file gpu"
#: A decoder split between DALI's default (0.65) and all-hardware (1.0): both decoders busy at once.
SPLIT_LOAD = 0.85
#: A fixed DALI thread count, the loader's default before its threads followed the rank's cores: what following
#: them is worth.
FORMER_THREADS = 4


def run(bench: SuiteRun) -> BenchReport:
    """Our loader's defaults against plain DALI at both decoder loads, and what each default is worth."""
    inputs, target = bench.inputs, bench.target
    loads = (DALI_HW_DECODER_LOAD, 1.0)
    jobs = [anchor_job(ANCHOR, inputs.with_decoder_load(load), "gpu", target, hw_decoder_load=load) for load in loads]
    jobs.append(dali_job(OURS, inputs, "gpu", target))
    for load in (DALI_HW_DECODER_LOAD, SPLIT_LOAD):
        jobs.append(dali_job(OURS, inputs.with_decoder_load(load), "gpu", target, hw_decoder_load=load))
    defaults = inputs.settings_for("gpu")
    if defaults.get("num_threads") != FORMER_THREADS:
        jobs.append(dali_job(OURS, inputs, "gpu", target, settings={**defaults, "num_threads": FORMER_THREADS}))
    for workers in (0, 8):
        if defaults.get("py_num_workers") != workers:
            jobs.append(dali_job(OURS, inputs, "gpu", target, settings={**defaults, "py_num_workers": workers}))
    title = "the GPU decoder split and the feed: random-resized crop 224, flip, colour jitter, normalise on the GPU"
    report = bench.measure(title, jobs, reference=ANCHOR, columns=("gpu_mb",))
    ours = report.row(OURS, **defaults)
    report.summary = {
        f"{OURS} defaults / {ANCHOR} at {where}": figure(
            ratio(ours, report.row(ANCHOR, hw_decoder_load=load)), "at least 1.0x"
        )
        for where, load in (("DALI's default load", DALI_HW_DECODER_LOAD), ("hw_decoder_load=1", 1.0))
    }
    report.notes.append(
        "hw_decoder_load: the share of JPEGs for the hardware decoder; a dali-pipes row without it chose its own "
        "(logged once by dali_pipes.pipelines.ops); py_num_workers: reader processes (0: the loader's own thread)"
    )
    return report
