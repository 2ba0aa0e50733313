"""DALILoader in real DDP jobs: 2 and 3 processes, gloo, CPU DALI.

Every rank steps in lockstep (an all-reduce per batch, as in training). The
tests check what the ranks read, together: each epoch exactly once, the same
batch count on every rank, new orders each epoch, the same reads for the same
seed, a resume on another world size, and a decode failure that ends the job
instead of hanging it.
"""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from dali_pipes import BatchFormat, DALILoader, RunOptions
from dali_pipes.sampling import epoch_order, num_batches, rank_indices

from loader_helpers import TinySpec, ddp_worker, free_port, write_dataset  # free_port: imported from here too

N = 23
BATCH = 3


def run_job(world_size, dataset, out_dir, **options):
    options.setdefault("batch_size", BATCH)
    mp.start_processes(
        ddp_worker,
        args=(world_size, free_port(), str(dataset), str(out_dir), options),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(world_size)]


def global_order(per_rank_batches):
    """Real samples in the order the job read them: batch 0 of every rank, then batch 1, ..."""
    order = []
    for step in zip(*per_rank_batches):
        for indices, pads in step:
            order.extend(i for i, pad in zip(indices, pads) if not pad)
    return order


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("ddp") / "ds", N)


@pytest.mark.timeout(240)
def test_ranks_reading_on_from_epoch_to_epoch_cover_each_epoch_exactly_once(tmp_path):
    n = 97  # 17 batches of 3 a rank on 2 ranks, the last padded: more than DALI reads ahead, so epochs read on
    dataset = write_dataset(tmp_path / "ds", n)
    reports = run_job(2, dataset, tmp_path, epochs=3, partial=2, workers=1, seed=0)
    for epoch in range(3):
        per_rank = [r["epochs"][epoch] for r in reports]
        assert global_order(per_rank) == epoch_order(n, epoch, 0).tolist()  # the union is the dataset, each once
    assert [r["refills"] for r in reports] == [1, 1]  # one DALI epoch per rank read all three
    for rank, report in enumerate(reports):  # and on into epoch 3, left after 2 batches
        assert sum((b[0] for b in report["partial"]), []) == rank_indices(n, BATCH, rank, 2, 3, 0)[0][:6].tolist()
        assert report["state"]["epoch"] == 3 and report["state"]["samples_consumed"] == 12


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size, workers", [(2, 1), (3, 0)])
def test_ranks_cover_each_epoch_exactly_once(dataset, tmp_path, world_size, workers):
    reports = run_job(world_size, dataset, tmp_path, epochs=2, partial=2, repeat=True, workers=workers, seed=0)
    expected_batches = num_batches(N, BATCH, world_size)
    assert [r["world"] for r in reports] == [[rank, world_size] for rank in range(world_size)]
    assert all(r["len"] == expected_batches for r in reports)
    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in reports]
        assert [len(batches) for batches in per_rank] == [expected_batches] * world_size
        order = global_order(per_rank)
        assert order == epoch_order(N, epoch, 0).tolist()  # the union is the dataset, each sample once
        for rank, batches in enumerate(per_rank):
            indices, pads = rank_indices(N, BATCH, rank, world_size, epoch, 0)
            assert [i for b in batches for i in b[0]] == indices.tolist()
            assert [p for b in batches for p in b[1]] == pads.tolist()
    assert global_order([r["epochs"][0] for r in reports]) != global_order([r["epochs"][1] for r in reports])
    # Same seed, same reads: a second loader in each rank repeats epoch 0.
    assert [r["twin"] for r in reports] == [r["epochs"][0] for r in reports]

    # Resume the part-read epoch 2 on another world size, from rank 0's saved state.
    states = [r["state"] for r in reports]
    assert all(state == states[0] for state in states)
    taken = global_order([r["partial"] for r in reports])
    assert states[0]["epoch"] == 2 and states[0]["samples_consumed"] == len(taken) == 2 * BATCH * world_size
    new_world = 5 - world_size  # 2 -> 3 and 3 -> 2
    loaders = [
        DALILoader(
            dataset,
            TinySpec(),
            batch_size=BATCH,
            run=RunOptions(device="cpu", rank=r, world_size=new_world, py_num_workers=1),
            batch_format=BatchFormat(with_index=True),
        )
        for r in range(new_world)
    ]
    for loader in loaders:
        loader.load_state_dict(states[0])
    rest = global_order([[[b["index"].tolist(), b["is_pad"].tolist()] for b in loader] for loader in loaders])
    assert taken + rest == epoch_order(N, 2, 0).tolist()


@pytest.mark.timeout(180)
def test_a_decode_failure_on_one_rank_ends_the_job_naming_the_sample(tmp_path):
    # Without shuffling rank 1 reads samples 3, 4, 5 in the first step; sample 4 is damaged.
    dataset = write_dataset(tmp_path / "bad", 12, corrupt=frozenset({4}))
    # The job ends (rank 1 raises, rank 0's all-reduce then loses its peer) instead of hanging.
    with pytest.raises(mp.ProcessRaisedException):
        run_job(2, dataset, tmp_path, epochs=1, workers=1, shuffle=False)
    message = (tmp_path / "rank-1.error").read_text()
    assert "sample 4 (field 'image', shard shard-00000.lmdb, record 4) cannot be decoded" in message
    assert not (tmp_path / "rank-0.error").exists()
