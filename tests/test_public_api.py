"""The public surface is pinned: a change to it is a decision, not an accident."""

from __future__ import annotations

import subprocess
import sys

import dali_pipes

EXPECTED = {
    "DALILoader",
    "LoaderError",
    "Manifest",
    "ManifestError",
    "Store",
    "StoreError",
    "World",
    "__version__",
    "epoch_order",
    "load_manifest",
    "num_batches",
    "open_store",
    "rank_indices",
    "ClassificationTrain",
    "ClassificationVal",
    "ColorJitter",
    "Detection",
    "DetectionVal",
    "Features",
}


def test_exported_names_are_pinned_and_resolve():
    assert set(dali_pipes.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(dali_pipes, name) is not None, name


def test_importing_the_package_does_not_load_dali_or_torch():
    # The CLI imports dali_pipes for every command; DALI and torch load only when a loader or spec is used.
    code = "import sys, dali_pipes; print(sorted(m for m in ('nvidia.dali', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
