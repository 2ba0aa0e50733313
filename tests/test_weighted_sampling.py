"""Weighted epochs and dataset mixtures (issue 40's pure part): frequencies, exactness, determinism, rank splits."""

from __future__ import annotations

import numpy as np
import pytest

from dali_pipes.sampling import (
    class_balanced_weights,
    mixture_order,
    num_batches,
    rank_indices,
    split_order,
    weighted_order,
)


def test_draws_with_replacement_follow_the_weights():
    weights = np.array([1.0, 2.0, 3.0, 4.0, 0.0])
    drawn = weighted_order(weights, 200_000, epoch=0, seed=7)
    frequency = np.bincount(drawn, minlength=5) / len(drawn)
    assert np.allclose(frequency, weights / weights.sum(), atol=0.005)  # 3-4 standard deviations at this n
    assert frequency[4] == 0  # weight 0: never drawn


def test_draws_without_replacement_take_each_sample_at_most_once_and_favour_the_heavy():
    weights = np.array([8.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    for epoch in range(50):
        drawn = weighted_order(weights, 5, epoch=epoch, seed=1, replacement=False)
        assert sorted(drawn.tolist()) == [0, 1, 2, 3, 5]  # all the drawable ones, once each
    # Drawn first with probability w / sum(w) (Efraimidis-Spirakis): sample 0 leads 8/12 of the epochs.
    firsts = [int(weighted_order(weights, 1, epoch=e, seed=2, replacement=False)[0]) for e in range(3000)]
    assert abs(firsts.count(0) / 3000 - 8 / 12) < 0.03
    with pytest.raises(ValueError, match="only 5 samples have a weight above 0"):
        weighted_order(weights, 6, epoch=0, seed=0, replacement=False)


def test_the_draw_is_a_function_of_seed_and_epoch():
    weights = np.arange(1, 101, dtype=float)
    for replacement in (True, False):
        a = weighted_order(weights, 50, epoch=3, seed=5, replacement=replacement)
        assert np.array_equal(a, weighted_order(weights, 50, epoch=3, seed=5, replacement=replacement))
        assert not np.array_equal(a, weighted_order(weights, 50, epoch=4, seed=5, replacement=replacement))
        assert not np.array_equal(a, weighted_order(weights, 50, epoch=3, seed=6, replacement=replacement))


@pytest.mark.parametrize(
    "bad, message", [([], "empty"), ([1.0, -1.0], "sample 1"), ([0.0, 0.0], "all 0"), ([np.nan], "finite")]
)
def test_bad_weights_are_refused_naming_the_sample(bad, message):
    with pytest.raises(ValueError, match=message):
        weighted_order(bad, 3, epoch=0, seed=0)


def test_class_balanced_weights_draw_every_class_equally_often():
    labels = np.array([0] * 900 + [1] * 90 + [2] * 10)
    weights = class_balanced_weights(labels)
    assert weights[0] == pytest.approx(1 / 900) and weights[-1] == pytest.approx(1 / 10)
    drawn = labels[weighted_order(weights, 90_000, epoch=0, seed=3)]
    assert np.allclose(np.bincount(drawn) / len(drawn), 1 / 3, atol=0.01)


def test_a_mixture_takes_exact_proportions_and_repeats_nothing_before_a_dataset_is_used_up():
    sizes, proportions = [10, 100], [0.7, 0.3]
    order = mixture_order(sizes, proportions, 1000, epoch=0, seed=0)
    from_a, from_b = order[order < 10], order[order >= 10]
    assert len(from_a) == 700 and len(from_b) == 300
    assert np.all(np.bincount(from_a, minlength=10) == 70)  # 7 whole rounds of A
    assert np.all(np.bincount(from_b - 10, minlength=100) == 3)  # 3 whole rounds of B
    short = mixture_order(sizes, proportions, 100, epoch=1, seed=0)
    assert len(set(short[short >= 10].tolist())) == 30  # within an epoch, B's samples are distinct
    assert not np.array_equal(short, mixture_order(sizes, proportions, 100, epoch=2, seed=0))
    assert np.all(np.diff(np.flatnonzero(order < 10)) < 40)  # interleaved, not one dataset after the other
    counts = [int((mixture_order([5, 5, 5], [1, 1, 1], 10, epoch=e, seed=0) // 5 == 0).sum()) for e in range(3)]
    assert (
        all(c in (3, 4) for c in counts)
        and sum(len(mixture_order([5, 5, 5], [1, 1, 1], 10, e, 0)) for e in range(3)) == 30
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("last_batch", ["pad", "drop"])
def test_a_weighted_epoch_splits_over_the_ranks_as_a_permutation_does(world_size, last_batch):
    order = weighted_order(np.linspace(1, 3, 37), 53, epoch=2, seed=4)  # repeats, not a permutation
    batch = 4
    parts = [split_order(order, batch, rank, world_size, last_batch) for rank in range(world_size)]
    counts = {len(indices) for indices, _ in parts}
    assert len({-(-c // batch) for c in counts}) == 1  # every rank the same number of batches
    assert -(-max(counts) // batch) == num_batches(53, batch, world_size, last_batch)
    # Batch by batch, the real rows of all ranks are the order's positions, each once, in order.
    real = []
    for step in range(-(-max(counts) // batch)):
        for indices, is_pad in parts:
            rows = slice(step * batch, (step + 1) * batch)
            real.extend(i for i, pad in zip(indices[rows].tolist(), is_pad[rows].tolist()) if not pad)
    expected = order.tolist() if last_batch == "pad" else order[: len(real)].tolist()
    assert real == expected
    # rank_indices is split_order of the epoch's permutation; a resumed pass splits the rest of the order.
    for rank in range(world_size):
        for a, b in zip(
            split_order(np.arange(53), batch, rank, world_size, last_batch, start=8),
            rank_indices(53, batch, rank, world_size, 0, 0, shuffle=False, last_batch=last_batch, start=8),
        ):
            assert np.array_equal(a, b)


# --- through the loader: real DALI pipelines, real processes -----------------------------------------

N_LOADER = 23


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from loader_helpers import write_dataset

    return write_dataset(tmp_path_factory.mktemp("weighted") / "ds", N_LOADER, samples_per_shard=5)


def _real_rows(path, sampling, world_size, **kwargs):
    """Every rank's real sample indices in the job's global order; and rank 0's state after 2 batches."""
    from loader_helpers import job_rows

    rows, saved = job_rows(path, world_size, sampling=sampling, **kwargs)
    return [index for index, _ in rows], saved


def test_the_loader_reads_the_weighted_draw_exactly_and_resumes_it_on_another_world_size(tiny):
    from dali_pipes import WeightedSampling

    sampling = WeightedSampling(np.arange(1, N_LOADER + 1, dtype=float), num_samples=37)
    drawn = sampling.order(N_LOADER, 1, 9).tolist()
    for world_size in (1, 2, 3):
        rows, state = _real_rows(tiny, sampling, world_size, epoch=1)
        assert rows == drawn  # every drawn sample once, repeats included, in the draw's order
    # Two batches of 4 on each of 2 ranks consumed 16: three ranks read the other 21.
    _, state = _real_rows(tiny, sampling, 2, epoch=1)
    assert state["samples_consumed"] == 16 and state["sampling"]["num_samples"] == 37
    resumed, _ = _real_rows(tiny, sampling, 3, state=state)
    assert resumed == drawn[16:]
    other = WeightedSampling(np.ones(N_LOADER), num_samples=37)
    with pytest.raises(ValueError, match="sampling="):
        _real_rows(tiny, other, 1, state=state)
    # A state saved without weights has no "sampling" entry: refused by name, not a KeyError.
    from loader_helpers import job_rows

    _, unweighted = job_rows(tiny, 2, epoch=1)
    with pytest.raises(ValueError, match="saved loader state has sampling=None"):
        _real_rows(tiny, WeightedSampling(np.ones(N_LOADER)), 1, state=unweighted)
    with pytest.raises(ValueError, match="22 weights but the dataset has 23 samples"):
        _real_rows(tiny, WeightedSampling(np.ones(N_LOADER - 1)), 1)


def test_a_ddp_job_reads_each_weighted_epoch_exactly(tiny, tmp_path):
    """Real processes (gloo): two ranks in lockstep read the draw of each epoch, no sample more or less."""
    from test_ddp import run_job

    from dali_pipes import WeightedSampling

    reports = run_job(2, tiny, tmp_path, batch_size=4, epochs=2, weighted=30)
    sampling = WeightedSampling(np.arange(1, N_LOADER + 1, dtype=float), num_samples=30)
    for epoch in range(2):
        per_rank = [report["epochs"][epoch] for report in reports]
        assert len({len(b) for b in per_rank}) == 1
        read = [i for step in zip(*per_rank) for indices, pads in step for i, p in zip(indices, pads) if not p]
        assert read == sampling.order(N_LOADER, epoch, 0).tolist()


# --- refused when made, not at the first epoch --------------------------------------------------------


def test_a_draw_without_replacement_of_more_samples_than_can_be_drawn_is_refused_when_made():
    from dali_pipes import WeightedSampling

    weights = np.array([1.0, 0.0, 2.0, 0.0, 3.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # 7 of 10 drawable
    with pytest.raises(ValueError, match=r"replacement=False.*num_samples=8 needs 8 samples.*only 7 of the 10.*"
                       r"pass num_samples=7 or fewer, or replacement=True"):  # fmt: skip
        WeightedSampling(weights, num_samples=8, replacement=False)
    # Without num_samples the epoch is one draw per weight: 10, of which 3 cannot be drawn.
    with pytest.raises(ValueError, match=r"an epoch of 10 \(num_samples unset: one per weight\)"):
        WeightedSampling(weights, replacement=False)
    drawable = WeightedSampling(weights, num_samples=7, replacement=False)
    assert sorted(drawable.order(10, 0, 0).tolist()) == [0, 2, 4, 5, 7, 8, 9]
    WeightedSampling(weights, num_samples=100)  # with replacement: any length
    with pytest.raises(ValueError, match="replacement must be True or False"):
        WeightedSampling(weights, replacement="no")


def test_weights_read_in_order_are_refused_by_the_loader_naming_shuffle(tiny):
    from dali_pipes import BatchFormat, ClassificationVal, DALILoader, RunOptions, WeightedSampling

    from loader_helpers import TinySpec

    sampling, cpu = WeightedSampling(np.ones(N_LOADER)), RunOptions(device="cpu")
    with pytest.raises(ValueError, match=r"draws each epoch at random.*shuffle=False was given: pass shuffle=True"):
        DALILoader(tiny, TinySpec(), batch_size=4, shuffle=False, sampling=sampling, run=cpu)
    # An evaluation spec reads in order by default: named, so that the user sees where shuffle=False came from.
    with pytest.raises(ValueError, match=r"shuffle=False \(the default of ClassificationVal, which reads in order\)"):
        DALILoader(tiny, ClassificationVal(size=16), batch_size=4, sampling=sampling, run=cpu)
    with DALILoader(
        tiny, ClassificationVal(size=16), batch_size=4, shuffle=True, sampling=sampling,
        batch_format=BatchFormat(with_index=True), run=cpu,
    ) as loader:  # fmt: skip
        assert [i for b in loader for i in b["index"][~b["is_pad"]].tolist()] == sampling.order(N_LOADER, 0, 0).tolist()


# --- what reader processes are sent, and what they read -------------------------------------------------


def test_the_source_sent_to_reader_processes_does_not_carry_the_weights(tiny):
    """A spawned worker gets the source pickled (by multiprocessing, DALI's default): not 1M weights (8 MB before)."""
    from multiprocessing.reduction import ForkingPickler

    from dali_pipes import WeightedSampling, open_store
    from dali_pipes.loading.batch_source import BatchStoreSource
    from dali_pipes.loading.sources import EpochControl
    from dali_pipes.sampling import EpochRules

    store, control = open_store(tiny), EpochControl()
    sizes = {}
    for weights in (None, np.ones(10), np.ones(1_000_000)):
        source = BatchStoreSource(
            store, ("image", "label"), EpochRules(batch_size=4), control=control,
            sampling=None if weights is None else WeightedSampling(weights),
        )  # fmt: skip
        sizes[0 if weights is None else len(weights)] = len(ForkingPickler.dumps(source))
    assert sizes[1_000_000] == sizes[10] < sizes[0] + 200  # the kind's name, not the weights
    # A copy reads the plans the loader publishes; with none published it says so instead of drawing without weights.
    clone = ForkingPickler.loads(ForkingPickler.dumps(source))
    control.publish(0, epoch=0, start=0)  # no plan
    with pytest.raises(RuntimeError, match="without its WeightedSampling.*no plan was published"):
        clone(type("BatchInfo", (), {"iteration": 0, "epoch_idx": 0})())
    control.close()
    store.close()


def test_a_stale_task_that_meets_the_next_epochs_plan_mid_publish_stops_quietly(tiny, monkeypatch):
    """DALI schedules reader tasks ahead: one of epoch 0 may run while the loader publishes epoch 1. If it finds
    epoch 1's plan file already written, it must stop (DALI discards it), not fail for want of the weights."""
    from multiprocessing.reduction import ForkingPickler

    from dali_pipes import WeightedSampling, open_store
    from dali_pipes.loading import sources
    from dali_pipes.loading.batch_source import BatchStoreSource
    from dali_pipes.sampling import EpochRules

    store, control = open_store(tiny), sources.EpochControl()
    sampling = WeightedSampling(np.ones(len(store)))
    source = BatchStoreSource(
        store, ("image", "label"), EpochRules(batch_size=4), control=control, sampling=sampling,
    )  # fmt: skip
    clone = ForkingPickler.loads(ForkingPickler.dumps(source))  # what a spawned reader process holds
    plan = (sampling.order(len(store), 0, 0), np.zeros(len(store), bool))
    control.publish(0, epoch=0, start=0, plan=plan)
    seen = []
    write_plan = sources.write_plan

    def write_then_run_the_stale_task(*args, **kwargs):
        write_plan(*args, **kwargs)  # epoch 1's plan is in place, the control block not yet updated
        try:
            clone(type("BatchInfo", (), {"iteration": 0, "epoch_idx": 0})())
        except StopIteration:
            seen.append("stopped")

    monkeypatch.setattr(sources, "write_plan", write_then_run_the_stale_task)
    control.publish(1, epoch=1, start=0, plan=(sampling.order(len(store), 0, 1), plan[1]))
    assert seen == ["stopped"]
    control.close()
    store.close()


@pytest.mark.timeout(300)
def test_reader_processes_read_the_weighted_draw_exactly(tiny):
    """Two spawned reader processes (the source pickled into each), two epochs, rows exactly the draws."""
    from dali_pipes import BatchFormat, DALILoader, RunOptions, WeightedSampling

    from loader_helpers import TinySpec

    sampling = WeightedSampling(np.arange(1, N_LOADER + 1, dtype=float), num_samples=37)
    with DALILoader(
        tiny, TinySpec(), batch_size=4, seed=9, sampling=sampling, batch_format=BatchFormat(with_index=True),
        run=RunOptions(device="cpu", py_num_workers=2, py_start_method="spawn"),
    ) as loader:  # fmt: skip
        assert len(loader.worker_pids) == 2
        for epoch in range(2):
            rows = [i for b in loader for i in b["index"][~b["is_pad"]].tolist()]
            assert rows == sampling.order(N_LOADER, epoch, 9).tolist()
