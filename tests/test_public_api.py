"""The public surface is pinned: a change to it is a decision, not an accident."""

from __future__ import annotations

import subprocess
import sys

import dali_pipes

EXPECTED = {
    "BatchFormat",
    "DALILoader",
    "LoaderError",
    "Manifest",
    "ManifestError",
    "Mixture",
    "RemoteError",
    "ShardReadError",
    "Store",
    "StoreError",
    "WeightedSampling",
    "WorkerDiedError",
    "World",
    "__version__",
    "class_balanced_weights",
    "epoch_order",
    "load_manifest",
    "num_batches",
    "open_store",
    "rank_indices",
    "ClassificationTrain",
    "ClassificationVal",
    "ColorJitter",
    "DecoderHints",
    "Detection",
    "DetectionVal",
    "Features",
    "InstanceSegmentation",
    "InstanceSegmentationVal",
    "Mix",
    "RandomErasing",
    "ResolutionSchedule",
    "SemanticSegmentation",
    "SemanticSegmentationVal",
}


def test_exported_names_are_pinned_and_resolve():
    assert set(dali_pipes.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(dali_pipes, name) is not None, name


def test_the_loader_errors_and_decoder_hints_are_the_ones_the_library_raises_and_reads():
    # Exported names are the classes themselves, so `except dali_pipes.ShardReadError` catches what the loader raises.
    from dali_pipes.loading.errors import ShardReadError, WorkerDiedError
    from dali_pipes.pipelines.config import DecoderHints

    assert dali_pipes.ShardReadError is ShardReadError
    assert dali_pipes.WorkerDiedError is WorkerDiedError
    assert dali_pipes.DecoderHints is DecoderHints
    assert issubclass(dali_pipes.ShardReadError, (dali_pipes.LoaderError, dali_pipes.StoreError))
    assert issubclass(dali_pipes.WorkerDiedError, dali_pipes.LoaderError)


def test_importing_the_package_does_not_load_dali_or_torch():
    # The CLI imports dali_pipes for every command; DALI and torch load only when a loader or spec is used.
    code = "import sys, dali_pipes; print(sorted(m for m in ('nvidia.dali', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
