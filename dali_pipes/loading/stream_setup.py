"""Opening a stream (:mod:`dali_pipes.loading.streaming`): its cache folder, this rank's place, the windows' width.

``DataOptions(stream=StreamOptions(...))`` is turned here into a :class:`~dali_pipes.loading.streaming.StreamStore`:
the cache folder of the dataset (:func:`stream_folder`, or ``StreamOptions.folder``), this rank's node and the
partitions (:mod:`dali_pipes.loading.stream_layout`), and the node's windows and the shards fetched ahead, sized
from the node's limit (:func:`~dali_pipes.sampling.node_room.node_window`).

Every rank must read with the same windows, or the ranks' slices of the epoch would come from different
orders (samples read twice, others never). The window follows from the cache limit and the shard sizes, and
the limit may differ between nodes (a limit taken from each node's free disk). So, when a
``torch.distributed`` process group is up, the ranks agree on the smallest node window (:func:`agree_on_window`)
through the default group's key-value store, not a collective: each rank writes its window (0: it failed to open
its cache, and the others fail with it at once) and reads the others'. So every rank of the job builds its
streaming loaders at the same point of the script, in the same order; a rank whose peers never come (a loader built
on some ranks only) fails after :data:`AGREEMENT_TIMEOUT_S` with an error naming them, instead of hanging, and the
collectives both sides make next still match. Without a process group the ranks cannot talk: give each the same
``cache_limit``.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dali_pipes.dataset.manifest import human_bytes
from dali_pipes.loading.errors import LoaderError
from dali_pipes.loading.stream_engine import MIN_DOWNLOADS, default_downloads
from dali_pipes.loading.stream_layout import choose_partitions, rank_place
from dali_pipes.loading.stream_plan import WindowPlan
from dali_pipes.loading.streaming import Streamer, StreamStore
from dali_pipes.remote.urls import check_dataset_path, is_url, redact
from dali_pipes.sampling.node_order import NodeOrder
from dali_pipes.sampling.node_room import least_cache_limit, node_window
from dali_pipes.sampling.partitioned import PartitionedSampling, partition_window

if TYPE_CHECKING:
    import torch.distributed as dist

    from dali_pipes.loading.config import DataOptions, RunOptions, StreamOptions
    from dali_pipes.sampling import EpochRules
    from dali_pipes.sampling.node_room import NodeWindow
    from dali_pipes.staging.stream_cache import ShardCache

logger = logging.getLogger(__name__)

__all__ = [
    "AGREEMENT_KEY",
    "AGREEMENT_TIMEOUT_S",
    "STREAM_FOLDER",
    "agree_on_window",
    "cache_folder",
    "open_streaming",
    "stream_folder",
    "streaming_run",
]

#: The most seconds a rank waits for the others to agree on the window (:func:`agree_on_window`): the ranks build
#: their loaders at the same point, so a peer later than this is one that never builds its loader. Not shorter: a
#: rank may come minutes late without fault (its cache's index read from a slow server, a checkpoint loaded first).
AGREEMENT_TIMEOUT_S = 300.0

#: The prefix of the store keys of the window agreement (:func:`agree_on_window`).
AGREEMENT_KEY = "dali-pipes/stream-window"

#: The streaming loaders this process has agreed on (the n-th of every rank agree with each other).
_AGREEMENTS = itertools.count()

#: The sub-folder of the cache base (``$DALI_PIPES_CACHE`` or ``~/.cache/dali-pipes``) that holds streamed datasets.
STREAM_FOLDER = "stream"


def stream_folder(source: str | os.PathLike) -> Path:
    """The cache folder of the dataset at ``source``: beside staging's copies, under :data:`STREAM_FOLDER`.

    Named as staging names its folders (readable, with a hash of the URL or of the absolute path, credentials
    left out), but in a folder of its own: a streaming cache refuses a folder that holds a staged copy.
    """
    from dali_pipes.staging.download import default_cache_dir

    check_dataset_path(source)  # an https:// URL taken for a path would name the folder with its password
    # A local path by its absolute name: "ds", "./ds" and "/data/ds" are one dataset, one cache.
    staged = default_cache_dir(str(source) if is_url(source) else str(Path(source).resolve()))
    return staged.parent / STREAM_FOLDER / staged.name


def cache_folder(source: str | os.PathLike, stream: "StreamOptions") -> Path:
    """The cache folder of the dataset at ``source``: :func:`stream_folder`, or its name in ``stream.folder``.

    It must be on a disk of this node: its processes share it through files and locks, so on a network filesystem
    every node would share one "node" cache. The default (under ``~/.cache``, on NFS on many clusters) is refused
    there with the fix; a folder the user chose (``stream.folder`` or ``$DALI_PIPES_CACHE``) is used, with one
    warning (a single-node job may mean it)."""
    from dali_pipes.staging.download import CACHE_ENV
    from dali_pipes.staging.mounts import network_filesystem

    folder = stream_folder(source)
    if stream.folder is not None:  # the user's folder, the dataset's sub-folder named alike
        folder = Path(stream.folder) / folder.name
    network = network_filesystem(folder)
    if network is None:
        return folder
    fix = f"give StreamOptions(folder=...) on a node-local disk (or set ${CACHE_ENV} to one)"
    if stream.folder is None and not os.environ.get(CACHE_ENV):
        raise ValueError(
            f"{folder.parent.parent}: the default cache folder of streaming is on a network filesystem ({network}), "
            f"which every node of a job would share as one node's cache: {fix}"
        )
    if str(folder) not in _WARNED:
        _WARNED.add(str(folder))
        logger.warning(
            "stream cache %s is on a network filesystem (%s): every node that uses it shares one cache and its "
            "locks, and reads cost a network round trip; %s",
            folder, network, fix,
        )  # fmt: skip
    return folder


#: The cache folders on a network filesystem already warned of in this process (one warning each).
_WARNED: set[str] = set()


def streaming_run(run: "RunOptions", data: "DataOptions") -> "RunOptions":
    """``run`` as streaming reads it: whole batches (per-sample reads refused); reader processes read too, by the
    pins of the loader's process (:mod:`dali_pipes.loading.stream_readers`)."""
    if data.stream is not None and not run.batch_reads:
        raise ValueError("DataOptions(stream=...) reads whole batches: leave RunOptions(batch_reads=True)")
    return run


def open_streaming(path: str | os.PathLike, data: "DataOptions", rules: "EpochRules") -> StreamStore:
    """The :class:`StreamStore` of the dataset at ``path`` as ``data.stream`` says, read by the rank ``rules`` name:
    its cache in ``stream.folder`` (default :func:`stream_folder`; a network filesystem checked:
    :func:`cache_folder`) within ``stream.cache_limit``, this rank's place in the partitioned order, and the node's
    windows sized from the limit and agreed between the ranks (:func:`agree_on_window`, through the process
    group's store: every rank opens its stream at the same point)."""
    from dali_pipes.staging.stream_cache import CacheTuning, ShardCache

    stream = data.stream
    shown = redact(str(path), data.storage_options)  # the dataset by what the user gave, credentials taken out
    cache: ShardCache | None = None
    try:
        folder = cache_folder(path, stream)
        place = rank_place(stream, rules)
        tuning = CacheTuning(downloads=stream.downloads or MIN_DOWNLOADS)
        cache = ShardCache(path, folder, stream.cache_limit, storage_options=data.storage_options, tuning=tuning)
        plan = _node_window(cache, stream, _apart(place.layout.ranks))
        samples = [shard.num_samples for shard in cache.manifest.shards]
        partitions = choose_partitions(stream, samples, place.layout.nodes)
    except BaseException:
        agree_on_window(None)  # the other ranks fail too, and do not wait for this one
        if cache is not None:
            cache.close()
        raise
    try:
        agreed = agree_on_window(plan.window)
        read_cap = _read_cap(cache, stream, agreed, rules.batch_size, place.layout.ranks, shown)
        # A cache holding every shard reads each partition as one window, all at once (NodeOrder.holds_all).
        window = len(samples) if agreed >= len(samples) else partition_window(agreed, partitions, place.layout.nodes)[0]
        order = NodeOrder(PartitionedSampling(samples, window, partitions, rules.shuffle), place, rules.seed, agreed)
        together = order.layout_of(0).together
        logger.info(
            "stream %s: cache %s, limit %d bytes; node %d of %d (%d rank(s)), %d partition(s), %d at once, windows of "
            "%d shard(s) (%d a node, the smallest of the job's: %d here), %d fetched ahead",
            shown, folder, cache.limit_bytes, place.node, place.layout.nodes, place.layout.ranks, partitions,
            together, window, agreed, plan.window, plan.ahead,
        )  # fmt: skip
        pins = WindowPlan(order, cache.shard_bytes, ahead=plan.ahead, budget=plan.budget, read_cap=read_cap)
        downloads = stream.downloads or default_downloads(cache.shard_bytes)
        logger.info("stream %s: %d download(s) at once", shown, downloads)
        return StreamStore(Streamer(cache, pins, downloads=downloads))
    except BaseException:
        cache.close()
        raise


def _apart(ranks: int) -> int:
    """How many readers of its own stream each of a node's ``ranks`` ranks counts as: 1 in a ``torch.distributed``
    process group (DDP keeps the ranks within a step of each other, so they read the same windows); each rank
    without one (nothing keeps processes together: each may read other windows than the rest)."""
    import torch.distributed as dist

    return 1 if ranks == 1 or (dist.is_available() and dist.is_initialized()) else ranks


def _read_cap(cache: "ShardCache", stream: "StreamOptions", window: int, batch: int, ranks: int, shown: str) -> int:
    """The most bytes one of a node's ``ranks`` ranks pins to read for a batch of ``batch`` samples: two node windows
    of ``window`` shards (the reads crossing from one into the next), when a window holds the samples a step of the
    node reads. A window of fewer (small shards, a small cache, a large batch) would have a batch pin many windows
    and the ranks more than the limit together: then a rank pins at most its share of its loader's room and reads
    the rest of a batch shard by shard, each waiting for its download; said once a node, with the limit that
    avoids it."""
    largest = np.sort(np.asarray(cache.shard_bytes))[::-1]
    samples = np.sort([shard.num_samples for shard in cache.manifest.shards])
    apart = _apart(ranks)
    step = batch * (ranks if apart == 1 else 1)  # ranks apart: each one's batch its own
    held = int(samples[:window].sum())
    if held >= step or window >= len(largest):
        return int(largest[: 2 * window].sum())
    # Each rank's batch in windows of its own: a rank's pins, a shard read outside them included, within its share.
    share = cache.limit_bytes // (stream.loaders * ranks)
    if share < int(largest[0]):
        raise ValueError(
            f"{cache.folder}: a node window of {window} shard(s) holds {held} samples, fewer than the {step} of a "
            f"step, so each of the node's {ranks} rank(s) reads shards of its own, {stream.loaders} loader(s) of "
            f"them: a cache_limit of {cache.limit_bytes} bytes leaves {share} a rank, less than the largest shard "
            f"({int(largest[0])} bytes); raise cache_limit to at least {stream.loaders * ranks * int(largest[0])} "
            "bytes, or use a smaller batch"
        )
    cap = share - int(largest[0])
    need = min(int(np.searchsorted(np.cumsum(samples), step)) + 1, len(samples))  # the fewest shards holding a step
    least = stream.loaders * apart * (int(largest[: 2 * need].sum()) + int(largest[0]))
    if os.environ.get("LOCAL_RANK", "0") == "0":
        logger.warning(
            "stream %s: a node window of %d shard(s) holds as few as %d samples, fewer than the %d of a step: a batch "
            "pins at most %d bytes to read and reads the rest shard by shard, waiting for each download; "
            "cache_limit=%d (%s) or more, or a smaller batch, gives windows that hold a step",
            shown, window, held, step, cap, least, human_bytes(least),
        )  # fmt: skip
    return cap


def _node_window(cache: "ShardCache", stream: "StreamOptions", apart: int) -> "NodeWindow":
    """The node's windows in ``cache`` (:func:`node_window`) for its loaders, each of whose ranks reads ``apart``
    from the others (:func:`_apart`); refused with what to change, naming the cache folder."""
    try:
        return node_window(cache.limit_bytes, cache.shard_bytes, stream.loaders * apart, stream.fetch_ahead)
    except ValueError as exc:
        if apart > 1 and not str(exc).startswith("fetch_ahead"):
            least = least_cache_limit(cache.shard_bytes, stream.loaders * apart)
            raise ValueError(
                f"{cache.folder}: a cache_limit of {cache.limit_bytes} bytes read by {apart} ranks without a process "
                f"group (nothing keeps them together, so each reads windows of its own) and {stream.loaders} "
                f"loader(s) of the dataset at once: raise cache_limit to at least {least} bytes, or start a "
                "torch.distributed process group (DDP), whose ranks read one node window together"
            ) from None
        prefix = "StreamOptions." if str(exc).startswith("fetch_ahead") else ""
        raise ValueError(f"{cache.folder}: {prefix}{exc}") from None


def agree_on_window(window: int | None) -> int:
    """The smallest ``window`` of the job's ranks when a ``torch.distributed`` process group is up, else ``window``.

    Through the default group's key-value store, not a collective: each rank writes its window under a key of this
    agreement (the n-th streaming loader of each rank: every rank builds its loaders in the same order) and waits
    up to :data:`AGREEMENT_TIMEOUT_S` for the others'. So a rank whose peers never build their loader raises a
    :class:`~dali_pipes.LoaderError` naming them, and the collectives that both sides make next (``DDP(model)``'s
    broadcast) still match. ``None``: this rank failed to open its stream; it says so at once (the others raise
    a :class:`~dali_pipes.LoaderError` naming it, without waiting) and returns ``0``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0 if window is None else window
    from torch.distributed.distributed_c10d import _get_default_store

    store, rank, world = _get_default_store(), dist.get_rank(), dist.get_world_size()
    # Keys left in the store: a few bytes a rank per loader, and no rank knows when the others have read them.
    prefix = f"{AGREEMENT_KEY}/{next(_AGREEMENTS)}"
    store.set(f"{prefix}/{rank}", str(0 if window is None else window))
    done = f"{prefix}/outcome"  # set once: "all", "failed R" or "abandoned R" (compare_set keeps the first)
    if window is None:
        store.compare_set(done, "", f"failed {rank}")
        return 0
    if store.add(f"{prefix}/arrived", 1) == world:
        store.compare_set(done, "", "all")
    outcome = _await_outcome(store, done, rank)
    if outcome == f"abandoned {rank}":
        late = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
        raise LoaderError(
            f"rank {rank}: rank(s) {_ranks(late)} did not build their streaming loader within "
            f"{AGREEMENT_TIMEOUT_S:g} s of this one: {_SAME_POINT}"
        )
    kind, _, who = outcome.partition(" ")
    if kind == "failed":
        raise LoaderError(
            f"rank {rank}: rank {who} of the job could not open its stream (its error says why); this rank stops with it"
        )
    if kind == "abandoned":
        raise LoaderError(f"rank {rank}: rank {who} stopped waiting for this rank's streaming loader: {_SAME_POINT}")
    return min(int(store.get(f"{prefix}/{r}")) for r in range(world))  # multi_get: torch >= 2.4 only


_SAME_POINT = (
    "every rank must build its streaming loader (DataOptions(stream=...)) at the same point of the script, "
    "in the same order, so that the ranks agree on its window; build it on every rank, not on some only"
)


def _await_outcome(store: "dist.Store", done: str, rank: int) -> str:
    """The agreement's outcome at ``done``, waited for up to :data:`AGREEMENT_TIMEOUT_S`; ``"abandoned RANK"``
    (this rank's) when it timed out, unless another outcome came first."""
    import torch.distributed as dist

    try:
        store.wait([done], datetime.timedelta(seconds=AGREEMENT_TIMEOUT_S))
    except getattr(dist, "DistStoreError", RuntimeError):  # torch < 2.2: a RuntimeError
        # Said in the store, so that a rank that comes later fails at once instead of reading alone.
        return store.compare_set(done, "", f"abandoned {rank}").decode()
    return store.get(done).decode()


def _ranks(ranks: list[int]) -> str:
    """``ranks`` for a message: the first eight, then how many more."""
    shown = ", ".join(map(str, ranks[:8]))
    return shown if len(ranks) <= 8 else f"{shown} and {len(ranks) - 8} more"
