"""Output sizes that change with the epoch: FFCV's schedule, callables, no rebuild on set_epoch, resume."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dali_pipes import BatchFormat, ClassificationTrain, ClassificationVal, DALILoader, ResolutionSchedule, RunOptions

from loader_helpers import write_dataset

N = 10  # 3 batches of 4 per epoch, the last one short
IN_PROCESS = RunOptions(device="cpu", py_num_workers=0)
ONE_WORKER = RunOptions(device="cpu", py_num_workers=1)
INDEXED = BatchFormat(with_index=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("schedule") / "ds", N)


def ffcv_resolution(epoch: int, min_res: int, max_res: int, end_ramp: int, start_ramp: int) -> int:
    """FFCV's ``get_resolution`` (examples/imagenet/train_imagenet.py), as FFCV writes it."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / 32)) * 32


@pytest.mark.parametrize("args", [(160, 192, 65, 76), (160, 256, 2, 13), (128, 224, 0, 5), (64, 96, 10, 11)])
def test_schedule_is_ffcvs_formula(args):
    min_res, max_res, start_ramp, end_ramp = args
    schedule = ResolutionSchedule(*args)
    for epoch in range(end_ramp + 5):
        assert schedule(epoch) == ffcv_resolution(epoch, min_res, max_res, end_ramp, start_ramp), epoch


def test_size_takes_an_int_a_tuple_or_a_callable():
    assert ClassificationTrain(size=(160, 192, 65, 76)).size == ResolutionSchedule(160, 192, 65, 76)
    assert ClassificationTrain(size=(160, 192, 65, 76)).size_at(70) == 160  # 174.5, to the nearest 32
    spec = ClassificationTrain(size=lambda epoch: 96 + 32 * epoch)
    assert [spec.size_at(e) for e in range(3)] == [96, 128, 160] and spec.scheduled
    assert not ClassificationTrain(size=224).scheduled and ClassificationTrain(size=224).batch_inputs is None


@pytest.mark.parametrize(
    "size, message",
    [
        ((160, 192, 65), "4 integers"),
        ((160, 192, 76, 65), "end_ramp"),
        ((192, 160, 65, 76), "max_res"),
        ((0, 160, 1, 2), "min_res"),
        ("224", "schedule or a callable"),
        (0, ">= 1"),
    ],
)
def test_bad_sizes_name_the_argument(size, message):
    with pytest.raises(ValueError, match=message):
        ClassificationTrain(size=size)


def test_a_callable_returning_a_bad_size_names_the_epoch():
    with pytest.raises(ValueError, match="returned 0.5 for epoch 3"):
        ClassificationTrain(size=lambda epoch: 0.5).size_at(3)


@pytest.mark.parametrize("batch_reads", [True, False])
def test_set_epoch_changes_the_size_without_a_new_pipeline_or_workers(dataset, batch_reads):
    spec = ClassificationTrain(size=lambda epoch: 32 + 16 * (epoch % 3))
    run = RunOptions(device="cpu", py_num_workers=1, batch_reads=batch_reads)
    with DALILoader(dataset, spec, batch_size=4, run=run) as loader:
        pids = loader.worker_pids  # a new pipeline would start new reader processes
        assert len(pids) == 1
        for epoch in (0, 1, 2, 1, 0):
            loader.set_epoch(epoch)
            sizes = {tuple(batch["image"].shape[1:]) for batch in loader}
            side = 32 + 16 * (epoch % 3)
            assert sizes == {(3, side, side)}, epoch
            assert loader.worker_pids == pids


def test_without_set_epoch_the_next_epochs_size_follows(dataset):
    spec = ClassificationTrain(size=(32, 96, 0, 2), layout="NHWC")
    with DALILoader(dataset, spec, batch_size=4, run=IN_PROCESS) as loader:
        shapes = [{tuple(b["image"].shape[1:]) for b in loader} for _ in range(3)]
    assert shapes == [{(32, 32, 3)}, {(64, 64, 3)}, {(96, 96, 3)}]


def test_state_records_the_size_and_resume_keeps_it_for_the_rest_of_the_epoch(dataset, caplog):
    spec = ClassificationTrain(size=lambda epoch: 32 + 16 * epoch)
    with DALILoader(dataset, spec, batch_size=4, batch_format=INDEXED, run=ONE_WORKER) as loader:
        loader.set_epoch(1)
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        rest = [b["index"].tolist() for b in it]
    assert state["size"] == 48 and state["epoch"] == 1 and state["samples_consumed"] == 4
    # The schedule changed between the runs: the interrupted epoch still ends at its saved size.
    changed = ClassificationTrain(size=lambda epoch: 64 + 32 * epoch)
    with DALILoader(dataset, changed, batch_size=4, batch_format=INDEXED, run=ONE_WORKER) as resumed:
        with caplog.at_level(logging.WARNING, logger="dali_pipes.loading.epoch_size"):
            resumed.load_state_dict(state)
        assert "saved size 48" in caplog.text
        resumed.set_epoch(1)
        batches = list(resumed)
        assert [b["index"].tolist() for b in batches] == rest
        assert {tuple(b["image"].shape[2:]) for b in batches} == {(48, 48)}
        assert resumed.state_dict()["size"] == 128  # epoch 2 follows the new schedule
        assert {tuple(b["image"].shape[2:]) for b in resumed} == {(128, 128)}


def test_a_bad_saved_size_is_refused(dataset):
    with DALILoader(dataset, ClassificationTrain(size=32), batch_size=4, run=IN_PROCESS) as loader:
        state = {**loader.state_dict(), "samples_consumed": 4}
        with pytest.raises(ValueError, match="size must be an integer"):
            loader.load_state_dict({**state, "size": "big"})


def test_validation_takes_its_own_size(dataset):
    train = ClassificationTrain(size=(32, 64, 0, 1))
    val = ClassificationVal(size=80, resize=96)  # higher than training's: the train-test resolution discrepancy
    with DALILoader(dataset, val, batch_size=4, run=IN_PROCESS) as loader:
        assert {tuple(b["image"].shape[2:]) for b in loader} == {(80, 80)}
    assert train.size_at(0) == 32


def test_auto_augment_follows_the_scheduled_size(dataset):
    # rand_augment's translations are relative to the image: it gets the per-batch size node, not a constant.
    spec = ClassificationTrain(size=(32, 64, 0, 1), auto_augment="rand_augment", jitter=None)
    with DALILoader(dataset, spec, batch_size=4, run=IN_PROCESS) as loader:
        assert [{tuple(b["image"].shape[2:]) for b in loader} for _ in range(2)] == [{(32, 32)}, {(64, 64)}]
