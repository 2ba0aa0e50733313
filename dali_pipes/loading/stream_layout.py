"""Where a streaming rank reads: its node, the node's ranks, and the partitions the dataset's shards are dealt to.

A streamed epoch is partitioned (:mod:`dali_pipes.sampling.partitioned`): the shards are dealt to ``P``
partitions, each node reads only its partitions' shards, and the node's ranks read its stream together. So a
rank needs its place (:func:`rank_place`): ``R`` ranks a node (``StreamOptions(node_ranks=...)``, else
``LOCAL_WORLD_SIZE``, which torchrun sets, else the whole job on one node), ``N = world_size / R`` nodes, node
``rank // R`` and rank ``rank % R`` in it, as torchrun numbers them (``GROUP_RANK``, when set, is checked
against it). ``P`` (:func:`choose_partitions`): ``StreamOptions(partitions=...)``, else 8, so that 1, 2, 4 and
8 nodes resume each other's states, made a multiple of ``N`` for other node counts and fewer when the dataset
has fewer shards.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Sequence

import numpy as np

from dali_pipes.sampling import EpochRules
from dali_pipes.sampling.node_order import RankPlace
from dali_pipes.sampling.partitioned import DEFAULT_PARTITIONS, NodeLayout

if TYPE_CHECKING:
    from dali_pipes.loading.config import StreamOptions

__all__ = ["choose_partitions", "node_ranks", "rank_place"]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def node_ranks(stream: "StreamOptions", world_size: int) -> int:
    """The job's ranks on each node: ``stream.node_ranks``, else ``LOCAL_WORLD_SIZE``, else ``world_size`` (the job
    on one node); 1 for a job of one rank. Refuses a ``node_ranks`` that ``LOCAL_WORLD_SIZE`` contradicts, and a
    count that does not divide the world size (every node must run as many ranks)."""
    if world_size == 1:
        return 1  # a loader of one rank reads the whole order, whatever else runs on its node
    local = _env_int("LOCAL_WORLD_SIZE")
    ranks = stream.node_ranks if stream.node_ranks is not None else local if local is not None else world_size
    if stream.node_ranks is not None and local is not None and local != stream.node_ranks:
        raise ValueError(
            f"StreamOptions(node_ranks={stream.node_ranks}) but LOCAL_WORLD_SIZE={local} ranks run on this node: "
            "leave node_ranks out (torchrun's LOCAL_WORLD_SIZE says it), or give the ranks each node runs"
        )
    if world_size % ranks:
        raise ValueError(
            f"{world_size} ranks do not fill nodes of {ranks} rank(s) each: a streamed epoch deals the shards to "
            "nodes of equal rank counts; give StreamOptions(node_ranks=R) with R dividing the world size"
        )
    return ranks


def rank_place(stream: "StreamOptions", rules: EpochRules) -> RankPlace:
    """This rank's place in the partitioned order (see the module docstring)."""
    world = rules.world
    ranks = node_ranks(stream, world.world_size)
    node, local_rank = divmod(world.rank, ranks)
    group = _env_int("GROUP_RANK") if world.world_size > 1 else None
    if group is not None and group != node:
        raise ValueError(
            f"rank {world.rank} of {world.world_size} with {ranks} rank(s) a node is on node {node} in torchrun's "
            f"numbering, but GROUP_RANK={group}: give StreamOptions(node_ranks=...) the ranks each node runs"
        )
    layout = NodeLayout(world.world_size // ranks, ranks, rules.batch_size, rules.last_batch)
    return RankPlace(layout, node, local_rank)


def choose_partitions(stream: "StreamOptions", shard_samples: Sequence[int] | np.ndarray, nodes: int) -> int:
    """``P``: ``stream.partitions``, else 8 made a multiple of the node count (the least common multiple), as many
    as the shards with samples allow (at least one each); refuses a count the nodes cannot share."""
    nonempty = int(np.count_nonzero(np.asarray(shard_samples)))
    if stream.partitions is not None:
        partitions = stream.partitions
    else:
        per_node = math.lcm(DEFAULT_PARTITIONS, nodes) // nodes  # 8 // N for 1, 2, 4 and 8 nodes
        fitting = [nodes * m for m in range(per_node, 0, -1) if per_node % m == 0 and nodes * m <= nonempty]
        partitions = fitting[0] if fitting else nodes
    if partitions % nodes or partitions > nonempty:
        raise ValueError(
            f"StreamOptions(partitions={partitions}) for {nodes} node(s) and {nonempty} shard(s) with samples: every "
            "node needs as many partitions, and every partition a shard; give a multiple of the node count up to "
            f"{nonempty} (or write the dataset in more shards)"
            if stream.partitions is not None
            else f"{nodes} nodes but the dataset has {nonempty} shard(s) with samples: a node streams whole shards, "
            "so run on at most that many nodes, or write the dataset in more shards (dali-pipes convert --shard-size)"
        )
    return partitions
