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
