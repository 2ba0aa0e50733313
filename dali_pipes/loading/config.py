"""The two option groups of :class:`~dali_pipes.DALILoader` beyond what a ``DataLoader`` user sets.

``DALILoader(path, spec, batch_size=..., shuffle=..., seed=..., last_batch=...,
batch_format=..., sampling=...)`` reads as a ``DataLoader``; the rest is grouped
here, each group checked when it is made so that a bad value is refused before a
loader copies or starts anything:

- :class:`RunOptions`: where the loader runs (device, rank, world size) and how hard it
  works (DALI's threads, reader processes, prefetch, how the processes start, batch
  reads, a ``dali-pipes tune`` settings file);
- :class:`DataOptions`: where the data is read from (a staged copy, a RAM cache,
  object storage's options, a stream through a bounded cache: :class:`StreamOptions`).

Both are frozen: one value can be shared by every loader of a script.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from dali_pipes.dataset.sizes import SizeError, parse_size
from dali_pipes.sampling import check_int
from dali_pipes.sampling.node_room import DEFAULT_LOADERS
from dali_pipes.staging.ramcache import CACHE_KINDS

__all__ = ["DEVICES", "START_METHODS", "DataOptions", "RunOptions", "StreamOptions"]

#: What ``RunOptions.device`` takes: this rank's GPU when CUDA is there ("auto"), a GPU, or the CPU.
DEVICES = ("auto", "gpu", "cuda", "cpu")
#: How DALI starts its reader processes; ``None``: fork, or spawn once the CUDA driver is initialised.
START_METHODS = (None, "fork", "spawn")


@dataclass(frozen=True)
class RunOptions:
    """Where a :class:`~dali_pipes.DALILoader` runs and how hard it works; every field has a default.

    ``device``: ``"auto"`` (this rank's GPU, ``LOCAL_RANK``, when CUDA is available, else the
    CPU), ``"gpu"`` or ``"cpu"``. ``rank`` and ``world_size``: from ``torch.distributed`` when
    it is initialised (explicit values must agree with it), else ``RANK``/``WORLD_SIZE``, else
    0 of 1.

    ``num_threads``: DALI's CPU threads (default: this rank's share of the cores,
    ``cores_per_rank``, where the GPU decodes images, else 4 or that share if fewer).
    ``py_num_workers``: the Python processes reading the store (0: the loader's process reads;
    default 0 for LMDB and HDF5 batch reads, one per 4 cores of the rank (2 to 8) where the GPU
    decodes images on 8 cores or more, a few for other formats). An INFO line says which counts
    were chosen and why. ``prefetch``: the batches DALI prepares ahead (default 2).
    ``py_start_method``: ``"fork"`` or ``"spawn"``; by default fork, or spawn once the CUDA driver
    is initialised in this process (DALI cannot fork then; ``torch.cuda.is_available()``
    initialises it), and spawn needs the script's code under ``if __name__ == "__main__":``.
    ``batch_reads``: one call into the store per batch, sorted and coalesced per shard (default);
    ``False`` reads sample by sample, the same samples in the same order. ``settings``: a file
    written by ``dali-pipes tune``, whose counts fill in those left unset and whose decoder hints
    go to the pipeline spec.
    """

    device: str = "auto"
    rank: int | None = None
    world_size: int | None = None
    num_threads: int | None = None
    py_num_workers: int | None = None
    prefetch: int | None = None
    py_start_method: str | None = None
    batch_reads: bool = True
    settings: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"RunOptions.device must be 'auto', 'gpu' or 'cpu', got {self.device!r}")
        if self.py_start_method not in START_METHODS:
            raise ValueError(
                f"RunOptions.py_start_method must be 'fork', 'spawn' or None, got {self.py_start_method!r}"
            )
        for name, least in (("num_threads", 1), ("py_num_workers", 0), ("prefetch", 1), ("rank", 0), ("world_size", 1)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(check_int(f"RunOptions.{name}", getattr(self, name), least)))
        if not isinstance(self.batch_reads, (numbers.Integral, np.bool_)) or self.batch_reads not in (0, 1):
            raise TypeError(f"RunOptions.batch_reads must be True or False, got {self.batch_reads!r}")
        object.__setattr__(self, "batch_reads", bool(self.batch_reads))  # numpy's bool_ and 0/1 too


@dataclass(frozen=True)
class StreamOptions:
    """How ``DataOptions(stream=...)`` reads a dataset through a bounded cache instead of a full copy.

    ``cache_limit``: the most bytes of shards the node's cache folder holds, a number of bytes or a size
    such as ``"40GiB"`` (2**30 bytes a GiB) or ``"400GB"`` (10**9 a GB) (for example a tenth of the
    dataset; at least six of its largest shards). The epoch order is then partitioned
    (:mod:`dali_pipes.sampling.partitioned`): the shards are dealt to ``partitions``, each node reads only
    its own partitions' shards, window by window, its ranks together, the samples of a window shuffled
    together (``dali-pipes mixing`` shows what that does to the classes of a batch). A node's windows are
    as wide as its cache allows (:func:`~dali_pipes.sampling.node_room.node_window`), whatever its ranks.

    ``folder``: the cache folder (default: ``stream/`` under ``$DALI_PIPES_CACHE``, else
    ``~/.cache/dali-pipes``, a sub-folder per dataset); put it on a local disk, not a network one.
    ``node_ranks``: the job's ranks on each node (default ``LOCAL_WORLD_SIZE``, which torchrun sets, else the
    whole job on one node). ``fetch_ahead``: shards downloaded ahead of the windows being read (default: a
    node window, so the next one is there when the reads reach it). ``downloads``: shards downloaded at
    once (default: enough for :data:`~dali_pipes.loading.stream_engine.BYTES_IN_FLIGHT` in flight, 4 to 32: a
    server's latency is paid for each shard, so small shards need more at once). ``partitions``: how many parts the shards are dealt to (default 8, a multiple of the node count:
    1, 2, 4 and 8 nodes resume each other's states mid-epoch). ``loaders``: the loaders of this dataset that
    may read on a node at once (default 2: training and an evaluation of the training set, or two jobs of a
    sweep), each within ``cache_limit // loaders``. A :class:`~dali_pipes.Mixture` streams each of its datasets through
    a cache folder of its own, with its share of ``cache_limit`` (by its bytes an epoch:
    :mod:`dali_pipes.loading.mixture_stream`).
    """

    cache_limit: int | str
    folder: str | os.PathLike | None = None
    node_ranks: int | None = None
    fetch_ahead: int | None = None
    downloads: int | None = None
    partitions: int | None = None
    loaders: int = DEFAULT_LOADERS

    def __post_init__(self) -> None:
        if isinstance(self.cache_limit, str):  # "40GiB", "10GB": read as every size flag is
            try:
                object.__setattr__(self, "cache_limit", parse_size(self.cache_limit))
            except SizeError as exc:
                raise ValueError(f"StreamOptions.cache_limit: {exc}") from None
        bad = isinstance(self.cache_limit, bool) or not isinstance(self.cache_limit, numbers.Real)
        if bad or self.cache_limit < 1 or int(self.cache_limit) != self.cache_limit:
            raise ValueError(
                "StreamOptions.cache_limit must be a positive whole number of bytes or a size such as '40GiB', "
                f"got {self.cache_limit!r}"
            )
        object.__setattr__(self, "cache_limit", int(self.cache_limit))
        for name, least in (("node_ranks", 1), ("fetch_ahead", 0), ("partitions", 1), ("downloads", 1)):
            if getattr(self, name) is not None:  # None: chosen at the open
                object.__setattr__(self, name, int(check_int(f"StreamOptions.{name}", getattr(self, name), least)))
        object.__setattr__(self, "loaders", int(check_int("StreamOptions.loaders", self.loaders, 1)))


@dataclass(frozen=True)
class DataOptions:
    """Where a :class:`~dali_pipes.DALILoader` reads its dataset from; every field has a default.

    ``stage_to``: copy the dataset to a local folder (a local disk, or a tmpfs such as
    ``/dev/shm/NAME``) before the first epoch and read it there: one process per folder copies,
    the others on the node wait for it, and a complete copy is reused
    (:mod:`dali_pipes.staging.stage`). A URL of object storage (``s3://``, ``gs://``, ``az://``,
    ``hf://``) is staged into ``stage_to``, or without it into a cache folder
    (``$DALI_PIPES_CACHE``, else ``~/.cache/dali-pipes``), its room checked first.

    ``cache="ram"``: hold the shards this rank reads in shared memory, within ``cache_bytes``
    (default: half the free memory, split between the node's ranks), the rest read from disk
    (:mod:`dali_pipes.staging.ramcache`). ``storage_options``: for the fsspec backend of a URL
    (credentials, ``endpoint_url``); never logged nor shown in this object's ``repr``.

    ``stream=StreamOptions(cache_limit=BYTES)``: read the dataset (a URL, or a folder on a slow
    filesystem) without a full copy, through a cache folder of the node that never holds more than
    ``cache_limit`` bytes of its shards, in a shard-windowed epoch order (:class:`StreamOptions`,
    :mod:`dali_pipes.loading.streaming`). Not with ``stage_to`` nor ``cache="ram"``.
    """

    stage_to: str | os.PathLike | None = None
    cache: str | None = None
    cache_bytes: int | None = None
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    stream: StreamOptions | None = None

    def __post_init__(self) -> None:
        self._check_stream()
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"DataOptions.cache must be None or 'ram', got {self.cache!r}")
        if self.cache_bytes is not None:
            if self.cache != "ram":
                raise ValueError("DataOptions.cache_bytes is the budget of cache='ram'; pass cache='ram' too")
            bad = isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, numbers.Real)
            if bad or self.cache_bytes < 0:  # 0 caches nothing; 16e9 is a number of bytes too
                raise ValueError(
                    f"DataOptions.cache_bytes must be a non-negative number of bytes, got {self.cache_bytes!r}"
                )
            if isinstance(self.cache_bytes, numbers.Integral):
                object.__setattr__(self, "cache_bytes", int(self.cache_bytes))
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(
                "DataOptions.storage_options must be a dict of fsspec options such as {'endpoint_url': ...}, "
                f"got {type(self.storage_options).__name__}"
            )

    def _check_stream(self) -> None:
        """``stream``: a :class:`StreamOptions`, with neither staging nor a RAM cache."""
        if self.stream is None:
            return
        if not isinstance(self.stream, StreamOptions):
            raise TypeError(
                "DataOptions.stream takes StreamOptions(cache_limit=BYTES), the most the node's cache folder may "
                f"hold (for example a tenth of the dataset, and at least a few shards), got {self.stream!r}"
            )
        if self.stage_to is not None:
            raise ValueError(
                "DataOptions(stream=...) reads through a bounded cache instead of a full copy: leave out stage_to "
                "(or leave out stream= to stage the whole dataset)"
            )
        if self.cache is not None:
            raise ValueError(
                "DataOptions(stream=...) does not take cache='ram': the streamed shards are in the cache folder; "
                "leave out cache='ram' (or stage the dataset, stage_to=..., to cache it in RAM)"
            )
