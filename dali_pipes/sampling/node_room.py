"""How wide a node's streamed windows are: the one rule the loader, ``dali-pipes mixing`` and the examples use.

A node's ranks read one stream together (:mod:`dali_pipes.sampling.partitioned`): at each step they read
consecutive stretches of it, so they hold the same windows, and a shard pinned by several of them counts
once in the cache. What the cache must hold for one loader's reads, however many ranks the node runs:

- the windows being read: one of each partition the node reads at once, and, while the reads cross into
  the next window (a batch, or the ranks of one step, on both sides of the edge), the next one too: two
  *node windows*;
- one largest shard for a read outside them (an epoch's padding, a shard fetched again after a failure).

That is the loader's *read room*, ``cache_limit // loaders - largest``: ``loaders`` (2 by default) loaders
of the dataset may read on the node at once (training and an evaluation of the training set, two jobs of a
sweep) and each one's reads then still fit. The rest of the limit holds shards fetched ahead, by default
one node window (every limit the rule takes has room for one shard ahead at least): they take only room no
other pin uses and are given up to any loader's reads (:mod:`dali_pipes.staging.cache_pins`).

The node window does not depend on the ranks a node runs, so a state resumes on any number of ranks per node
with the same windows. Counted in the largest shards: which shards share a window changes every epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dali_pipes.sampling.rules import check_int
from dali_pipes.sampling.windowed import _largest_that_fit, checked_shard_sizes  # the one count of fitting shards

__all__ = ["DEFAULT_LOADERS", "NodeWindow", "least_cache_limit", "node_window"]

#: Loaders of one dataset that may read on a node at once, each within its read room, by default.
DEFAULT_LOADERS = 2


@dataclass(frozen=True)
class NodeWindow:
    """A node's streamed windows: ``window`` shards read at once (over the partitions it reads together),
    ``ahead`` shards fetched ahead of them, all pinned within ``budget`` bytes (the limit less one largest
    shard); ``read_room``: the bytes this loader's reads may pin (two windows and a shard)."""

    window: int
    ahead: int
    budget: int
    read_room: int


def least_cache_limit(shard_bytes: Sequence[int] | np.ndarray, loaders: int = DEFAULT_LOADERS) -> int:
    """The smallest ``cache_limit`` :func:`node_window` takes: two windows of one shard and one shard more, each of
    ``loaders`` loaders."""
    return 3 * int(checked_shard_sizes(shard_bytes).max()) * check_int("loaders", loaders, 1)


def node_window(
    cache_limit: int,
    shard_bytes: Sequence[int] | np.ndarray,
    loaders: int = DEFAULT_LOADERS,
    fetch_ahead: int | None = None,
) -> NodeWindow:
    """The node window of a cache of ``cache_limit`` bytes (see the module docstring).

    A dataset whose shards fit in the read room is one window (a shuffle over the node's whole share, nothing
    to fetch ahead); so is one that fits in the limit with ``loaders=1``. ``fetch_ahead``: shards fetched ahead
    (default: one window, the next). Refuses (``ValueError``, saying what to raise) a limit below
    :func:`least_cache_limit` and a ``fetch_ahead`` beyond the room the windows leave."""
    limit = check_int("cache_limit", cache_limit, 1)
    sizes = checked_shard_sizes(shard_bytes)
    loaders = check_int("loaders", loaders, 1)
    largest, total = int(sizes.max()), int(sizes.sum())
    least = least_cache_limit(sizes, loaders)
    room = limit // loaders - largest
    budget = limit - largest
    if total <= room or (loaders == 1 and total <= budget):
        return NodeWindow(len(sizes), 0, budget, room)
    if limit < least:
        raise ValueError(
            f"a cache_limit of {limit} bytes read by {loaders} loader(s) of the dataset at once leaves {max(room, 0)} "
            f"bytes a loader, less than two windows of one shard and one read outside them (the largest shard: "
            f"{largest} bytes); raise cache_limit to at least {least} bytes"
            + (", or give StreamOptions(loaders=1) when one loader of it reads on the node" if loaders > 1 else "")
        )
    window = max(1, _largest_that_fit(room, sizes) // 2)
    spare = _largest_that_fit(budget, sizes) - window
    if fetch_ahead is None:
        return NodeWindow(window, max(0, min(window, spare)), budget, room)
    ahead = check_int("fetch_ahead", fetch_ahead, 0)
    if ahead > spare:
        raise ValueError(
            f"fetch_ahead={ahead} does not fit: {budget} bytes hold {window + spare} of the largest shards "
            f"({largest} bytes), {window} of them a window being read; fetch at most {spare} ahead, or raise the "
            "cache's limit"
        )
    return NodeWindow(window, ahead, budget, room)
