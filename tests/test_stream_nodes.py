"""Streaming on several nodes (issue 55): each node downloads only its share, and a state moves between layouts.

Nodes are simulated as torchrun lays them out: ranks in a gloo process group with ``LOCAL_WORLD_SIZE`` and
``GROUP_RANK`` set, each node's ranks sharing a cache folder of their own, of a tenth of the dataset, reading
the dataset from the loopback S3-protocol server (tests/conftest.py). Real processes: minutes on 2 cores, so
the slow stage.
"""

from __future__ import annotations

import pytest
from test_streaming_loader import LIMIT, SHARDS, N, real_of, run_ranks, shard_gets, streamed  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def layout(nodes: int, ranks: int, tmp_path, data, **extra) -> dict:
    """``run_ranks`` options for ``nodes`` simulated nodes of ``ranks`` ranks, a cache folder each."""
    world = nodes * ranks
    env = [
        {"LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": str(r // ranks), "LOCAL_RANK": str(r % ranks)}
        for r in range(world)
    ]
    stream = [{"cache_limit": LIMIT, "folder": str(tmp_path / f"node-{r // ranks}")} for r in range(world)]
    return {"stream": stream, "env": env, "storage": data.storage_options, "group": True, "batch_size": 8, **extra}


def test_four_nodes_download_the_dataset_once_and_a_state_resumes_on_two(tmp_path, s3, streamed):  # noqa: F811
    url, data = streamed
    s3.proxy.requests.clear()
    whole = run_ranks(8, url, tmp_path / "whole", **layout(4, 2, tmp_path / "a", data))
    gets = shard_gets(s3)
    assert sorted(sum((real_of(r) for r in whole), [])) == list(range(N))
    assert len({len(r["batches"]) for r in whole}) == 1
    # Each shard by one node: at most 5% more than the dataset (every node reading every shard: 320 here; a padding
    # row may bring back a shard its node read). Batches of 8: 5 steps an epoch, too few for DALI to read on into
    # the next epoch, whose first shards would come again.
    assert set(gets) == {f"shard-{k:05d}.lmdb" for k in range(SHARDS)} and len(gets) <= 1.05 * SHARDS, len(gets)
    assert all(0 < r["peak"] <= r["limit"] == LIMIT for r in whole)

    first = run_ranks(8, url, tmp_path / "first", **layout(4, 2, tmp_path / "b", data, stop=2))
    state = first[0]["state"]
    assert all(r["state"] == state for r in first) and len(state["stream"]["consumed"]) == 8
    rest = run_ranks(8, url, tmp_path / "rest", **layout(2, 4, tmp_path / "c", data, state=state))
    seen = sum((real_of(r) for r in first + rest), [])
    assert sorted(seen) == list(range(N))  # exactly the rest: none twice, none left out
    assert len({len(r["batches"]) for r in rest}) == 1
