"""Benchmarks and their baselines: what a user would otherwise run, measured side by side.

How a row is measured, the same for every suite:

- ``runner``: a row (:class:`~dali_pipes.bench.runner.Job` in, ``Row`` out) timed in
  steady state (warm-up left out, median of windows, GPU synchronised,
  host-to-device copies counted); ``interleave``: a table's rows measured side by
  side; ``procfs``: what the process tree costs (CPU seconds, peak memory);
- ``report``: the table, JSON and plot, and each suite's ratios to its reference;
- ``inputs``: the dataset, its original files, the spec and settings every row shares.

The kinds of row: ``streams`` (this package's loader, a ``DataLoader``, DALI's
``fn.readers.file`` of ``anchor``), ``baselines`` and ``backends`` (the PIL
``DataLoader`` baseline; torchvision and Albumentations), ``decode`` (the
decode-only ceiling), ``torchvision_gpu``, ``object_storage`` (staging from a local
S3 server behind ``latency_proxy``), ``stream_rows`` (a loader staged from that server against one
streaming from it through a bounded cache), ``models`` (what trains in ``doctor`` and the
``train`` suite).

The suites, one module each in ``suites`` (``dali-pipes bench DATASET --suite
NAME``), ``scale`` (``--suite scale``) and ``scale_out`` (``--suite scale-out``: streaming on simulated
nodes, with ``scale_out_data``, ``scale_out_rank``, ``scale_out_mds`` and ``scale_out_table``). The tools: ``tune`` (``dali-pipes tune``
and the settings file ``DALILoader`` takes as ``RunOptions(settings=...)``) and
``doctor`` (``dali-pipes doctor``: is training data-bound).

Nothing here is imported by ``import dali_pipes``; the modules import torch and
DALI only when a benchmark runs.
"""
