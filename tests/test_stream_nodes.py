"""Streaming on several nodes (issue 55): each node downloads only its share, and a state moves between layouts.

Nodes are simulated as torchrun lays them out: ranks in a gloo process group with ``LOCAL_WORLD_SIZE`` and
``GROUP_RANK`` set, each node's ranks sharing a cache folder of their own, of a tenth of the dataset, reading
the dataset from the loopback S3-protocol server (tests/conftest.py). Real processes: minutes on 2 cores, so
the slow stage.
"""

from __future__ import annotations

import pytest
from test_streaming_loader import LIMIT, SHARDS, N, real_of, run_ranks, shard_gets, streamed  # noqa: F401

from dali_pipes.sampling import NodeLayout, NodeOrder, PartitionedSampling, RankPlace, partition_window

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def layout(nodes: int, ranks: int, tmp_path, data, **extra) -> dict:
    """``run_ranks`` options for ``nodes`` simulated nodes of ``ranks`` ranks, a cache folder each."""
    world = nodes * ranks
    env = [
        {"LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": str(r // ranks), "LOCAL_RANK": str(r % ranks)}
        for r in range(world)
    ]
    stream = [{"cache_limit": LIMIT, "folder": str(tmp_path / f"node-{r // ranks}")} for r in range(world)]
    return {"stream": stream, "env": env, "storage": data.storage_options, "group": True, **extra}


def next_epoch_reach(nodes: int, ranks: int, node_window: int, batches: int = 6) -> set[str]:
    """The shards the nodes may fetch across the epoch's edge: the windows of the next epoch's first ``batches``
    steps (DALI reads that far ahead into it) and a node window fetched ahead of them, on every node."""
    sizes = [4] * (SHARDS - 1) + [N - 4 * (SHARDS - 1)]
    window, _ = partition_window(node_window, 8, nodes)
    sampling = PartitionedSampling(sizes, window, 8)
    reach = set()
    for node in range(nodes):
        order = NodeOrder(sampling, RankPlace(NodeLayout(nodes, ranks, 4), node, 0), 0, node_window)
        spans = order.node_windows(1)[0]
        early = [k for span in spans if span.start < batches * 4 * ranks for k in span.shards]
        later = [k for span in spans if span.start >= batches * 4 * ranks for k in span.shards]
        reach |= {f"shard-{k:05d}.lmdb" for k in early + later[:node_window]}
    return reach


def test_four_nodes_download_the_dataset_once_and_a_state_resumes_on_two(tmp_path, s3, streamed):  # noqa: F811
    url, data = streamed
    s3.proxy.requests.clear()
    whole = run_ranks(8, url, tmp_path / "whole", **layout(4, 2, tmp_path / "a", data))
    gets = shard_gets(s3)
    assert sorted(sum((real_of(r) for r in whole), [])) == list(range(N))
    assert len({len(r["batches"]) for r in whole}) == 1
    # Each shard by one node: the nodes download at most 5% more than the dataset, but for what they fetch across
    # the epoch's edge (this dataset's epoch is 10 steps: the 6 DALI reads ahead are most of it).
    assert set(gets) == {f"shard-{k:05d}.lmdb" for k in range(SHARDS)}
    reach = next_epoch_reach(4, 2, whole[0]["window"])
    again = [name for name in gets if gets.count(name) > 1]
    assert set(again) <= reach and max(gets.count(name) for name in gets) <= 2
    assert len(gets) - len(again) / 2 <= 1.05 * SHARDS, (len(gets), len(again))
    assert all(0 < r["peak"] <= r["limit"] == LIMIT for r in whole)

    first = run_ranks(8, url, tmp_path / "first", **layout(4, 2, tmp_path / "b", data, stop=4))
    state = first[0]["state"]
    assert all(r["state"] == state for r in first) and len(state["stream"]["consumed"]) == 8
    rest = run_ranks(8, url, tmp_path / "rest", **layout(2, 4, tmp_path / "c", data, state=state))
    seen = sum((real_of(r) for r in first + rest), [])
    assert sorted(seen) == list(range(N))  # exactly the rest: none twice, none left out
    assert len({len(r["batches"]) for r in rest}) == 1
