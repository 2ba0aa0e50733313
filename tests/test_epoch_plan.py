"""The epoch order is computed once per rank per epoch by the loader and shared with DALI's workers."""

from __future__ import annotations

import multiprocessing
import os
import pickle

import numpy as np
import pytest

from dali_pipes import open_store
from dali_pipes.loading.epoch_plan import plan_path, read_plan, write_plan
from dali_pipes.loading.sources import EpochControl, StoreSource
from dali_pipes.sampling import EpochRules, World, rank_indices

from loader_helpers import epoch_folders, write_dataset

N = 23


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("plan") / "ds", N, fields="arrays", samples_per_shard=5)


def _source(store, control, world=World(0, 1)):
    return StoreSource(store, ("label",), EpochRules(batch_size=4, world=world, seed=7), control=control)


def _indices_in_child(source, queue):
    out, i = [], 0
    while True:
        try:
            sample = source(type("Info", (), {"idx_in_epoch": i, "epoch_idx": 0})())
        except StopIteration:
            break
        out.append(int(sample[-1]))
        i += 1
    queue.put(out)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_reads_the_published_plan_instead_of_computing_one(dataset, method):
    store = open_store(dataset)
    control = EpochControl()
    source = _source(store, control)
    # A plan no sampling function would give: the worker must follow it, so it did not compute its own.
    foreign = np.arange(N + 1, dtype=np.int64)[::-1] % N
    control.publish(0, epoch=0, start=0, plan=(foreign, np.zeros(N + 1, dtype=bool)))
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_indices_in_child, args=(pickle.loads(pickle.dumps(source)), queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(60)
    assert got == foreign.tolist()
    control.close()
    assert not os.path.exists(plan_path(control.path))


def test_a_stale_plan_is_ignored_and_the_order_computed(dataset):
    store = open_store(dataset)
    control = EpochControl()
    source = _source(store, control, World(1, 2))
    write_plan(plan_path(control.path), 0, np.zeros(4, dtype=np.int64), np.zeros(4, dtype=bool))
    control.publish(1, epoch=3, start=2)  # no plan for DALI epoch 1: the file holds epoch 0's
    expected = source.indices(3, 2)[0]
    got = [int(source(type("Info", (), {"idx_in_epoch": i, "epoch_idx": 1})())[-1]) for i in range(len(expected))]
    assert got == expected.tolist()
    assert read_plan(plan_path(control.path), 1) is None
    control.close()


@pytest.mark.parametrize("world", [World(0, 1), World(1, 2)])
def test_the_loader_publishes_exactly_the_sampling_order(dataset, world):
    from dali_pipes import BatchFormat, DALILoader, RunOptions
    from dali_pipes.pipelines import Features

    before = epoch_folders()
    loader = DALILoader(
        dataset,
        Features(fields=("label",)),
        batch_size=4,
        seed=7,
        run=RunOptions(device="cpu", rank=world.rank, world_size=world.world_size, py_num_workers=1),
        batch_format=BatchFormat(with_index=True),
    )
    try:
        (folder,) = epoch_folders() - before  # this loader's control block and plans, seen from outside
        for refills, (epoch, start) in enumerate(((0, 0), (2, 0), (2, 8)), 1):
            if start:
                loader.load_state_dict({**loader.state_dict(), "epoch": epoch, "samples_consumed": start})
            else:
                loader.set_epoch(epoch)
            seen = np.concatenate([batch["index"].numpy() for batch in loader])
            expected, expected_pad = rank_indices(N, 4, world.rank, world.world_size, epoch, 7, start=start)
            assert seen.tolist() == expected.tolist()
            # Each of these passes starts a DALI epoch of its own (not the epoch after the last): its plan is
            # the first segment's, written for the DALI epoch counted last.
            assert loader.refills == refills
            plan = read_plan(str(folder / "control.plan"), refills - 1)
            assert plan is not None
            assert plan[0][: len(expected)].tolist() == expected.tolist()
            assert plan[1][: len(expected)].tolist() == expected_pad.tolist()
    finally:
        loader.close()


_KILLED_LOADER = """
import os, signal, sys
import numpy as np
from dali_pipes.loading.sources import EpochControl
control = EpochControl()
control.publish(0, 0, 0, (np.arange(1000), np.zeros(1000, dtype=bool)))
print(os.path.dirname(control.path), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs a writable /dev/shm")
def test_the_plan_of_a_killed_loader_does_not_stay_in_shared_memory(tmp_path):
    # The plan is 9 bytes a sample (90 MB at 10M) in the tmpfs, which is memory until deleted:
    # a training process killed with SIGKILL (the OOM killer) must not leave it there for good.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _KILLED_LOADER], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = proc.stdout.strip()
    assert os.path.isfile(os.path.join(left, "control.plan"))  # the kill left it behind...
    control = EpochControl()  # ...until the next loader starts
    try:
        assert not os.path.exists(left)
        assert os.path.isfile(control.path) and not os.path.samefile(os.path.dirname(control.path), "/dev/shm")
    finally:
        control.close()
    assert not os.path.exists(os.path.dirname(control.path))  # close removes its own folder
