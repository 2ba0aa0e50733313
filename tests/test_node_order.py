"""The partitioned order as the loader reads it (dali_pipes/sampling/node_order.py) and a node's window width
(dali_pipes/sampling/node_room.py): pure functions, no DALI.

What the loader relies on: every rank of a layout reads the epoch exactly once between them in equal batch
counts; its one-number position after ``k`` steps gives back ``k``, the rest of each rank's plan and each
partition's progress; that progress resumed on another layout (nodes, ranks per node, batch size, window)
reads exactly the samples not yet read.
"""

from __future__ import annotations

import numpy as np
import pytest

from dali_pipes.sampling import (
    NodeLayout,
    NodeOrder,
    PartitionedSampling,
    RankPlace,
    StreamProgress,
    least_cache_limit,
    node_window,
    shard_of,
)

SIZES = np.array([7, 9, 8, 8, 5, 9, 8, 8, 6, 8, 8, 3, 8, 8, 7, 8])  # 16 shards of uneven samples
N = int(SIZES.sum())


def orders(nodes: int, ranks: int, batch: int, window: int = 2, node_window: int = 4, last: str = "pad", **kw):
    sampling = PartitionedSampling(SIZES, window, partitions=8, **kw)
    layout = NodeLayout(nodes, ranks, batch, last)
    return [NodeOrder(sampling, RankPlace(layout, n, j), 5, node_window) for n in range(nodes) for j in range(ranks)]


def real(plan: tuple[np.ndarray, np.ndarray]) -> list[int]:
    return plan[0][~plan[1]].tolist()


@pytest.mark.parametrize(
    "nodes,ranks,batch,last", [(1, 1, 4, "pad"), (2, 2, 3, "pad"), (4, 2, 2, "pad"), (2, 3, 4, "drop")]
)
def test_every_layout_reads_the_epoch_once_in_equal_batches_from_its_nodes_partitions(nodes, ranks, batch, last):
    ranks_orders = orders(nodes, ranks, batch, last=last)
    plans = [o.rank_indices(1, 0) for o in ranks_orders]
    seen = sorted(i for plan in plans for i in real(plan))
    if last == "pad":
        assert seen == list(range(N))
    else:
        assert len(seen) == len(set(seen)) and N - len(seen) < nodes * ranks * batch + 8 * int(SIZES.max())
    assert len({len(p[0]) for p in plans}) == 1
    assert {o.batches(1, 0) for o in ranks_orders} == {-(-len(plans[0][0]) // batch)}
    for o, plan in zip(ranks_orders, plans):  # a node reads its own partitions' shards only, padding too
        mine = {int(k) for span in o.node_windows(1)[0] for k in span.shards}
        assert set(shard_of(plan[0], SIZES).tolist()) <= mine


@pytest.mark.parametrize("steps", [0, 1, 3, 5])
def test_the_position_after_some_steps_gives_back_the_rest_of_each_plan(steps):
    ranks_orders = orders(2, 2, 3)
    total = ranks_orders[0].batches(0, 0)
    position = ranks_orders[0].consumed(0, steps, 0, N)
    assert {o.consumed(0, steps, 0, N) for o in ranks_orders} == {position}
    for o in ranks_orders:
        full = o.rank_indices(0, 0)
        rest = o.rank_indices(0, position)
        assert o.batches(0, position) == total - steps
        assert o.per_rank(0, position) == len(full[0]) - steps * 3
        assert np.array_equal(rest[0], full[0][steps * 3 :]) and np.array_equal(rest[1], full[1][steps * 3 :])
    assert ranks_orders[0].consumed(0, total, 0, N) == N  # the last batch completes the epoch


def test_a_position_that_is_no_step_is_refused():
    order = orders(2, 2, 3)[0]
    with pytest.raises(ValueError, match="is not a step of this layout"):
        order.batches(0, 5)


@pytest.mark.parametrize("after", [(1, 4, 2), (4, 1, 5), (2, 2, 3), (8, 1, 1)])
def test_progress_resumed_on_another_layout_reads_exactly_the_rest(after):
    before = orders(2, 2, 3)
    position = before[0].consumed(2, 4, 0, N)
    read = [i for o in before for i in real(o.rank_indices(2, 0))[:12]]
    progress = before[0].progress(2, position)
    assert {o.progress(2, position) for o in before} == {progress} and sum(progress.consumed) == position
    nodes, ranks, batch = after
    resumed = orders(nodes, ranks, batch, window=3, node_window=6)  # this run's window differs: the saved one holds
    starts = {o.restore(StreamProgress(2, progress.consumed, progress.window)) for o in resumed}
    assert starts == {position}
    rest = [i for o in resumed for i in real(o.rank_indices(2, position))]
    assert sorted(read + rest) == list(range(N))
    assert resumed[0].sampling_of(2).window == 2 and resumed[0].sampling_of(3).window == 3
    again = resumed[0].consumed(2, 1, position, N)  # and the resumed run saves its own progress
    assert sum(resumed[0].progress(2, again).consumed) == again


def test_progress_of_another_partitioning_is_refused_by_name():
    order = orders(1, 1, 4)[0]
    with pytest.raises(
        ValueError, match=r"saved part-way in 4 partitions.*1, 2, 4 node\(s\) with StreamOptions\(partitions=4\)"
    ):
        order.restore(StreamProgress(0, (3, 3, 3, 3), 2))
    assert order.restore(StreamProgress(0, (0,) * 4, 2)) == 0  # an epoch's start resumes on any partitions


def test_a_node_window_fits_two_windows_and_a_shard_of_each_loader_in_the_limit():
    shards = [100] * 50
    one, two = node_window(2000, shards, loaders=1), node_window(2000, shards)
    assert (one.window, two.window) == (9, 4)  # (2000 // loaders - 100) // 2 // 100
    assert 2 * two.window * 100 + 100 <= 2000 // 2 and two.ahead == two.window
    assert two.budget == 1900 and 100 * (two.window + two.ahead) <= two.budget
    assert node_window(2000, shards, fetch_ahead=3).ahead == 3
    with pytest.raises(ValueError, match="fetch at most 15 ahead"):
        node_window(2000, shards, fetch_ahead=16)
    assert least_cache_limit(shards) == 600
    with pytest.raises(ValueError, match="raise cache_limit to at least 600 bytes.*loaders=1"):
        node_window(599, shards)
    whole = node_window(10_000, [100] * 40)
    assert (whole.window, whole.ahead) == (40, 0)  # the dataset in the read room: one window, nothing ahead


def test_a_state_saved_where_a_resumed_epoch_has_no_full_step_left_resumes_again():
    # "drop" on a layout that leaves the rest of the saved epoch no full step: nothing more is read, and the state
    # saved then is the one restored (it was the whole epoch, which its own count contradicted).
    before = orders(1, 1, 4, last="drop")[0]
    position = before.consumed(0, before.batches(0, 0) - 1, 0, N)
    progress = before.progress(0, position)
    after = orders(2, 2, 4, last="drop")[0]
    assert after.restore(progress) == position and after.batches(0, position) == 0
    assert after.progress(0, position).consumed == progress.consumed


def test_a_saved_window_wider_than_this_runs_cache_holds_is_refused_by_name():
    saved = orders(2, 2, 3, window=3, node_window=6)[0]
    progress = saved.progress(0, saved.consumed(0, 2, 0, N))
    narrow = orders(2, 2, 3, window=1, node_window=2)[0]
    with pytest.raises(ValueError, match="windows of 3 shard.*holds windows of 2 shard.*cache_limit it was saved with"):
        narrow.restore(progress)


def test_the_resumed_epoch_read_again_from_its_start_forgets_the_saved_progress():
    before = orders(2, 1, 3)[0]
    progress = before.progress(1, before.consumed(1, 3, 0, N))
    order = orders(1, 2, 4)[0]
    order.restore(progress)
    whole = order.rank_indices(1, 0)  # the epoch again from its start (set_epoch(1) with no state)
    later = order.consumed(1, 5, 0, N)
    assert sum(order.progress(1, later).consumed) == later
    assert np.array_equal(order.rank_indices(1, later)[0], whole[0][5 * 4 :])


def test_a_cache_that_holds_every_shard_reads_each_partition_as_one_window():
    order = orders(1, 2, 4, window=len(SIZES), node_window=len(SIZES))[0]
    assert order.holds_all and order.layout_of(0).together == 8
    spans = order.node_windows(0)[0]
    assert len(spans) == 8 and all(s.start < 8 for s in spans)  # all begun within the first 8 positions
