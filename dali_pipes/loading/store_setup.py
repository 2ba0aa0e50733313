"""Where a :class:`~dali_pipes.DALILoader`'s store comes from: staged, opened, and cached in RAM, as asked."""

from __future__ import annotations

import os
from typing import Any, Mapping

from dali_pipes.remote.urls import is_url
from dali_pipes.sampling import World
from dali_pipes.stores import Store, open_store

__all__ = ["prepare_store"]


def prepare_store(
    path: str | os.PathLike,
    *,
    stage_to: str | os.PathLike | None,
    cache: str | None,
    cache_bytes: int | None,
    storage_options: Mapping[str, Any] | None,
    world: World,
    batch_size: int,
    seed: int,
    shuffle: bool,
    last_batch: str,
) -> tuple[Store, Any, Any]:
    """``(store, staged, ram_cache)``: the dataset staged (``stage_to``, or a URL), opened, and cached (``cache="ram"``).

    ``staged`` says what staging did (the files copied, or that a staged copy was
    reused), ``ram_cache`` the shards the RAM cache holds and its budget; each is
    ``None`` when not asked for. One process per destination copies; the others on
    the node wait and reuse its copy. The RAM cache is made before the workers start.
    """
    staged = None
    if stage_to is not None or is_url(path):
        from dali_pipes.staging.remote import stage_any

        staged = stage_any(path, stage_to, storage_options)
        path = staged.path
    store = open_store(path)
    ram_cache = None
    if cache == "ram":
        from dali_pipes.staging.ramcache import cache_for_loader

        store, ram_cache = cache_for_loader(
            store, cache_bytes, world=world, batch_size=batch_size, seed=seed, shuffle=shuffle, last_batch=last_batch
        )
    return store, staged, ram_cache
