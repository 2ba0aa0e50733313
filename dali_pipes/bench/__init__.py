"""Benchmarks and their baselines: what a user would otherwise run, measured side by side.

- ``suites``: which rows ``dali-pipes bench DATASET [--suite ...]`` measures;
- ``runner``: steady-state timing (warm-up left out, median of windows, GPU
  synchronised, host-to-device copies counted); ``report``: table, JSON, plot;
- ``inputs``: the dataset, its original files, the spec and settings every row shares;
- ``streams``, ``anchor``, ``decode``, ``formats``: the rows' data paths (this
  package's loader, ``DataLoader`` baselines, DALI's file reader, decode-only,
  equal-content copies in every format);
- ``baselines``, ``backends``: the PIL ``DataLoader`` baseline, and the optional
  torchvision and Albumentations transforms;
- ``tune``: ``dali-pipes tune`` and the settings file ``DALILoader`` takes
  (``DALILoader(path, spec, batch_size=..., **load_settings("settings.json"))``);
- ``doctor``, ``models``: ``dali-pipes doctor``, is training data-bound.

Nothing here is imported by ``import dali_pipes``; the modules import torch and
DALI only when a benchmark runs.
"""
