"""Where a :class:`~dali_pipes.DALILoader`'s store comes from: staged, opened, and cached in RAM, as asked."""

from __future__ import annotations

import os
from typing import Any, Mapping

from dali_pipes.loading.config import DataOptions
from dali_pipes.loading.mixture import Mixture, MixtureStore, check_in_order
from dali_pipes.remote.urls import is_url
from dali_pipes.sampling import EpochRules
from dali_pipes.stores import Store, open_store

__all__ = ["epoch_sampling", "prepare_store"]


def prepare_store(
    path: str | os.PathLike | Mixture, data: DataOptions, rules: EpochRules
) -> tuple[Store | MixtureStore, Any, Any]:
    """``(store, staged, ram_cache)``: the dataset staged (``data.stage_to``, or a URL), opened, and cached
    (``data.cache="ram"``); the loader's epoch ``rules`` say which shards this rank reads, for the cache.

    A :class:`~dali_pipes.loading.mixture.Mixture` opens each of its datasets (staged into
    ``stage_to/NAME`` when given) and joins them into a :class:`MixtureStore`.

    ``staged`` says what staging did (the files copied, or that a staged copy was
    reused), ``ram_cache`` the shards the RAM cache holds and its budget; each is
    ``None`` when not asked for. One process per destination copies; the others on
    the node wait and reuse its copy. The RAM cache is made before the workers start.
    """
    if data.stream:
        return _open_streamed(path, data, rules)
    if isinstance(path, Mixture):
        return _prepare_mixture(path, stage_to=data.stage_to, cache=data.cache, storage_options=data.storage_options)
    store, staged = _stage_and_open(path, data.stage_to, data.storage_options)
    ram_cache = None
    if data.cache == "ram":
        from dali_pipes.staging.ramcache import cache_for_loader

        store, ram_cache = cache_for_loader(store, data.cache_bytes, rules)
    return store, staged, ram_cache


def _open_streamed(path: Any, data: DataOptions, rules: EpochRules) -> tuple[Store, None, Any]:
    """``(store, None, streamer)``: the dataset at ``path`` read through a bounded cache (``data.stream``); a
    :class:`Mixture`'s datasets each through its own, with its share of the room (:mod:`.mixture_stream`)."""
    if isinstance(path, Mixture):
        from dali_pipes.loading.mixture_stream import open_streamed_mixture

        mixed = open_streamed_mixture(path, data, rules)
        return mixed, None, mixed.streamer
    from dali_pipes.loading.stream_setup import open_streaming  # the cache machinery only when streaming

    store = open_streaming(path, data, rules)
    return store, None, store.streamer


def _stage_and_open(
    path: str | os.PathLike, stage_to: str | os.PathLike | None, storage_options: Mapping[str, Any] | None
) -> tuple[Store, Any]:
    """``(store, staged)``: ``path`` copied to ``stage_to`` (a URL always is: to a cache folder by default), opened.

    ``staged`` is what :func:`~dali_pipes.staging.remote.stage_any` did, ``None`` when nothing was staged.
    """
    staged = None
    if stage_to is not None or is_url(path):
        from dali_pipes.staging.remote import stage_any  # fsspec and the copy machinery only when staging

        staged = stage_any(path, stage_to, storage_options)
        path = staged.path
    return open_store(path), staged


def _prepare_mixture(
    mixture: Mixture, *, stage_to: str | os.PathLike | None, cache: str | None, storage_options: Any
) -> tuple[MixtureStore, Any, None]:
    """Each dataset of ``mixture`` staged (into ``stage_to/NAME``) and opened; the stores joined into one."""
    if cache is not None:
        raise ValueError(
            "cache='ram' does not take a Mixture: stage the datasets to a local folder or a tmpfs instead "
            "(stage_to='/dev/shm/NAME' holds them in RAM)"
        )
    stores: dict[str, Store] = {}
    staged: dict[str, Any] = {}
    try:
        for name, path in mixture.datasets.items():
            dest = None if stage_to is None else os.path.join(stage_to, name)
            stores[name], staged[name] = _stage_and_open(path, dest, storage_options)
        return MixtureStore(stores, mixture), ({k: v for k, v in staged.items() if v is not None} or None), None
    except BaseException:
        for store in stores.values():
            store.close()
        raise


def epoch_sampling(store: Store | MixtureStore, sampling: Any, *, shuffle: bool = True, spec: Any = None) -> Any:
    """How the loader draws its epochs: ``sampling`` (weights), a mixture's own draw, or ``None`` (a permutation).

    A mixture read without shuffling (an evaluation spec) reads its datasets one after the other, every sample
    once; a mixture with proportions or its own epoch length is a random draw, and refuses ``shuffle=False``.
    So does ``sampling`` (a weighted draw is random). ``spec``: the pipeline spec when ``shuffle`` is its default
    (``shuffle_by_default``), named in the refusal. A streamed store draws in its windowed order
    (:mod:`dali_pipes.loading.streaming`; weights: :mod:`dali_pipes.sampling.stream_weighted`).
    """
    streamed = getattr(store, "streamer", None) is not None
    if isinstance(store, MixtureStore):
        return _mixture_sampling(store, sampling, shuffle, streamed)
    if sampling is not None and not shuffle:
        given = f"(the default of {type(spec).__name__}, which reads in order)" if spec is not None else "was given"
        raise ValueError(
            f"sampling={type(sampling).__name__}(...) draws each epoch at random with its weights, but "
            f"shuffle=False {given}: pass shuffle=True to draw with the weights, or leave out sampling= to read "
            "every sample once, in order"
        )
    if streamed:
        if sampling is None:
            return store.sampling
        from dali_pipes.sampling.stream_weighted import WeightedStreamOrder

        return WeightedStreamOrder(store.sampling, sampling)
    return sampling


def _mixture_sampling(store: MixtureStore, sampling: Any, shuffle: bool, streamed: bool) -> Any:
    """:func:`epoch_sampling` of a mixture: its own draw (streamed: checked when opened)."""
    if sampling is not None:
        raise ValueError(
            "a Mixture draws its own epochs (its proportions); sampling= cannot be given with it. "
            "Weight the datasets with Mixture(proportions=...)"
        )
    if not shuffle and not streamed:
        check_in_order(store.mixture)
        return None  # the concatenation, in order
    return store.sampling
