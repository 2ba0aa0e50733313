"""A :class:`~dali_pipes.Mixture` streamed: each dataset through a cache of its own, its share of the room.

``DALILoader(Mixture({...}), spec, data=DataOptions(stream=StreamOptions(cache_limit=BYTES)))`` opens each dataset
as a streamed dataset alone is opened (:func:`~dali_pipes.loading.stream_setup.open_streaming`: its cache folder,
named after its URL or path, under ``StreamOptions.folder`` when given; its partitions; its node windows agreed
between the ranks), with ``cache_limit`` times its share of the epoch's bytes (its samples an epoch times its bytes
a sample, over all the datasets'). So the datasets may lie in different buckets or clouds, each read window by
window within its own part of the room; a share too small for a dataset's shards is refused naming the dataset.

The epoch order is :class:`~dali_pipes.sampling.stream_mixture.MixtureOrder`: exactly the mixture's counts of each
dataset an epoch, each dataset's samples taken in its own streamed order, resumable. Before each batch the
external source tells :meth:`StreamedMixtureStore.before_batch` where the batch lies in this rank's plan; the
store splits it by dataset and tells each dataset's :class:`~dali_pipes.loading.streaming.StreamStore` its
samples and the dataset epoch they are read in (a batch may straddle two of a dataset's epochs: the earlier one's
windows are pinned, the later samples read guarded).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from dali_pipes.loading.mixture import Mixture, MixtureStore, check_in_order
from dali_pipes.sampling.mixture import exact_counts
from dali_pipes.sampling.stream_mixture import MixtureOrder

if TYPE_CHECKING:
    from dali_pipes.loading.config import DataOptions
    from dali_pipes.loading.streaming import StreamStore
    from dali_pipes.sampling import EpochRules

logger = logging.getLogger(__name__)

__all__ = ["StreamedMixtureStore", "Streamers", "open_streamed_mixture"]


class Streamers:
    """The streamers of a streamed mixture's datasets, with the surface the loader uses of one: :meth:`close`,
    :attr:`peak_bytes` and :attr:`limit_bytes` (summed over the datasets' caches); ``by_name``: each one."""

    def __init__(self, by_name: Mapping[str, Any]) -> None:
        self.by_name = dict(by_name)

    @property
    def limit_bytes(self) -> int:
        """The caches' limits together (each dataset's share of ``cache_limit``)."""
        return sum(s.limit_bytes for s in self.by_name.values())

    @property
    def peak_bytes(self) -> int:
        """The most each cache folder held, added up: a bound on what the mixture's caches held at once."""
        return sum(s.peak_bytes for s in self.by_name.values())

    def close(self) -> None:
        """Close every dataset's streamer."""
        for streamer in self.by_name.values():
            streamer.close()


class StreamedMixtureStore(MixtureStore):
    """A :class:`~dali_pipes.loading.mixture.MixtureStore` of streamed datasets: its ``sampling`` is the streamed
    order (:class:`MixtureOrder`), its ``streamer`` the datasets' :class:`Streamers`."""

    def __init__(self, stores: Mapping[str, "StreamStore"], mixture: Mixture, rules: "EpochRules") -> None:
        super().__init__(stores, mixture)
        drawn = self.sampling  # the staged draw: its counts and identity are the mixture's
        counts = list(drawn.counts(len(self)).values())
        orders = [store.sampling for store in stores.values()]
        place = orders[0].place  # each dataset's with its share of a batch: the mixture's batch is the loader's
        place = dataclasses.replace(place, layout=dataclasses.replace(place.layout, batch_size=rules.batch_size))
        self.sampling = MixtureOrder(
            orders, counts, self.offsets[:-1], rules.seed, rules.shuffle, drawn.identity(), place=place
        )
        self.streamer = Streamers({name: store.streamer for name, store in stores.items()})

    def before_batch(self, epoch: int, start: int, offset: int, indices: np.ndarray, is_pad: np.ndarray) -> None:
        """A batch of ``epoch`` at ``offset`` in this rank's plan from ``start`` is about to read ``indices``: each
        dataset's stream told its samples, in the dataset epoch they are read in (the earliest, when two)."""
        told = self.sampling.dataset_epochs(epoch, start)[offset : offset + len(indices)]
        real = ~np.asarray(is_pad, dtype=bool)[: len(told)]
        owner = self.dataset_of(indices[: len(told)])
        for k, name in enumerate(self.names):
            store, mine = self.stores[name], real & (owner == k)
            if not mine.any():
                continue
            first = int(told[mine].min())
            if store.in_reader:  # a reader process holds every shard it reads; the windows follow ``first``'s samples
                every = owner == k
                local = indices[: len(told)][every] - self.offsets[k]
                store.before_read(first, local, ~(mine & (told == first))[every])
                continue
            mine &= told == first
            local = indices[: len(told)][mine] - self.offsets[k]
            store.before_read(first, local, np.zeros(len(local), dtype=bool))

    def after_read(self) -> None:
        """After each batch: each dataset's (:meth:`StreamStore.after_read
        <dali_pipes.loading.streaming.StreamStore.after_read>`)."""
        for store in self.stores.values():
            store.after_read()

    def __getstate__(self) -> dict[str, Any]:
        """For a reader process: each dataset's store as it goes there, without the streamers."""
        return {k: v for k, v in self.__dict__.items() if k != "streamer"} | {"streamer": None}

    def readers_refusal(self, depth: int) -> str | None:
        """Why reader processes cannot read one of the datasets (:meth:`StreamStore.readers_refusal
        <dali_pipes.loading.streaming.StreamStore.readers_refusal>`), or ``None``."""
        return next(filter(None, (store.readers_refusal(depth) for store in self.stores.values())), None)

    def serve_readers(self, depth: int) -> None:
        """Let reader processes read each dataset, ``depth`` batches at once (:meth:`StreamStore.serve_readers
        <dali_pipes.loading.streaming.StreamStore.serve_readers>`)."""
        for store in self.stores.values():  # a batch may draw all its samples from one dataset
            store.serve_readers(depth, self.sampling.place.layout.batch_size)


def open_streamed_mixture(mixture: Mixture, data: "DataOptions", rules: "EpochRules") -> StreamedMixtureStore:
    """The :class:`StreamedMixtureStore` of ``mixture``: each dataset opened by
    :func:`~dali_pipes.loading.stream_setup.open_streaming` with its share of ``data.stream.cache_limit``."""
    from dali_pipes.loading.stream_setup import agree_on_window, cache_folder, open_streaming

    folders: dict[Any, str] = {}
    for name, path in mixture.datasets.items():
        other = folders.setdefault(cache_folder(path, data.stream), name)
        if other != name:
            raise ValueError(
                f"Mixture datasets {other!r} and {name!r} are one dataset (one cache folder): a streamed mixture "
                "reads each dataset through a cache of its own; give each dataset once (its proportion its share)"
            )
    if not rules.shuffle:
        check_in_order(mixture)
    try:
        limits, counts = _limits(mixture, data)
        total = sum(counts.values())
    except BaseException:
        agree_on_window(None)  # the other ranks fail too, and do not wait for this one
        raise
    stores: dict[str, StreamStore] = {}
    try:
        for name, path in mixture.datasets.items():
            stream = dataclasses.replace(data.stream, cache_limit=limits[name])
            # A batch holds about its share of the dataset's samples: the windows are sized for that many.
            batch = -(-rules.batch_size * counts[name] // total)
            try:
                opened = dataclasses.replace(data, stream=stream)
                stores[name] = open_streaming(path, opened, dataclasses.replace(rules, batch_size=batch))
            except ValueError as exc:
                share = limits[name] / data.stream.cache_limit
                raise ValueError(
                    f"Mixture dataset {name!r} streams with {limits[name]} bytes, its share ({share:.1%}, by its bytes "
                    f"an epoch) of cache_limit={data.stream.cache_limit}: {exc} (a cache_limit named there is this "
                    f"dataset's share: the mixture's is {1 / share:.2f} times it)"
                ) from None
        return StreamedMixtureStore(stores, mixture, rules)
    except BaseException:
        for store in stores.values():
            store.streamer.close()
            store.close()
        raise


def _limits(mixture: Mixture, data: "DataOptions") -> tuple[dict[str, int], dict[str, int]]:
    """Each dataset's part of ``cache_limit`` and its samples an epoch: its share of an epoch's bytes (its samples an
    epoch times its bytes a sample), from the manifests; a dataset no epoch draws from is refused (leave it out)."""
    from dali_pipes.remote.dataset import load_manifest

    manifests = {
        name: load_manifest(path, storage_options=data.storage_options) for name, path in mixture.datasets.items()
    }
    sizes = [sum(s.num_samples for s in m.shards) for m in manifests.values()]
    counts = mixture.sampling(sizes).counts(sum(sizes))
    per_sample = [sum(s.bytes for s in m.shards) / max(size, 1) for m, size in zip(manifests.values(), sizes)]
    epoch_bytes = [counts[name] * each for name, each in zip(mixture.names, per_sample)]
    idle = [name for name in mixture.names if counts[name] == 0]
    if idle:
        raise ValueError(
            f"Mixture dataset(s) {idle} are drawn 0 samples an epoch: a streamed mixture gives each dataset a share "
            "of the cache by what it reads; leave them out of the Mixture"
        )
    shares = exact_counts(epoch_bytes, int(data.stream.cache_limit))
    logger.info(
        "streamed mixture: cache_limit split by each dataset's bytes an epoch: %s",
        dict(zip(mixture.names, shares.tolist())),
    )
    return dict(zip(mixture.names, (int(s) for s in shares))), counts
