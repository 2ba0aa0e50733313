"""Shared test fixtures: paths to the real sample photos, and skipping of GPU tests without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
IMAGENET_MINI = SHARED_DATA / "imagenet-mini"
COCO_MINI = SHARED_DATA / "coco-mini"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` on machines without CUDA, saying why."""
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA and a GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def imagenet_mini() -> Path:
    """The 47 real ImageNet-style photos (read-only)."""
    if not IMAGENET_MINI.is_dir():
        pytest.fail(f"sample data missing: {IMAGENET_MINI} (the repository expects ../shared/data beside it)")
    return IMAGENET_MINI


@pytest.fixture(scope="session")
def coco_mini() -> Path:
    """The 61 real COCO-style photos with instances.json (read-only)."""
    if not COCO_MINI.is_dir():
        pytest.fail(f"sample data missing: {COCO_MINI} (the repository expects ../shared/data beside it)")
    return COCO_MINI
