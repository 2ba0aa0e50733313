"""The partitioned streamed order: each node reads only its partitions' shards, exactly once, resumable across
ranks per node and node counts (pure functions: no I/O)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dali_pipes.sampling import (
    DEFAULT_PARTITIONS,
    NodeLayout,
    PartitionedSampling,
    deal_shards,
    default_partitions,
    node_bytes,
    node_partitions,
    node_window_spans,
    partition_stream,
    partition_window,
    partitioned_num_batches,
    partitioned_progress,
    partitioned_rank_indices,
    shard_of,
    shards_needed,
)


def run(sampling, layout, epoch=0, seed=0, start=None):
    """{(node, rank): (indices, is_pad)} for every rank of the job."""
    return {
        (n, r): partitioned_rank_indices(sampling, layout, n, r, epoch, seed, start)
        for n in range(layout.nodes)
        for r in range(layout.ranks)
    }


def read(per_rank, batch_size, first=0, last=None):
    """The real samples read in steps [first, last) by all ranks, as a list (repeats kept)."""
    lo, hi = first * batch_size, None if last is None else last * batch_size
    return [int(i) for idx, pad in per_rank.values() for i in idx[lo:hi][~pad[lo:hi]]]


def node_shards(sampling, nodes, node, epoch=0, seed=0):
    dealt = deal_shards(sampling, epoch, seed)
    return {int(k) for p in node_partitions(node, nodes, sampling.partitions) for k in dealt[p]}


@st.composite
def setups(draw, max_shards=24):
    """A dataset, a partitioned sampling of it, and a layout whose node count divides its partitions."""
    sizes = draw(st.lists(st.integers(0, 30), min_size=1, max_size=max_shards).filter(lambda s: any(s)))
    nonempty = sum(1 for s in sizes if s)
    partitions = draw(st.sampled_from([p for p in (1, 2, 3, 4, 6, 8) if p <= nonempty]))
    sampling = PartitionedSampling(
        sizes,
        window=draw(st.integers(1, 4)),
        partitions=partitions,
        shuffle=draw(st.booleans()),
        redeal=draw(st.booleans()),
    )
    return sampling, draw(layouts(partitions))


@st.composite
def layouts(draw, partitions, last_batch=None):
    nodes = draw(st.sampled_from([n for n in range(1, partitions + 1) if partitions % n == 0]))
    last = draw(st.sampled_from(["pad", "drop"])) if last_batch is None else last_batch
    together = draw(st.one_of(st.none(), st.integers(1, 3)))
    return NodeLayout(nodes, draw(st.integers(1, 3)), draw(st.integers(1, 5)), last, together)


@settings(max_examples=80, deadline=None)
@given(setup=setups(), epoch=st.integers(0, 3), seed=st.integers(0, 2**32))
def test_exactly_once_equal_batches_and_node_locality(setup, epoch, seed):
    sampling, layout = setup
    per_rank = run(sampling, layout, epoch, seed)
    total = int(sampling.shard_sizes.sum())
    batches = partitioned_num_batches(sampling, layout, epoch, seed)
    lengths = {len(idx) for idx, _ in per_rank.values()}
    assert len(lengths) == 1  # every rank of the job reads as many samples: the same batches, the same sizes
    assert -(-lengths.pop() // layout.batch_size) == batches
    seen = read(per_rank, layout.batch_size)
    assert len(seen) == len(set(seen))  # never twice
    if layout.last_batch == "pad":
        assert sorted(seen) == list(range(total))  # every sample, once
    else:
        assert not any(pad.any() for _, pad in per_rank.values())
    for (n, _), (idx, _) in per_rank.items():  # padding included: a node touches only its partitions' shards
        assert set(shard_of(idx, sampling.shard_sizes).tolist()) <= node_shards(sampling, layout.nodes, n, epoch, seed)
    # Deterministic: the same arguments give the same arrays.
    again = partitioned_rank_indices(sampling, layout, layout.nodes - 1, layout.ranks - 1, epoch, seed)
    assert all(np.array_equal(a, b) for a, b in zip(again, per_rank[(layout.nodes - 1, layout.ranks - 1)]))


@settings(max_examples=50, deadline=None)
@given(setup=setups(), data=st.data())
def test_resume_on_another_layout_reads_exactly_the_rest(setup, data):
    """A state after any step, resumed on other ranks per node, batch size and node count (dividing P): what was
    read before and what is read after are every sample once; twice over, a resume of a resume. A "drop" pass
    taken to its end completes the epoch: its dropped rest counts as read."""
    sampling, before = setup
    total, seen, dropped, start = int(sampling.shard_sizes.sum()), [], [], None
    dealt = deal_shards(sampling, 1, 7)
    streams = [partition_stream(sampling, dealt, p, 1, 7) for p in range(sampling.partitions)]
    for layout in (before, data.draw(layouts(sampling.partitions)), data.draw(layouts(sampling.partitions))):
        steps = data.draw(st.integers(0, partitioned_num_batches(sampling, layout, 1, 7, start)))
        seen += read(run(sampling, layout, 1, 7, start), layout.batch_size, 0, steps)
        start = partitioned_progress(sampling, layout, 1, 7, steps, start)
        # The state says exactly what was read: a prefix of each partition's stream.
        done = sorted(int(i) for p, c in enumerate(start) for i in streams[p][:c])
        new = sorted(set(done) - set(seen) - set(dropped))
        assert not new or layout.last_batch == "drop"
        dropped += new
        assert done == sorted(seen + dropped)
    last = data.draw(layouts(sampling.partitions, "pad"))
    seen += read(run(sampling, last, 1, 7, start), last.batch_size)
    assert len(seen) == len(set(seen)) and sorted(seen + dropped) == list(range(total))


def test_two_nodes_of_four_ranks_resume_four_nodes_of_two_at_every_step():
    sizes = [37, 41, 40, 40, 39, 40, 44, 40, 40, 38, 40, 40, 3, 40, 40, 40]
    sampling = PartitionedSampling(sizes, window=2)
    four, two = NodeLayout(4, 2, 5), NodeLayout(2, 4, 5)
    total, first = sum(sizes), run(sampling, four)
    for step in range(partitioned_num_batches(sampling, four, 0, 0) + 1):
        state = partitioned_progress(sampling, four, 0, 0, step)
        rest = run(sampling, two, start=state)
        done, after = read(first, 5, 0, step), read(rest, 5)
        assert sorted(done + after) == list(range(total)), step
        assert sum(state) == len(done)
        for (n, _), (idx, _) in rest.items():  # still a node's own partitions only
            assert set(shard_of(idx, sizes).tolist()) <= node_shards(sampling, 2, n)


def test_each_of_four_nodes_downloads_a_quarter_and_all_together_the_dataset_once():
    # The ImageNet-like layout: 1,024 shards of 1,251 samples, 140 MB each, 4 nodes.
    sampling = PartitionedSampling([1251] * 1024, window=51)
    shard_bytes = np.full(1024, 140_000_000)
    for epoch in range(3):
        per_node = node_bytes(sampling, shard_bytes, 4, epoch, 0)
        assert per_node.tolist() == [256 * 140_000_000] * 4
    # Shards of mixed sizes: each node within one largest shard of a quarter, the sum exactly the dataset.
    rng = np.random.default_rng(0)
    sizes = rng.integers(800, 1300, 300)
    shard_bytes = sizes * 110_000
    per_node = node_bytes(PartitionedSampling(sizes, window=8), shard_bytes, 4, 0, 0)
    assert per_node.sum() == shard_bytes.sum()  # 1.00x the dataset in all
    assert np.all(np.abs(per_node - shard_bytes.sum() / 4) <= shard_bytes.max())


def test_four_nodes_of_eight_ranks_read_disjoint_quarters_of_the_shards():
    # The same layout scaled down (12 samples a shard), read through every rank's indices: each node touches
    # 256 shards, no two nodes the same one, so the nodes together read each shard once an epoch.
    sampling = PartitionedSampling([12] * 1024, window=51)
    per_rank = run(sampling, NodeLayout(4, 8, 4), epoch=1, seed=11)
    touched = [{int(k) for r in range(8) for k in shard_of(per_rank[(n, r)][0], [12] * 1024)} for n in range(4)]
    assert [len(t) for t in touched] == [256] * 4
    assert set().union(*touched) == set(range(1024))


def test_node_bytes_are_the_shards_its_ranks_read():
    sizes = [7, 0, 9, 12, 5, 8, 8, 3, 10, 6, 11, 4]
    sampling = PartitionedSampling(sizes, window=2, partitions=4)
    layout = NodeLayout(2, 3, 2)
    per_rank = run(sampling, layout, epoch=2, seed=5)
    shard_bytes = np.arange(1, 13) * 1000
    for n, expected in enumerate(node_bytes(sampling, shard_bytes, 2, 2, 5)):
        touched = {int(k) for r in range(3) for k in shard_of(per_rank[(n, r)][0], sizes)}
        assert sum(int(shard_bytes[k]) for k in touched) == expected


@settings(max_examples=40, deadline=None)
@given(setup=setups(), seed=st.integers(0, 100))
def test_partitions_are_balanced_and_every_shard_dealt_once(setup, seed):
    sampling, _ = setup
    dealt = deal_shards(sampling, 0, seed)
    assert sorted(int(k) for d in dealt for k in d) == list(range(len(sampling.shard_sizes)))
    loads = [int(sampling.shard_sizes[d].sum()) for d in dealt]
    assert min(loads) > 0 and max(loads) - min(loads) <= int(sampling.shard_sizes.max())


@settings(max_examples=40, deadline=None)
@given(shards=st.integers(12, 200), partitions=st.sampled_from([2, 3, 4, 6, 8, 12]), seed=st.integers(0, 50))
def test_with_shards_of_one_size_nodes_differ_by_one_shard_at_most_on_every_node_count(shards, partitions, seed):
    sampling = PartitionedSampling([10] * shards, window=3, partitions=partitions)
    for nodes in (n for n in range(1, partitions + 1) if partitions % n == 0):
        per_node = node_bytes(sampling, [1] * shards, nodes, 0, seed)  # one byte a shard: shards per node
        assert per_node.max() - per_node.min() <= 1, nodes


@settings(max_examples=40, deadline=None)
@given(setup=setups(), epoch=st.integers(0, 3), data=st.data())
def test_window_spans_name_the_shards_each_stretch_of_the_node_stream_reads(setup, epoch, data):
    sampling, layout = setup
    layout = NodeLayout(layout.nodes, layout.ranks, layout.batch_size, "pad", layout.together)
    steps = data.draw(st.integers(0, partitioned_num_batches(sampling, layout, epoch, 3)))
    start = partitioned_progress(sampling, layout, epoch, 3, steps)
    node = data.draw(st.integers(0, layout.nodes - 1))
    spans = node_window_spans(sampling, layout, node, epoch, 3, start)
    per_rank = run(sampling, layout, epoch, 3, start)
    left = sum(int(np.sum(~pad)) for (n, _), (_, pad) in per_rank.items() if n == node)
    assert [s.window for s in spans] == list(range(len(spans)))
    assert [s.start for s in spans] == sorted(s.start for s in spans)
    assert all(0 < len(s.shards) <= sampling.window for s in spans)
    covered = np.zeros(left, dtype=int)  # how many windows' stretches hold each position of the node's stream
    for s in spans:
        covered[s.start : s.stop] += 1
    together = len(node_partitions(node, layout.nodes, sampling.partitions))
    assert covered.min(initial=1) >= 1 and covered.max(initial=0) <= min(together, layout.together or together)
    # Step k of the node's ranks reads positions [k b R, (k+1) b R): its real samples lie in the windows there.
    node_batch, b = layout.batch_size * layout.ranks, layout.batch_size
    for k in range(partitioned_num_batches(sampling, layout, epoch, 3, start)):
        real = [
            int(i)
            for r in range(layout.ranks)
            for i, pad in zip(*(a[k * b : k * b + b] for a in per_rank[(node, r)]))
            if not pad
        ]
        needed = set(shards_needed(spans, k * node_batch, (k + 1) * node_batch))
        assert set(shard_of(real, sampling.shard_sizes).tolist()) <= needed, k


def test_fillers_are_the_nodes_last_read_samples():
    # Partitions of 50 and 40 samples on 2 nodes of 2 ranks: node 1 pads 5 samples a rank, from its last window.
    sampling = PartitionedSampling([30, 30, 10, 10, 10], window=1, partitions=2, shuffle=False)
    assert [d.tolist() for d in deal_shards(sampling, 0, 0)] == [[0, 2, 4], [1, 3]]
    layout = NodeLayout(2, 2, 4)
    idx, pad = partitioned_rank_indices(sampling, layout, 1, 0, 0, 0)
    assert len(idx) == 25 and pad.sum() == 5  # node 0's 50 samples: 25 a rank; node 1's 40: 20 and 5 fillers
    assert idx[pad].tolist() == [79, 77, 75, 73, 71]  # every other one back from the last, all of shard 3
    assert partitioned_rank_indices(sampling, layout, 1, 1, 0, 0)[0][pad].tolist() == [78, 76, 74, 72, 70]


def test_deterministic_per_seed_and_epoch_and_the_dealing_fixed_for_the_run_unless_redealt():
    sizes = [20] * 16
    layout = NodeLayout(2, 2, 4)
    fixed, redealt = PartitionedSampling(sizes, window=2), PartitionedSampling(sizes, window=2, redeal=True)
    orders = {(s, e): run(fixed, layout, e, s)[(1, 1)][0].tobytes() for s in range(2) for e in range(3)}
    assert len(set(orders.values())) == len(orders)
    assert node_shards(fixed, 2, 0, epoch=0) == node_shards(fixed, 2, 0, epoch=5)
    assert node_shards(redealt, 2, 0, epoch=0) != node_shards(redealt, 2, 0, epoch=1)


def test_pinned_orders():
    # A change of generator would silently change every saved run's data order.
    sampling = PartitionedSampling([3, 2, 4, 1], window=1, partitions=2)
    assert [d.tolist() for d in deal_shards(sampling, 0, 0)] == [[2, 3], [0, 1]]
    assert partitioned_rank_indices(sampling, NodeLayout(2, 1, 2), 0, 0, 0, 0)[0].tolist() == [6, 8, 5, 7, 9]
    wide = PartitionedSampling([3, 2, 4, 1], window=2, partitions=2)
    assert partitioned_rank_indices(wide, NodeLayout(1, 2, 2), 0, 1, 1, 3)[0].tolist() == [9, 2, 8, 1, 0]


def test_windows_are_at_most_w_shards_and_as_even_as_they_go():
    # 128 shards a partition and W = 51: three windows of 43, 43 and 42 shards (not 51, 51 and a narrow 26).
    one = PartitionedSampling([10] * 128, window=51, partitions=1)
    assert [len(s.shards) for s in node_window_spans(one, NodeLayout(), 0, 0, 0)] == [43, 43, 42]
    two = PartitionedSampling([10] * 128, window=51, partitions=2)  # 64 shards each: 32 and 32, read together
    spans = node_window_spans(two, NodeLayout(), 0, 0, 0)
    assert [len(s.shards) for s in spans] == [32] * 4
    assert [(s.start, s.stop) for s in spans] == [(0, 639), (1, 640), (640, 1279), (641, 1280)]
    dealt = deal_shards(two, 0, 0)
    assert set(spans[0].shards + spans[2].shards) == set(dealt[0].tolist())
    assert set(spans[1].shards + spans[3].shards) == set(dealt[1].tolist())


def test_a_node_reads_its_partitions_together_or_in_groups():
    sampling = PartitionedSampling([10] * 64, window=2)  # 8 partitions of 8 shards
    dealt = deal_shards(sampling, 0, 0)
    partition = {int(k): p for p, shards in enumerate(dealt) for k in shards}

    def first_batch_partitions(together):
        idx, _ = partitioned_rank_indices(sampling, NodeLayout(2, 2, 8, together=together), 0, 0, 0, 0)
        return {partition[int(k)] for k in shard_of(idx[:8], sampling.shard_sizes)}

    assert first_batch_partitions(None) == {0, 1, 2, 3}  # node 0's four partitions, a window of each
    assert first_batch_partitions(2) == {0, 1}
    assert first_batch_partitions(1) == {0}


def test_partition_window_fills_the_node_window():
    assert partition_window(48, 8, 1) == (6, 8)  # one node: a window of each of 8 partitions, 6 shards each
    assert partition_window(48, 8, 4) == (24, 2)
    assert partition_window(5, 8, 1) == (1, 5)  # fewer shards than partitions: 5 read at once
    assert partition_window(48, 8, 1, window=24) == (24, 2)  # the run's W on one node: two at a time
    assert partition_window(48, 8, 8, window=6) == (6, 1)
    with pytest.raises(ValueError, match="nodes=3 does not divide partitions=8"):
        partition_window(48, 8, 3)


@pytest.mark.parametrize("before, after", [(1, 8), (2, 4), (2, 8), (4, 8), (8, 2)])
def test_a_state_resumed_on_more_or_fewer_nodes_leaves_them_about_equal_work(before, after):
    # A node reads its partitions together, each in proportion to what is left of it: whichever step the state
    # is taken at, the nodes of the new layout have work within a sample a partition of each other, and pad
    # for little more than that and a batch. (Read one partition after another, the node given the partitions
    # read first would be left with little and the others would pad for the difference.)
    sampling = PartitionedSampling([12] * 256, window=4)  # 32 shards a partition, windows of 4 (48 samples)
    layout = NodeLayout(before, 2, 5)
    batches = partitioned_num_batches(sampling, layout, 0, 0)
    for step in (1, batches // 3, batches // 2, batches - 7):
        state = partitioned_progress(sampling, layout, 0, 0, step)
        left = [sum(32 * 12 - state[p] for p in node_partitions(n, after, 8)) for n in range(after)]
        assert max(left) - min(left) <= 8, (step, left)
        per_rank = run(sampling, NodeLayout(after, 2, 5), start=state)
        pads = sum(int(pad.sum()) for _, pad in per_rank.values())
        assert pads <= after * (8 + 2 * 5), (step, pads)


def test_without_shuffle_partitions_read_their_shards_in_manifest_order():
    sampling = PartitionedSampling([4, 4, 4, 4], window=2, partitions=2, shuffle=False)
    dealt = deal_shards(sampling, 0, 0)
    assert [partition_stream(sampling, dealt, p, 0, 0).tolist() for p in range(2)] == [
        [0, 1, 2, 3, 8, 9, 10, 11],
        [4, 5, 6, 7, 12, 13, 14, 15],
    ]


def test_default_partitions_let_one_to_eight_nodes_resume_each_other():
    assert DEFAULT_PARTITIONS % 8 == 0 and default_partitions([5] * 100) == 8
    assert default_partitions([5, 0, 5, 5, 5, 5, 0]) == 4 and default_partitions([0, 3]) == 1
    for nodes in (1, 2, 4, 8):
        assert len(node_partitions(0, nodes, DEFAULT_PARTITIONS)) == DEFAULT_PARTITIONS // nodes


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: node_partitions(0, 3, 8), r"nodes=3 does not divide partitions=8: .* runs on 1, 2, 4, 8 nodes"),
        (lambda s: node_partitions(4, 4, 8), "node must be < nodes"),
        (
            lambda s: partitioned_rank_indices(s, NodeLayout(2, 1, 1), 0, 0, 0, 0, start=[1, 0]),
            r"progress of 2 partitions but this run has partitions=4: resume with PartitionedSampling\(partitions=2\)",
        ),
        (lambda s: partitioned_progress(s, NodeLayout(), 0, 0, 1, start=[0, 0, 99, 0]), r"start\[2\]=99 is not within"),
        (lambda s: partitioned_progress(s, NodeLayout(), 0, 0, 10**6), "steps must be <= "),
        (
            lambda s: partitioned_rank_indices(s, NodeLayout(1, 2, 1), 0, 2, 0, 0),
            r"rank must be < ranks per node \(2\)",
        ),
        (
            lambda s: PartitionedSampling([3, 0, 4], window=1),
            r"partitions=8 but only 2 shard\(s\) hold samples.*partitions=2",
        ),
        (lambda s: PartitionedSampling([3], window=0, partitions=1), "PartitionedSampling.window must be >= 1"),
        (lambda s: PartitionedSampling([3], window=1, partitions=1, redeal=1), "redeal must be True or False"),
        (lambda s: NodeLayout(2, 2, 2, "keep"), "last_batch must be one of"),
        (lambda s: node_bytes(s, [1, 2], 1, 0, 0), "shard_bytes must hold 8 integers"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, message):
    sampling = PartitionedSampling([5, 6, 7, 8, 5, 6, 7, 8], window=2, partitions=4)
    with pytest.raises(ValueError, match=message):
        call(sampling)


def test_an_epochs_start_resumes_on_any_partitions():
    sampling = PartitionedSampling([5] * 8, window=2, partitions=4)
    fresh = run(sampling, NodeLayout(2, 1, 3))
    assert all(
        np.array_equal(fresh[key][0], got[0]) for key, got in run(sampling, NodeLayout(2, 1, 3), start=(0,) * 8).items()
    )


@pytest.mark.slow
def test_every_layout_resumes_every_other_at_every_step():
    """Exhaustive over small layouts: every step of every layout of 1, 2, 4, 8 nodes, resumed on each other one."""
    for sizes in ([9, 4, 12, 7, 5, 8, 0, 11, 6, 10], [3] * 8, [50, 1, 1, 1, 1, 1, 1, 1, 20]):
        sampling = PartitionedSampling(sizes, window=2)
        grid = [NodeLayout(n, r, b) for n in (1, 2, 4, 8) for r in (1, 3) for b in (2, 5)]
        for before, after in itertools.product(grid, grid):
            first = run(sampling, before)
            for step in range(partitioned_num_batches(sampling, before, 0, 0) + 1):
                state = partitioned_progress(sampling, before, 0, 0, step)
                seen = read(first, before.batch_size, 0, step) + read(
                    run(sampling, after, start=state), after.batch_size
                )
                assert sorted(seen) == list(range(sum(sizes))), (sizes, before, after, step)
