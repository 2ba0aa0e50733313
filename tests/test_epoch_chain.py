"""One DALI epoch reads training epochs in a row (loading/epoch_chain.py): the same batches, without a reset between."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dali_pipes import DALILoader
from dali_pipes.pipelines import ClassificationTrain, Features
from dali_pipes.sampling import rank_indices

from loader_helpers import write_dataset

SEED = 5


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("chain") / "images", 120, samples_per_shard=40)


def scheduled(epoch: int) -> int:
    return 32 + 8 * epoch


def expected(n: int, epoch: int, rank: int = 0, world_size: int = 1, start: int = 0) -> list[int]:
    return rank_indices(n, 4, rank, world_size, epoch, SEED, start=start)[0].tolist()


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
    with DALILoader(
        images, spec, batch_size=4, seed=SEED, device="cpu", rank=rank, world_size=world,
        batch_reads=reads, py_num_workers=workers, with_index=True,
    ) as loader:  # fmt: skip
        assert loader._chain.enabled
        for epoch in range(4):
            if epoch % 2:
                loader.set_epoch(epoch)  # the epoch that follows anyway: still read on
            indices, sizes = read(loader)
            assert indices == [i for i in expected(120, epoch, rank, world) if i >= 0]
            assert sizes == {(scheduled(epoch), scheduled(epoch))}
        assert loader._chain.dali_epoch == 0  # one DALI epoch read all four: no reset, no refill


def test_any_other_next_pass_starts_a_new_dali_epoch_with_the_right_samples(images):
    with DALILoader(
        images, ClassificationTrain(size=32), batch_size=4, seed=SEED, device="cpu", py_num_workers=2, with_index=True
    ) as loader:
        assert read(loader)[0] == expected(120, 0)
        loader.set_epoch(3)  # not the epoch DALI was reading on into
        assert read(loader)[0] == expected(120, 3)
        assert loader._chain.dali_epoch == 1
        batches = iter(loader)  # epoch 4, chained, left after 5 batches
        left = [next(batches)["index"].tolist() for _ in range(5)]
        assert sum(left, []) == expected(120, 4)[:20]
        assert read(loader)[0] == expected(120, 5)  # a pass left part-way: the next epoch, from its start
        state = {**loader.state_dict(), "epoch": 7, "samples_consumed": 40}
        loader.load_state_dict(state)
        assert read(loader)[0] == expected(120, 7, start=40)
        assert read(loader)[0] == expected(120, 8)  # read on from the resumed pass
        assert loader._chain.dali_epoch == 3  # new DALI epochs at 3, 5 and the resumed 7; 4 and 8 read on


@pytest.mark.parametrize("reads", [True, False], ids=["batch", "sample"])
def test_epochs_one_batch_longer_than_dali_reads_ahead_stay_exact_under_a_slow_consumer(tmp_path, reads):
    # The chain publishes one epoch ahead; an epoch just longer than DALI's read-ahead is the tightest case.
    dataset = write_dataset(tmp_path / "ds", 28, samples_per_shard=10)  # 7 batches: prefetch 2 + 2 in flight + 2
    with DALILoader(
        dataset, ClassificationTrain(size=32), batch_size=4, seed=SEED, device="cpu",
        batch_reads=reads, py_num_workers=2, prefetch=2, with_index=True,
    ) as loader:  # fmt: skip
        assert loader._chain.enabled
        for epoch in range(5):
            indices = []
            for batch in loader:
                time.sleep(0.02)  # DALI fills every queue while the step runs
                indices += batch["index"].tolist()
            assert indices == expected(28, epoch)
        assert loader._chain.dali_epoch == 0


def test_epochs_shorter_than_dali_reads_ahead_start_a_dali_epoch_each(tmp_path):
    dataset = write_dataset(tmp_path / "ds", 12, samples_per_shard=5)  # 3 batches
    with DALILoader(
        dataset, ClassificationTrain(size=32), batch_size=4, seed=SEED, device="cpu", py_num_workers=2, with_index=True
    ) as loader:
        assert not loader._chain.enabled
        for epoch in range(3):
            assert read(loader)[0] == expected(12, epoch)
        assert loader._chain.dali_epoch == 2


def test_plain_feature_rows_read_on_too(tmp_path):
    dataset = write_dataset(tmp_path / "rows", 50, fields="arrays", samples_per_shard=20)
    with DALILoader(
        dataset, Features(fields=("features", "label")), batch_size=4, seed=SEED, device="cpu", with_index=True
    ) as loader:
        assert loader._pipe is None and loader._chain.enabled  # no DALI graph: read only when asked
        for epoch in range(3):
            rows = np.concatenate([b["index"][~b["is_pad"]].numpy() for b in loader]).tolist()
            assert rows == [i for i in expected(50, epoch) if i >= 0]
        assert loader._chain.dali_epoch == 0
