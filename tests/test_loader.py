"""DALILoader on the CPU: coverage, epochs, resume, padding, devices and errors.

Several ranks are simulated in one process with explicit ``rank``/``world_size``
(the real multi-process runs are in ``test_ddp.py``). Loaders read the store in
one forked DALI worker by default (cheap, and the path training takes);
``RunOptions(py_num_workers=0)`` (reading in the main process) and spawned workers have their
own tests. Those marked ``driver_init`` run again with every worker spawned (tests/README.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from dali_pipes import BatchFormat, DALILoader, LoaderError, ManifestError, RunOptions, StoreError
from dali_pipes.sampling import epoch_order, num_batches, rank_indices

from loader_helpers import SIZE, TinySpec, batch_rows, epoch_folders, free_port, grey_level, write_dataset

N = 23  # not a multiple of any batch or world size used below


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("loader") / "ds", N)


def cpu(**fields) -> RunOptions:
    """The CPU with one reader process, unless ``fields`` say otherwise."""
    return RunOptions(**{"device": "cpu", "py_num_workers": 1, **fields})


def make(path, **kwargs):
    """A loader of TinySpec (or ``spec``), batch 4, with ``index``, on :func:`cpu` unless ``run`` says otherwise."""
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("run", cpu())
    kwargs.setdefault("batch_format", BatchFormat(with_index=True))
    return DALILoader(path, kwargs.pop("spec", TinySpec()), **kwargs)


def epoch_rows(loader):
    return [batch_rows(batch) for batch in loader]


def flat(batches, *, skip_pad=True):
    return [index for rows in batches for index, _, pad, _ in rows if not (skip_pad and pad)]


def lockstep(loaders, batches=None):
    """Iterate loaders (one per simulated rank) together; return the global read order of real samples."""
    iterators = [iter(loader) for loader in loaders]
    order = []
    taken = 0
    while batches is None or taken < batches:
        try:
            step = [batch_rows(next(it)) for it in iterators]
        except StopIteration:
            break
        taken += 1
        for rows in step:
            order.extend(index for index, _, pad, _ in rows if not pad)
    return order


# --- what a batch is ---------------------------------------------------------------------------


@pytest.mark.driver_init
def test_batches_are_plain_dicts_of_tensors_with_the_right_samples(dataset):
    loader = make(dataset, shuffle=False)
    batches = list(loader)
    assert len(batches) == len(loader) == num_batches(N, 4) == 6
    first = batches[0]
    assert isinstance(first, dict) and set(first) == {"image", "label", "is_pad", "index"}
    assert first["image"].shape == (4, SIZE, SIZE, 3) and first["image"].dtype == torch.uint8
    assert first["label"].shape == (4,) and first["label"].dtype == torch.int64
    assert first["is_pad"].dtype == torch.bool and first["index"].dtype == torch.int64
    rows = [row for batch in batches for row in batch_rows(batch)]
    assert [index for index, *_ in rows] == list(range(N))
    for index, label, pad, grey in rows:
        assert label == index % 5  # the label stored with the sample
        assert abs(grey - grey_level(index)) <= 3  # the pixels of that very sample
        assert not pad
    # 23 = 5 * 4 + 3: the last batch is trimmed to the samples this rank owns.
    assert batches[-1]["image"].shape[0] == 3


def test_without_index_there_is_no_index(dataset):
    batch = next(iter(make(dataset, batch_format=BatchFormat())))
    assert set(batch) == {"image", "label", "is_pad"}


def test_reading_in_the_main_process(tmp_path):
    loader = make(write_dataset(tmp_path / "main", 9), run=cpu(py_num_workers=0), seed=8)
    assert flat(epoch_rows(loader)) == epoch_order(9, 0, 8).tolist()
    iterator = iter(loader)
    next(iterator)  # left part-way: the cut-short epoch ends in the main process too
    assert flat(epoch_rows(loader)) == epoch_order(9, 2, 8).tolist()


def test_ranks_read_their_sampling_slices_and_cover_the_epoch_once(dataset):
    world = 3
    loaders = [make(dataset, run=cpu(rank=r, world_size=world), seed=5) for r in range(world)]
    for epoch in range(2):
        per_rank = [epoch_rows(loader) for loader in loaders]
        for rank, batches in enumerate(per_rank):
            expected, expected_pad = rank_indices(N, 4, rank, world, epoch, 5)
            assert len(batches) == num_batches(N, 4, world) == len(loaders[rank]) == 2
            assert flat(batches, skip_pad=False) == expected.tolist()
            assert [pad for rows in batches for _, _, pad, _ in rows] == expected_pad.tolist()
        seen = sorted(index for batches in per_rank for index in flat(batches))
        assert seen == list(range(N))
    # The pad flags sit on the filler: 23 samples over 3 ranks x 8 slots leaves one.
    assert sum(pad for batches in per_rank for rows in batches for _, _, pad, _ in rows) == 1


def test_epochs_differ_and_the_same_seed_repeats(dataset):
    loader = make(dataset, seed=3)
    first, second = flat(epoch_rows(loader)), flat(epoch_rows(loader))  # no set_epoch: the next epoch anyway
    assert sorted(first) == sorted(second) == list(range(N))
    assert first != second
    assert first == epoch_order(N, 0, 3).tolist() and second == epoch_order(N, 1, 3).tolist()
    again = make(dataset, seed=3)
    assert flat(epoch_rows(again)) == first
    again.set_epoch(1)
    assert flat(epoch_rows(again)) == second
    other = make(dataset, seed=4)
    assert flat(epoch_rows(other)) != first


def test_set_epoch_reshuffles_like_distributed_sampler(dataset):
    loader = make(dataset)
    loader.set_epoch(7)
    assert loader.epoch == 7
    assert flat(epoch_rows(loader)) == epoch_order(N, 7, 0).tolist()
    loader.set_epoch(7)  # the same epoch again gives the same order
    assert flat(epoch_rows(loader)) == epoch_order(N, 7, 0).tolist()
    assert loader.state_dict()["epoch"] == 8


def test_drop_last_batch(dataset):
    world = 2
    loaders = [make(dataset, run=cpu(rank=r, world_size=world), last_batch="drop", seed=1) for r in range(world)]
    batches = [epoch_rows(loader) for loader in loaders]
    assert [len(b) for b in batches] == [2, 2] == [len(loader) for loader in loaders]  # 23 // 8
    assert all(len(rows) == 4 for per_rank in batches for rows in per_rank)
    assert not any(pad for per_rank in batches for rows in per_rank for _, _, pad, _ in rows)
    order = epoch_order(N, 0, 1).tolist()
    assert sorted(i for per_rank in batches for i in flat(per_rank)) == sorted(order[:16])


def test_drop_with_fewer_samples_than_a_global_batch_yields_nothing(tmp_path):
    path = write_dataset(tmp_path / "small", 5)
    loader = make(path, batch_size=4, run=cpu(rank=0, world_size=2), last_batch="drop")
    assert len(loader) == 0
    assert list(loader) == []
    assert loader.state_dict()["epoch"] == 1  # an empty epoch still ends


def test_tiny_dataset_on_a_large_world_pads_every_rank(tmp_path):
    path = write_dataset(tmp_path / "tiny", 2)
    loaders = [make(path, batch_size=4, run=cpu(rank=r, world_size=3), shuffle=False) for r in range(3)]
    batches = [epoch_rows(loader) for loader in loaders]
    assert [len(b) for b in batches] == [1, 1, 1]
    assert [[(i, pad) for i, _, pad, _ in b[0]] for b in batches] == [[(0, False)], [(1, False)], [(0, True)]]


# --- resume ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_before, world_after, batch_after", [(1, 1, 4), (2, 3, 4), (3, 1, 4), (2, 2, 3)])
def test_resume_mid_epoch_gives_exactly_the_rest(dataset, world_before, world_after, batch_after):
    before = [make(dataset, run=cpu(rank=r, world_size=world_before), seed=9) for r in range(world_before)]
    for loader in before:
        loader.set_epoch(2)
    taken = lockstep(before, batches=1)
    states = [loader.state_dict() for loader in before]
    assert all(state == states[0] for state in states)  # every rank saves the same state
    assert states[0]["epoch"] == 2 and states[0]["samples_consumed"] == len(taken) == 4 * world_before

    after = [
        make(dataset, run=cpu(rank=r, world_size=world_after), seed=9, batch_size=batch_after)
        for r in range(world_after)
    ]
    for loader in after:
        loader.load_state_dict(states[0])
        loader.set_epoch(2)  # the usual epoch loop after a resume keeps the offset
    assert all(len(loader) == num_batches(N, batch_after, world_after, start=len(taken)) for loader in after)
    rest = lockstep(after)
    assert taken + rest == epoch_order(N, 2, 9).tolist()
    # ... and the pass after that is the next whole epoch.
    assert after[0].state_dict()["epoch"] == 3 and after[0].state_dict()["samples_consumed"] == 0
    assert sorted(lockstep(after)) == list(range(N))


@pytest.mark.driver_init
def test_state_counts_batches_handed_out_not_prefetched(dataset):
    loader = make(dataset, run=cpu(py_num_workers=2, prefetch=3), seed=2)
    iterator = iter(loader)
    first = [batch_rows(next(iterator)) for _ in range(2)]
    state = loader.state_dict()
    assert state["samples_consumed"] == 8  # DALI has read further ahead than that
    resumed = make(dataset, seed=2)
    resumed.load_state_dict(state)
    assert flat(first) + flat(epoch_rows(resumed)) == epoch_order(N, 0, 2).tolist()


@pytest.mark.driver_init
def test_leaving_a_pass_part_way_starts_the_next_epoch(tmp_path):
    n = 400
    path = write_dataset(tmp_path / "long", n, samples_per_shard=100)
    loader = make(path, run=cpu(py_num_workers=2), seed=4)  # parallel workers: the cut-short epoch is drained
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["samples_consumed"] == 8
    iterator = iter(loader)
    first = next(iterator)
    assert flat([batch_rows(first)]) + flat(batch_rows(b) for b in iterator) == epoch_order(n, 1, 4).tolist()
    assert flat(epoch_rows(loader)) == epoch_order(n, 2, 4).tolist()


@pytest.mark.driver_init
@pytest.mark.timeout(120)
def test_the_rest_of_a_pass_left_part_way_is_not_read(tmp_path):
    # Only what DALI had read ahead of the cut is read, not the other 48 batches: sample 150 (batch 38 in
    # order) cannot be decoded, and reading it while the next pass starts would raise.
    path = write_dataset(tmp_path / "long", 200, samples_per_shard=50, corrupt=frozenset({150}))
    loader = make(path, run=cpu(py_num_workers=2), shuffle=False)
    iterator = iter(loader)
    assert flat([batch_rows(next(iterator)), batch_rows(next(iterator))]) == list(range(8))
    iterator = iter(loader)  # epoch 1, from its start
    assert flat(batch_rows(next(iterator)) for _ in range(3)) == list(range(12))
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["samples_consumed"] == 12
    loader.close()


def test_state_at_the_end_of_an_epoch_points_at_the_next(dataset):
    loader = make(dataset)
    iterator = iter(loader)
    for _ in range(len(loader)):
        next(iterator)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["samples_consumed"] == 0


def test_state_dict_round_trip_and_mismatches(dataset):
    loader = make(dataset, seed=1)
    state = loader.state_dict()
    assert state == {
        "version": 1,
        "epoch": 0,
        "samples_consumed": 0,
        "num_samples": N,
        "seed": 1,
        "shuffle": True,
        "last_batch": "pad",
    }
    loader.load_state_dict({**state, "epoch": 4, "samples_consumed": 5})
    assert loader.state_dict()["epoch"] == 4 and loader.state_dict()["samples_consumed"] == 5
    with pytest.raises(ValueError, match="seed=2 but this loader has seed=1"):
        loader.load_state_dict({**state, "seed": 2})
    with pytest.raises(ValueError, match="num_samples"):
        loader.load_state_dict({**state, "num_samples": N + 1})
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="samples_consumed"):
        loader.load_state_dict({**state, "samples_consumed": N + 1})


# --- workers ---------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_spawned_workers(dataset):
    loader = make(dataset, run=cpu(py_num_workers=2, py_start_method="spawn"), seed=6)
    assert flat(epoch_rows(loader)) == epoch_order(N, 0, 6).tolist()
    assert flat(epoch_rows(loader)) == epoch_order(N, 1, 6).tolist()
    loader.close()


@pytest.mark.driver_init
@pytest.mark.parametrize("fmt", ["hdf5", "tfrecord"])
def test_other_formats(tmp_path, fmt):
    path = write_dataset(tmp_path / fmt, 11, fmt=fmt, samples_per_shard=4)
    rows = [row for rows in epoch_rows(make(path, shuffle=False)) for row in rows]
    assert [(index, label) for index, label, _, _ in rows] == [(i, i % 5) for i in range(11)]
    assert all(abs(grey - grey_level(index)) <= 3 for index, _, _, grey in rows)


def test_the_real_classification_spec(dataset):
    from dali_pipes.pipelines import ClassificationTrain, ClassificationVal

    train = make(dataset, spec=ClassificationTrain(size=32))
    batch = next(iter(train))
    assert batch["image"].shape == (4, 3, 32, 32) and batch["image"].dtype == torch.float32
    assert batch["label"].tolist() == [i % 5 for i in batch["index"].tolist()]
    val = make(dataset, spec=ClassificationVal(size=16, resize=20), shuffle=False)
    assert sum(len(b["image"]) for b in val) == N


# --- devices and ranks -------------------------------------------------------------------------------


def test_auto_device_is_the_cpu_without_cuda(dataset, caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    caplog.set_level("INFO", logger="dali_pipes")
    loader = make(dataset, run=cpu(device="auto"))
    assert loader.device == "cpu"
    lines = [r.getMessage() for r in caplog.records if r.name == "dali_pipes.loading.loader"]
    assert len(lines) == 1 and "on CPU (device='auto': no CUDA here)" in lines[0]
    assert next(iter(loader))["image"].device.type == "cpu"


def test_gpu_without_cuda_is_refused(dataset, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        make(dataset, run=cpu(device="gpu"))


def test_rank_and_world_from_the_environment(dataset, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = make(dataset)
    assert (loader.world.rank, loader.world.world_size) == (1, 2)
    assert flat(epoch_rows(loader), skip_pad=False) == rank_indices(N, 4, 1, 2, 0, 0)[0].tolist()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        make(dataset)


def test_rank_from_torch_distributed_and_contradictions(dataset):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        loader = make(dataset, run=cpu(rank=0, world_size=1))
        assert (loader.world.rank, loader.world.world_size) == (0, 1)
        with pytest.raises(ValueError, match="contradict torch.distributed"):
            make(dataset, run=cpu(rank=1, world_size=2))
        with pytest.raises(ValueError, match="contradict torch.distributed"):
            make(dataset, run=cpu(world_size=4))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_gpu_pipeline(dataset):
    loader = make(dataset, run=cpu(device="gpu", py_start_method="spawn"))
    batches = list(loader)
    assert all(value.is_cuda for value in batches[0].values())
    assert sorted(i for b in batches for i, pad in zip(b["index"].tolist(), b["is_pad"].tolist()) if not pad) == list(
        range(N)
    )


@pytest.mark.gpu
def test_gpu_classification_spec(dataset):
    from dali_pipes.pipelines import ClassificationTrain

    loader = make(
        dataset,
        spec=ClassificationTrain(size=32, dtype="float16"),
        run=cpu(device="gpu", py_start_method="spawn"),
    )
    batch = next(iter(loader))
    assert batch["image"].is_cuda and batch["image"].shape == (4, 3, 32, 32) and batch["image"].dtype == torch.float16


# --- bad input ---------------------------------------------------------------------------------------


def test_a_folder_without_manifest(tmp_path):
    with pytest.raises(ManifestError, match="no index.json"):
        make(tmp_path)


# RunOptions' and DataOptions' own fields are refused when the config is made: test_loader_config.py.
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"batch_size": 2.5}, ValueError, "batch_size must be an integer"),
        ({"last_batch": "keep"}, ValueError, "last_batch must be one of"),
        ({"spec": object()}, TypeError, "pipeline must be a pipeline spec"),
        ({"run": {"rank": 2, "world_size": 2}}, ValueError, "rank must be < world_size"),
    ],
)
def test_bad_arguments(dataset, kwargs, error, message):
    if "run" in kwargs:
        kwargs = {**kwargs, "run": cpu(**kwargs["run"])}
    with pytest.raises(error, match=message):
        make(dataset, **kwargs)


def test_a_pipeline_that_needs_fields_the_dataset_lacks(tmp_path):
    path = write_dataset(tmp_path / "features", 6, fields="arrays")
    with pytest.raises(ValueError, match=r"TinySpec needs the field\(s\) 'image'.*has only 'features', 'label'") as exc:
        make(path)
    # It says which spec does fit, in the words of the public API.
    assert str(exc.value).endswith("for feature arrays use dali_pipes.Features(fields=('features', 'label'))")


def test_a_spec_may_not_take_the_loaders_output_names(dataset):
    class Clashing(TinySpec):
        def build(self, inputs, *, device):
            return {**super().build(inputs, device=device), "is_pad": inputs["label"]}

    with pytest.raises(ValueError, match="'is_pad', a name the loader adds itself"):
        make(dataset, spec=Clashing())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.driver_init)])
def test_an_undecodable_image_raises_naming_the_sample(tmp_path, workers):
    path = write_dataset(tmp_path / "bad", 12, corrupt=frozenset({6}), samples_per_shard=5)
    loader = make(path, shuffle=False, run=cpu(py_num_workers=workers))
    named = r"sample 6 \(field 'image', shard shard-00001.lmdb, record 1\) cannot be decoded"
    with pytest.raises(LoaderError, match=named):
        list(loader)
    with pytest.raises(LoaderError, match="failed earlier"):
        iter(loader)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.driver_init)])
def test_an_unreadable_shard_raises_naming_the_shard_and_sample(tmp_path, workers):
    path = write_dataset(tmp_path / "lost", 12, samples_per_shard=5)
    loader = make(path, shuffle=False, run=cpu(py_num_workers=workers))
    os.remove(path / "shard-00001.lmdb")
    with pytest.raises(StoreError, match=r"sample 5 \(shard shard-00001.lmdb, record 0\)"):
        list(loader)


@pytest.mark.driver_init
def test_close_removes_the_epoch_control_file(dataset):
    before = epoch_folders()
    loader = make(dataset)
    (folder,) = epoch_folders() - before  # the loader's control block, in shared memory
    assert any(folder.iterdir())
    loader.close()
    assert not folder.exists()
    with pytest.raises(LoaderError, match="closed"):
        iter(loader)


@pytest.mark.timeout(60)
def test_forked_workers_do_not_inherit_dali_garbage(dataset):
    # An uncollected pipeline in the parent, finalized by a forked worker's own GC,
    # used to hang that worker (DALI's destructor waits for threads the child lacks).
    for _ in range(3):
        old = make(dataset)
        next(iter(old))
        cycle = [old]
        cycle.append(cycle)
        del old, cycle
        loader = make(dataset)
        assert len(next(iter(loader))["index"]) == 4


def test_a_converted_folder_of_real_photos(imagenet_mini, tmp_path):
    from converters.runner import convert
    from converters.sources.imagefolder import ImageFolderSource
    from dali_pipes import open_store
    from dali_pipes.pipelines import ClassificationTrain

    out = tmp_path / "imagenet-mini"
    convert(ImageFolderSource(imagenet_mini), out, format="lmdb", samples_per_shard=16, workers=1, progress=False)
    store = open_store(out)
    loader = make(out, spec=ClassificationTrain(size=64), batch_size=8)
    seen = {}
    for batch in loader:
        assert batch["image"].shape[1:] == (3, 64, 64) and batch["image"].dtype == torch.float32
        for index, label in zip(batch["index"].tolist(), batch["label"].tolist()):
            seen[index] = label
    assert sorted(seen) == list(range(len(store)))
    assert all(int(store[i]["label"]) == label for i, label in seen.items())
