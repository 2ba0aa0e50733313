"""One DALI epoch reads training epochs in a row (loading/epoch_chain.py): the same batches, without a reset between."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from recipe_helpers import write_photo_dataset

from dali_pipes import BatchFormat, DALILoader, Mix, RunOptions
from dali_pipes.pipelines import ClassificationTrain, Features
from dali_pipes.sampling import rank_indices, split_order

from loader_helpers import epoch_folders, skip_if_fork_refused, write_dataset

SEED = 5
N = 122  # not a whole number of batches of 4, or of 8 on two ranks: every epoch ends with padding
INDEXED = BatchFormat(with_index=True)
IN_THREAD = RunOptions(device="cpu", py_num_workers=0)  # the loader's own thread reads
TWO_WORKERS = RunOptions(device="cpu", py_num_workers=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("chain") / "images", N, samples_per_shard=40)


def scheduled(epoch: int) -> int:
    return 32 + 8 * epoch


def expected(n: int, epoch: int, rank: int = 0, world_size: int = 1, start: int = 0) -> list[int]:
    """This rank's real samples of ``epoch`` from ``start``, in order (the wrap-around padding left out)."""
    indices, is_pad = rank_indices(n, 4, rank, world_size, epoch, SEED, start=start)
    return indices[~is_pad].tolist()


def read(loader) -> tuple[list[int], set]:
    """The real (not padding) sample indices of one pass, and the image sizes it had."""
    indices, sizes = [], set()
    for batch in loader:
        indices += batch["index"][~batch["is_pad"]].tolist()
        sizes.add(tuple(batch["image"].shape[2:]))
    return indices, sizes


@pytest.mark.parametrize(
    "reads, workers, rank",
    [(True, 0, 0), (True, 2, 0), (False, 2, 0), (True, 2, 1)],
    ids=["batch-in-thread", "batch-workers", "sample-workers", "rank-1-of-2"],
)
def test_epochs_in_a_row_are_one_dali_epoch_with_each_epochs_order_and_size(images, reads, workers, rank):
    world = 2 if rank else 1
    spec = ClassificationTrain(size=scheduled)  # per-batch inputs: each epoch's size reaches its own batches
    run = RunOptions(device="cpu", rank=rank, world_size=world, batch_reads=reads, py_num_workers=workers)
    with DALILoader(images, spec, batch_size=4, seed=SEED, run=run, batch_format=INDEXED) as loader:
        assert loader.refills == 0  # nothing read yet
        for epoch in range(4):
            if epoch % 2:
                loader.set_epoch(epoch)  # the epoch that follows anyway: still read on
            indices, sizes = read(loader)
            assert indices == expected(N, epoch, rank, world)
            assert sizes == {(scheduled(epoch), scheduled(epoch))}
        assert loader.refills == 1  # one DALI epoch read all four: no reset, no refill


def test_any_other_next_pass_starts_a_new_dali_epoch_with_the_right_samples(images):
    before = epoch_folders()
    with DALILoader(
        images, ClassificationTrain(size=32), batch_size=4, seed=SEED, run=TWO_WORKERS, batch_format=INDEXED
    ) as loader:
        (folder,) = epoch_folders() - before  # this loader's epoch control block and plans
        assert read(loader)[0] == expected(N, 0)
        loader.set_epoch(3)  # not the epoch DALI was reading on into
        assert read(loader)[0] == expected(N, 3)
        assert loader.refills == 2
        batches = iter(loader)  # epoch 4, chained, left after 5 batches
        left = [next(batches)["index"].tolist() for _ in range(5)]
        assert sum(left, []) == expected(N, 4)[:20]
        assert read(loader)[0] == expected(N, 5)  # a pass left part-way: the next epoch, from its start
        # Epoch 6 is the one DALI reads on into, but from sample 40: not its start, so a new DALI epoch.
        loader.load_state_dict({**loader.state_dict(), "epoch": 6, "samples_consumed": 40})
        assert read(loader)[0] == expected(N, 6, start=40)
        loader.load_state_dict({**loader.state_dict(), "epoch": 8, "samples_consumed": 40})
        assert read(loader)[0] == expected(N, 8, start=40)
        assert read(loader)[0] == expected(N, 9)  # read on from the resumed pass
        assert read(loader)[0] == expected(N, 10)
        assert loader.refills == 5  # new DALI epochs at 3, 5, 6 and 8; 4, 9 and 10 read on
        # Only the plans DALI may still read are kept: the first one, and this epoch's and the next one's.
        assert sorted(path.name for path in folder.glob("control.plan*")) == [
            "control.plan",
            "control.plan.2",
            "control.plan.3",
        ]
    assert not folder.exists()  # closing the loader removes them


def test_a_size_schedule_that_ends_with_the_run_is_not_asked_for_the_epoch_after(images):
    sizes = [32, 40]  # a schedule for a two-epoch run: size_at(2) raises IndexError

    spec = ClassificationTrain(size=sizes.__getitem__)
    with DALILoader(images, spec, batch_size=4, seed=SEED, run=IN_THREAD, batch_format=INDEXED) as loader:
        for epoch in range(2):
            indices, got = read(loader)
            assert indices == expected(N, epoch) and got == {(sizes[epoch], sizes[epoch])}
        assert loader.refills == 1
        with pytest.raises(IndexError):
            list(loader)  # a third epoch is the user's to ask for, and then its error is raised


def test_a_read_on_epoch_draws_the_mixes_of_that_epoch(tmp_path, imagenet_mini):
    from conftest import write_dataset as fixture

    dataset = write_photo_dataset(fixture.__wrapped__(), tmp_path / "photos", imagenet_mini, count=47)  # padded
    spec = ClassificationTrain(size=32, mix=Mix(mixup_alpha=0.8, cutmix_alpha=1.0, mode="elem"), flip=0.0, jitter=None)
    options = dict(batch_size=4, seed=SEED, run=IN_THREAD, batch_format=INDEXED)
    with DALILoader(dataset, spec, **options) as chained:
        read_on = [[b["label"].clone() for b in chained] for _ in range(3)][2]
        assert chained.refills == 1  # epoch 2 was read on into
    with DALILoader(dataset, spec, **options) as fresh:
        fresh.set_epoch(2)  # epoch 2 as the first pass of a new loader: the draws of its own batches
        alone = [b["label"].clone() for b in fresh]
    assert len(read_on) == len(alone) == 12
    for a, b in zip(read_on, alone):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("reads", [True, False], ids=["batch", "sample"])
def test_epochs_one_batch_longer_than_the_read_ahead_bound_stay_exact_under_a_slow_consumer(tmp_path, reads):
    # The chain publishes one epoch ahead; the shortest epoch it reads on into is the tightest case it allows
    # (DALI's own read-ahead is about 3 batches shorter: epoch_chain.read_ahead keeps that margin).
    dataset = write_dataset(tmp_path / "ds", 28, samples_per_shard=10)  # 7 batches > read_ahead(2, 2) = 6
    run = RunOptions(device="cpu", batch_reads=reads, py_num_workers=2, prefetch=2)
    with DALILoader(
        dataset, ClassificationTrain(size=32), batch_size=4, seed=SEED, run=run, batch_format=INDEXED
    ) as loader:
        for epoch in range(5):
            indices = []
            for batch in loader:
                time.sleep(0.02)  # DALI fills every queue while the step runs
                indices += batch["index"].tolist()
            assert indices == expected(28, epoch)
        assert loader.refills == 1


def test_epochs_shorter_than_dali_reads_ahead_start_a_dali_epoch_each(tmp_path):
    dataset = write_dataset(tmp_path / "ds", 12, samples_per_shard=5)  # 3 batches
    with DALILoader(
        dataset, ClassificationTrain(size=32), batch_size=4, seed=SEED, run=TWO_WORKERS, batch_format=INDEXED
    ) as loader:
        for epoch in range(3):
            assert read(loader)[0] == expected(12, epoch)
        assert loader.refills == 3  # not chained: each epoch a DALI epoch of its own


def test_plain_feature_rows_read_on_too(tmp_path, caplog):
    dataset = write_dataset(tmp_path / "rows", 50, fields="arrays", samples_per_shard=20)
    spec = Features(fields=("features", "label"))
    with caplog.at_level(logging.INFO, logger="dali_pipes.loading.loader"):
        loader = DALILoader(dataset, spec, batch_size=4, seed=SEED, run=RunOptions(device="cpu"), batch_format=INDEXED)
    with loader:
        assert any("without a DALI graph" in r.getMessage() for r in caplog.records)  # read only when asked
        for epoch in range(3):
            batches = list(loader)
            assert [len(b["index"]) for b in batches] == [4] * 12 + [2]  # 50 rows: the last batch trimmed
            assert not any(b["is_pad"].any() for b in batches)
            rows = np.concatenate([b["index"].numpy() for b in batches])
            assert rows.tolist() == expected(50, epoch)
            # Each row's features are its own sample's (write_dataset: features = the index four times).
            features = np.concatenate([b["features"].numpy() for b in batches])
            assert (features == rows[:, None]).all()
        assert loader.refills == 1


# --- weighted and mixed draws read on from epoch to epoch -----------------------------------------------


def drawn(order: np.ndarray, rank: int = 0, world_size: int = 1) -> list[int]:
    """This rank's real samples of an epoch's global draw, in order."""
    indices, is_pad = split_order(order, 4, rank, world_size)
    return indices[~is_pad].tolist()


def read_draws(loader, sampling, n: int, epochs: int) -> None:
    """Read ``epochs`` whole passes, each exactly its epoch's draw for this rank, all in one DALI epoch.

    Each epoch has more batches than DALI reads ahead, so each is read on into.
    """
    for epoch in range(epochs):
        rows = [i for b in loader for i in b["index"][~b["is_pad"]].tolist()]
        assert rows == drawn(sampling.order(n, epoch, SEED), loader.world.rank, loader.world.world_size), epoch
    assert loader.refills == 1  # no reset between them


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "workers, start, rank", [(0, None, 0), (2, "spawn", 0), (2, "fork", 1)], ids=["in-thread", "spawn", "rank-1-of-2"]
)
def test_weighted_epochs_in_a_row_are_each_exactly_their_draw(images, workers, start, rank):
    from dali_pipes import WeightedSampling

    from loader_helpers import TinySpec

    if start == "fork":
        skip_if_fork_refused()
    # 61 draws with repeats from 122 samples: 16 batches of 4 (8 a rank on two), above read_ahead(2, 2) = 6.
    sampling = WeightedSampling(np.linspace(0.5, 3.0, N), num_samples=61)
    run = RunOptions(device="cpu", rank=rank, world_size=1 + rank, py_num_workers=workers, py_start_method=start)
    with DALILoader(
        images, TinySpec(), batch_size=4, seed=SEED, run=run, batch_format=INDEXED, sampling=sampling
    ) as loader:
        read_draws(loader, sampling, N, epochs=4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers, start", [(0, None), (2, "spawn")], ids=["in-thread", "spawn"])
def test_mixed_epochs_in_a_row_are_each_exactly_their_draw(images, tmp_path, workers, start):
    from dali_pipes import Mixture

    from loader_helpers import TinySpec

    other = write_dataset(tmp_path / "other", 30, fmt="hdf5", samples_per_shard=8)
    # 50 a epoch, 15 of them from images and 35 from other: 13 batches of 4, above DALI's read-ahead. Across the
    # epochs each dataset walks its own permutations, so the chained epochs are not one epoch repeated.
    mixture = Mixture({"images": images, "other": other}, proportions={"images": 0.3, "other": 0.7}, num_samples=50)
    run = RunOptions(device="cpu", py_num_workers=workers, py_start_method=start)
    with DALILoader(mixture, TinySpec(), batch_size=4, seed=SEED, run=run, batch_format=INDEXED) as loader:
        sampling = loader.sampling
        read_draws(loader, sampling, N + 30, epochs=4)
        assert sampling.order(N + 30, 0, SEED).tolist() != sampling.order(N + 30, 1, SEED).tolist()
