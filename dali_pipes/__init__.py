"""dali-pipes: shards in, augmented GPU batches out.

Offline, ``dali-pipes convert`` writes a training set into LMDB, HDF5 or TFRecord
shards described by one manifest; online, :class:`DALILoader` reads them by
sample index through a DALI pipeline built from a spec such as
:class:`ClassificationTrain`, one loader per DDP rank.

The pipeline specs import DALI, so they are loaded on first use
(``dali_pipes.ClassificationTrain``): ``import dali_pipes`` stays light for the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

from dali_pipes._version import __version__
from dali_pipes.dataset.manifest import Manifest, ManifestError
from dali_pipes.loading.config import DataOptions, RunOptions, StreamOptions
from dali_pipes.loading.errors import LoaderError, ShardReadError, WorkerDiedError
from dali_pipes.loading.mixture import Mixture
from dali_pipes.remote.dataset import load_manifest  # a folder or a URL
from dali_pipes.remote.fs import RemoteError
from dali_pipes.sampling import WeightedSampling, World, class_balanced_weights, epoch_order, num_batches, rank_indices
from dali_pipes.staging.remote import open_store  # a path, a merged .h5 file, or a URL (staged first)
from dali_pipes.stores import Store, StoreError

#: Names re-exported from :mod:`dali_pipes.pipelines`, imported when first used.
_PIPELINE_NAMES = (
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
)

__all__ = [
    "BatchFormat",
    "DALILoader",
    "DataOptions",
    "LoaderError",
    "Manifest",
    "ManifestError",
    "Mixture",
    "RemoteError",
    "RunOptions",
    "ShardReadError",
    "Store",
    "StoreError",
    "StreamOptions",
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
    *_PIPELINE_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _PIPELINE_NAMES:
        return getattr(importlib.import_module("dali_pipes.pipelines"), name)
    if name == "BatchFormat":
        return importlib.import_module("dali_pipes.loading.compat").BatchFormat
    if name == "DALILoader":
        # Loaded on first use, so that the converters (which import dali_pipes.dataset.manifest, and so this
        # package) do not load the loader and its worker machinery.
        return importlib.import_module("dali_pipes.loading.loader").DALILoader
    raise AttributeError(f"module 'dali_pipes' has no attribute {name!r}")
