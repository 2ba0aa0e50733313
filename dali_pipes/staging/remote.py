"""Datasets at URLs of object storage, staged and opened: ``open_store("s3://...")`` and the loader's default cache.

A dataset at a URL is always staged to a local folder first (:mod:`dali_pipes.staging.download` plans
and downloads it, :mod:`dali_pipes.staging.stage` checks and resumes), then read locally: LMDB, HDF5 and
TFRecord shards are never opened over the network.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Mapping

from dali_pipes.remote.urls import is_url, redact
from dali_pipes.staging.download import CACHE_ENV, default_cache_dir

if TYPE_CHECKING:
    from dali_pipes.staging.stage import StageReport
    from dali_pipes.stores import Store

log = logging.getLogger(__name__)


def open_store(
    path: str | os.PathLike,
    *,
    stage_to: str | os.PathLike | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Store:
    """Open a dataset folder, a merged ``.h5`` file, or a dataset at a URL of object storage.

    A URL is staged first (into ``stage_to``, or :func:`default_cache_dir`), then opened locally:
    shards are never read over the network. Returns a :class:`~dali_pipes.stores.Store`.
    """
    from dali_pipes.stores import open_store as open_local

    if not is_url(path):
        return open_local(path)
    return open_local(stage_url(str(path), stage_to, storage_options).path)


def stage_url(
    url: str, stage_to: str | os.PathLike | None, storage_options: Mapping[str, Any] | None = None
) -> StageReport:
    """Stage the dataset at ``url`` into ``stage_to`` (default: :func:`default_cache_dir`); the StageReport."""
    from dali_pipes.staging.stage import stage_dataset

    if stage_to is None:
        stage_to = default_cache_dir(url)
        log.info(
            "%s: staging into the cache folder %s (set %s to move it)",
            redact(url, storage_options),
            stage_to,
            CACHE_ENV,
        )
    return stage_dataset(url, stage_to, storage_options=storage_options, progress=False)


def stage_any(
    path: str | os.PathLike, stage_to: str | os.PathLike | None, storage_options: Mapping[str, Any] | None = None
) -> StageReport:
    """``DALILoader``'s staging: a URL into ``stage_to`` or the cache folder, a local dataset into ``stage_to``."""
    from dali_pipes.staging.stage import stage_dataset

    if is_url(path):
        return stage_url(str(path), stage_to, storage_options)
    if stage_to is None:
        raise ValueError(f"{path}: a local dataset is staged only into a folder named by stage_to")
    return stage_dataset(path, stage_to)


__all__ = ["open_store", "stage_any", "stage_url"]
