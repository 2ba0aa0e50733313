"""The public surface: what it must hold, and that every name in it is real, documented and cheap to import.

The export list itself lives in ``dali_pipes/__init__.py`` (and ``dali_pipes/pipelines/__init__.py``);
these tests check properties a change to it could break rather than repeating it.
"""

from __future__ import annotations
import __future__

import inspect
import subprocess
import sys

import pytest

import dali_pipes
import dali_pipes.pipelines as pipelines

#: What a training script imports from the top level: the loader, the configs it takes, and the names the README,
#: the examples and users' scripts use beside it (its errors, the store, the sampling rules).
LOADER_SURFACE = {
    *("DALILoader", "BatchFormat", "RunOptions", "DataOptions", "StreamOptions", "WeightedSampling", "Mixture"),
    *("LoaderError", "ShardReadError", "WorkerDiedError", "StoreError", "ManifestError", "RemoteError"),
    *("open_store", "load_manifest", "Manifest", "Store", "World", "class_balanced_weights", "__version__"),
    *("epoch_order", "num_batches", "rank_indices", "ClassificationTrain", "ClassificationVal", "Features"),
}
#: The pipelines package's names deliberately left out of the top level: building blocks, not specs to pick.
PIPELINES_ONLY = {"IMAGENET_MEAN", "IMAGENET_STD", "PipelineSpec"}


def test_the_loader_and_its_configs_are_exported():
    assert LOADER_SURFACE <= set(dali_pipes.__all__)
    from dali_pipes.loading.config import DataOptions, RunOptions

    assert dali_pipes.RunOptions is RunOptions and dali_pipes.DataOptions is DataOptions


def test_export_lists_name_each_name_once():
    for module in (dali_pipes, pipelines):
        assert len(set(module.__all__)) == len(module.__all__), module.__name__


def _own_doc(obj: object) -> str:
    """The docstring ``obj`` was given itself: not one inherited, nor the one ``dataclass`` writes from the fields."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return "" if not doc or doc.startswith(f"{getattr(obj, '__name__', '')}(") else doc


@pytest.mark.parametrize("module", [dali_pipes, pipelines], ids=lambda m: m.__name__)
def test_every_exported_class_and_function_resolves_and_is_documented(module):
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__.startswith("dali_pipes."), name
            assert _own_doc(obj).strip(), f"{module.__name__}.{name} has no docstring of its own"


def test_the_pipelines_package_exports_what_it_imports():
    # A spec imported into the package but left out of __all__ (or the reverse) is a name half made public.
    public = {
        name for name, value in vars(pipelines).items() if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert set(pipelines.__all__) == public - set(__future__.all_feature_names)


def test_every_spec_is_at_the_top_level_too_as_the_same_object():
    assert set(pipelines.__all__) - set(dali_pipes.__all__) == PIPELINES_ONLY
    for name in set(pipelines.__all__) - PIPELINES_ONLY:
        assert getattr(dali_pipes, name) is getattr(pipelines, name), name


def test_the_loader_errors_and_decoder_hints_are_the_ones_the_library_raises_and_reads():
    # Exported names are the classes themselves, so `except dali_pipes.ShardReadError` catches what the loader raises.
    from dali_pipes.loading.errors import ShardReadError, WorkerDiedError
    from dali_pipes.pipelines.config import DecoderHints

    assert dali_pipes.ShardReadError is ShardReadError
    assert dali_pipes.WorkerDiedError is WorkerDiedError
    assert dali_pipes.DecoderHints is DecoderHints
    assert issubclass(dali_pipes.ShardReadError, (dali_pipes.LoaderError, dali_pipes.StoreError))
    assert issubclass(dali_pipes.WorkerDiedError, dali_pipes.LoaderError)


LAZY_NAMES = """
import sys, dali_pipes
heavy = lambda: sorted(m for m in ('nvidia.dali', 'torch') if m in sys.modules)
print(heavy())
print(all(getattr(dali_pipes, name) is not None for name in dali_pipes.__all__))
print(heavy())
"""


def test_importing_the_package_loads_neither_dali_nor_torch_until_a_spec_or_the_loader_is_used():
    # The CLI imports dali_pipes for every command; DALI and torch load only when a loader or spec is used.
    out = subprocess.run([sys.executable, "-c", LAZY_NAMES], capture_output=True, text=True, check=True).stdout
    before, resolved, after = out.splitlines()[:3]
    assert (before, resolved) == ("[]", "True")
    assert "nvidia.dali" in after  # the specs were loaded on first use
