"""Shared by the training-recipe tests: timm's reference code, a dataset of real photos, and loaders' batches.

timm is a test-only reference, and it is loaded without ``import timm``: timm's
package ``__init__`` imports torchvision, which has no CPU build that fits this
project's pinned CPU torch (and on CI would pull a CUDA torch). Its
``data/mixup.py`` and ``data/random_erasing.py`` import only numpy and torch, so
they are loaded here straight from their files. Install timm with
``pip install --no-deps timm`` (``.ci/run`` does); where it is absent, the tests
that compare with it skip, saying so.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from dali_pipes import DALILoader, RunOptions
from dali_pipes.dataset.manifest import Field

#: Photos in the test dataset, and their labels' classes.
PHOTOS = 8
CLASSES = ["a", "b", "c", "d", "e"]


def timm_module(name: str) -> ModuleType:
    """timm's ``timm/data/<name>.py`` (``"mixup"`` or ``"random_erasing"``), loaded from its file."""
    found = importlib.util.find_spec("timm")  # finds the package without running its __init__ (torchvision)
    if found is None or not found.submodule_search_locations:
        pytest.skip("timm is not installed (pip install --no-deps timm): it is the reference these tests compare with")
    path = Path(list(found.submodule_search_locations)[0]) / "data" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_timm_reference_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_photo_dataset(write_dataset: Any, root: Path, imagenet_mini: Path, count: int = PHOTOS) -> Path:
    """A dataset of ``count`` real ImageNet-mini JPEGs labelled ``i % 5``, with 5 class names."""
    files = sorted(imagenet_mini.glob("*/*.jpg"))[:count]
    fields = {"image": Field(kind="bytes", encoding="image"), "label": Field.array("int64", ())}
    samples = [{"image": f.read_bytes(), "label": np.array(i % 5, dtype=np.int64)} for i, f in enumerate(files)]
    return write_dataset(root, "lmdb", fields, samples, per_shard=4, classes=CLASSES)


def epoch_batches(
    path: Path, spec: Any, epoch: int = 0, *, run: RunOptions | None = None, **kwargs: Any
) -> list[dict[str, Any]]:
    """Every batch of ``epoch`` from a fresh loader of ``spec`` (batch 4, seed 3, ``kwargs`` to ``DALILoader``).

    ``run`` replaces the default, the CPU with one forked worker, as a whole.
    """
    run = RunOptions(device="cpu", py_num_workers=1) if run is None else run
    kwargs = {"batch_size": 4, "seed": 3, **kwargs}
    with DALILoader(path, spec, run=run, **kwargs) as loader:
        loader.set_epoch(epoch)
        return [{name: value.cpu().clone() for name, value in batch.items()} for batch in loader]
