"""Batch reads (one call per batch, sorted and coalesced per shard) give exactly what per-sample reads gave."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from dali_pipes import BatchFormat, DALILoader, LoaderError, RunOptions, StoreError, open_store
from dali_pipes.pipelines import Features

from loader_helpers import TinySpec, damage_shard, flip_image_header, write_dataset

FORMATS = ("lmdb", "hdf5", "tfrecord")
N = 23
CPU = RunOptions(device="cpu")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return {
        (fmt, kind): write_dataset(root / f"{fmt}-{kind}", N, fmt=fmt, fields=kind, samples_per_shard=5)
        for fmt in FORMATS
        for kind in ("images", "arrays")
    }


@pytest.mark.parametrize("kind", ["images", "arrays"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_batch_read_equals_sample_reads(datasets, fmt, kind):
    store = open_store(datasets[fmt, kind])
    # Every shard, out of order, with repeats; one field subset too.
    indices = np.random.default_rng(1).integers(0, N, 60)
    for fields in (None, ("label",)):
        batch = store.read_batch(indices, fields)
        for position, index in enumerate(indices.tolist()):
            sample = store.read(index, fields)
            assert batch.keys() == sample.keys()
            for name, value in sample.items():
                got = batch[name][position]
                if isinstance(value, bytes):
                    assert got == value
                else:
                    assert got.dtype == value.dtype and np.array_equal(got, value)
        # arrays=True: the same bytes, as uint8 arrays; every other field as without it.
        viewed = store.read_batch(indices, fields, arrays=True)
        assert viewed.keys() == batch.keys()
        for name, values in viewed.items():
            if store.fields[name].kind != "bytes":
                assert np.array_equal(values, batch[name])
                continue
            assert all(isinstance(v, np.ndarray) and v.dtype == np.uint8 for v in values)
            assert [v.tobytes() for v in values] == batch[name]
    if fmt == "hdf5":  # the fixed fields were gathered from the mapped file, not through h5py
        maps = store.shard_readers[0]._h_maps
        assert maps["label"] is not None and (kind == "images" or maps["features"] is not None)
    store.close()


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_array_reads_copy_each_shard_once_and_outlive_the_store(datasets, fmt):
    """arrays=True from a map: each shard's records copied into one buffer, valid after the store closes."""
    import gc

    store = open_store(datasets[fmt, "images"])
    indices = np.array([7, 1, 8, 2, 7])  # shards of 5: two shards, a repeat
    expected = [store.read(int(i), ("image",))["image"] for i in indices]
    got = store.read_batch(indices, ("image",), arrays=True)["image"]
    owners = {id(v.base) for v in got}
    assert len(owners) == 2 and all(isinstance(v.base, np.ndarray) and v.base.flags.owndata for v in got)
    store.close()  # LMDB's environment and the HDF5 file are closed, their maps gone
    gc.collect()
    assert [v.tobytes() for v in got] == expected


def test_a_damaged_image_is_caught_in_array_reads_too(tmp_path):
    """Array reads are CRC-checked too: a byte changed in the shard names the sample."""
    path = write_dataset(tmp_path / "ds", N, fmt="lmdb", fields="images", samples_per_shard=5)
    flip_image_header(path, "lmdb", 2, 13)
    store = open_store(path)
    with pytest.raises(StoreError, match=r"sample 13 \(shard shard-00002.lmdb, record 3\).*CRC"):
        store.read_batch(np.array([0, 12, 13, 22]), ("image",), arrays=True)
    store.close()


@pytest.mark.parametrize("fmt,readers", [("lmdb", 0), ("hdf5", 0), ("tfrecord", 1)])
def test_the_loader_reads_zero_copy_formats_in_its_own_process_by_default(datasets, fmt, readers):
    """No reader processes for LMDB and HDF5 batches (copied out of the map); workers for TFRecord; images exact."""
    from dali_pipes.loading.options import default_py_num_workers

    assert default_py_num_workers(fmt, True, cpus=16) == (0 if readers == 0 else 4)
    assert default_py_num_workers(fmt, False, cpus=16) == 4  # per-sample reads keep their workers
    # Feeding the GPU decoder, the loader's one thread is the limit on a large machine, not on a small one.
    # One process per 4 cores of the rank, 2 to 8 of them (issue 49).
    assert [default_py_num_workers(fmt, True, cpus=c, gpu_images=True) for c in (4, 8, 16, 32, 128)] == (
        [0, 2, 4, 8, 8] if readers == 0 else [2, 4, 4, 4, 4]
    )
    assert default_py_num_workers(fmt, True, cpus=16, workers=0, gpu_images=True) == 0  # a count given is kept
    store = open_store(datasets[fmt, "images"])
    expected = {i: np.frombuffer(store.read(i, ("image",))["image"], np.uint8) for i in range(N)}
    store.close()
    with DALILoader(
        datasets[fmt, "images"], EncodedBytes(), batch_size=4, run=CPU, batch_format=BatchFormat(with_index=True)
    ) as loader:
        assert loader.py_num_workers == readers and (loader.worker_pids == []) == (readers == 0)
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            for batch in loader:
                for row in range(len(batch["index"])):
                    got, index = batch["image"][row].numpy(), int(batch["index"][row])
                    size = len(expected[index])
                    assert got[:size].tobytes() == expected[index].tobytes() and not got[size:].any()


class EncodedBytes:
    """A spec handing out the encoded bytes as read, zero-padded to the batch's longest, and the label."""

    required_fields: tuple[str, ...] = ("image", "label")
    needs_conditionals: bool = False

    def build(self, inputs, *, device):
        from nvidia.dali import fn

        return {"image": fn.pad(inputs["image"], axes=[0], fill_value=0), "label": inputs["label"]}


def _spec(kind):
    return TinySpec() if kind == "images" else Features(fields=("features", "label"))


def _epochs(path, kind, batch_reads, *, rank=0, world_size=1, state=None, workers=1):
    loader = DALILoader(
        path,
        _spec(kind),
        batch_size=4,
        seed=5,
        run=RunOptions(device="cpu", rank=rank, world_size=world_size, py_num_workers=workers, batch_reads=batch_reads),
        batch_format=BatchFormat(with_index=True),
    )
    seen = []
    try:
        for epoch in (0, 1):
            if state is not None and epoch == 1:
                loader.load_state_dict({**loader.state_dict(), "epoch": 1, "samples_consumed": state})
            else:
                loader.set_epoch(epoch)
            for batch in loader:
                seen.append({name: value.numpy().copy() for name, value in batch.items()})
    finally:
        loader.close()
    return seen


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for name in x:
            assert x[name].dtype == y[name].dtype and np.array_equal(x[name], y[name]), name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["arrays", "images"])
def test_loader_batches_equal_per_sample_batches_with_pad_resume_and_two_ranks(datasets, fmt, kind):
    path = datasets[fmt, kind]
    # N = 23 with batch 4: the last batch is padded; two ranks split it; epoch 1 resumes at sample 8.
    for rank, world_size in ((0, 1), (0, 2), (1, 2)):
        batched = _epochs(path, kind, True, rank=rank, world_size=world_size, state=8)
        per_sample = _epochs(path, kind, False, rank=rank, world_size=world_size, state=8)
        _same(batched, per_sample)
        # On two ranks, 23 samples leave 7 in the last global batch: 4 each, rank 1's last one padding.
        assert any(b["is_pad"].any() for b in batched) == (rank == 1)


def test_a_damaged_record_names_the_sample_in_batch_mode(tmp_path):
    path = write_dataset(tmp_path / "ds", N, fmt="tfrecord", fields="images", samples_per_shard=5)
    flip_image_header(path, "tfrecord", 2, 13)  # the record's CRC no longer matches
    store = open_store(path)
    with pytest.raises(StoreError, match=r"sample 13 \(shard shard-00002.tfrecord, record 3\).*CRC"):
        store.read_batch(np.array([0, 12, 13, 22]), ("image",))
    assert store.read_batch(np.array([0, 12, 14]), ("label",))["label"].tolist() == [0, 2, 4]
    store.close()


def test_a_damaged_shard_fails_the_batch_loader_naming_shard_and_sample(tmp_path):
    path = write_dataset(tmp_path / "ds", N, fmt="tfrecord", fields="images", samples_per_shard=5)
    damage_shard(path, "tfrecord", "truncate", 2, 11)
    run = RunOptions(device="cpu", py_num_workers=1, batch_reads=True)
    loader = DALILoader(path, TinySpec(), batch_size=4, run=run, shuffle=False)
    try:
        with pytest.raises(LoaderError, match=r"shard-00002.tfrecord.*record") as info:
            for _ in loader:
                pass
        assert "sample 1" in str(info.value)  # samples 10-14 live in shard 2
    finally:
        loader.close()


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_hdf5_rows_by_span_points_or_map_equal_numpy(tmp_path, compression):
    import h5py

    from dali_pipes.stores._h5map import map_rows
    from dali_pipes.stores.hdf5 import Hdf5ShardReader

    data = np.arange(50_000 * 3, dtype=np.float32).reshape(50_000, 3)
    path = tmp_path / "rows.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(1000, 3), compression=compression)
    with h5py.File(path, "r") as f:
        ds = f["x"]
        mapped = map_rows(path, ds)
        assert (mapped is None) == (compression is not None)  # compressed chunks are not plain bytes
        for rows in (
            np.arange(10, 900, 7),
            np.unique(np.random.default_rng(0).integers(0, 50_000, 300)),
            np.array([49_999]),
        ):
            assert np.array_equal(Hdf5ShardReader._fixed_rows(ds, rows), data[rows])  # spans, one row, points
            if mapped is not None:
                assert np.array_equal(mapped.take(rows), data[rows])
        if mapped is not None:
            mapped.close()


def test_hdf5_map_joins_chunks_that_lie_end_to_end(tmp_path):
    """Chunks written in turn with another dataset's interleave in the file: one view per run, rows still exact."""
    import h5py

    from dali_pipes.stores._h5map import map_rows

    data = np.arange(10_000 * 4, dtype=np.float32).reshape(10_000, 4)
    path = tmp_path / "rows.h5"
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", shape=data.shape, dtype=data.dtype, chunks=(100, 4))
        other = f.create_dataset("other", shape=(100, 4), dtype=np.float32, chunks=(10, 4))
        for lo in range(0, 10_000, 1000):  # ten chunks of x, then a chunk of the other dataset, ...
            x[lo : lo + 1000] = data[lo : lo + 1000]
            other[lo // 100 : lo // 100 + 10] = 1.0
    with h5py.File(path, "r") as f:
        mapped = map_rows(path, f["x"])
        assert mapped is not None and 1 < len(mapped.views) < 100  # runs of chunks, not one view per chunk
        rng = np.random.default_rng(0)
        for rows in (np.arange(10_000), np.unique(rng.integers(0, 10_000, 1024)), np.array([0]), np.array([9_999])):
            np.testing.assert_array_equal(mapped.take(rows), data[rows])
        mapped.close()


def _skip_if_pinned() -> None:
    """These count on a test process that may use the whole node: a pinned one keeps its cores undivided."""
    import os

    from dali_pipes.loading.world import node_cpus

    if set(os.sched_getaffinity(0)) != set(node_cpus()):
        pytest.skip("this process is pinned to part of the node (tests/test_loader_defaults.py covers that)")


def test_the_default_counts_the_cores_of_this_rank(monkeypatch):
    import os

    from dali_pipes.loading.options import cores_per_rank

    _skip_if_pinned()
    mine = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cores_per_rank() == mine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's: two ranks share this node's cores
    assert cores_per_rank() == max(1, mine // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(mine * 8))
    assert cores_per_rank() == 1


def test_dali_threads_by_default_fit_this_ranks_share_of_the_cores(monkeypatch):
    import os

    from dali_pipes import ClassificationTrain
    from dali_pipes.loading.options import default_num_threads, resolve_counts

    _skip_if_pinned()
    mine = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    # Decoding on the CPU: a few threads, cores left to the training step; feeding the GPU: the rank's share.
    assert default_num_threads() == min(4, mine)
    assert default_num_threads(gpu_images=True) == mine
    assert [default_num_threads(c, gpu_images=True) for c in (1, 8, 16)] == [1, 8, 16]
    assert [default_num_threads(c) for c in (1, 8, 16)] == [1, 4, 4]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(mine))  # as many ranks as cores on this node: one thread each
    assert default_num_threads() == default_num_threads(gpu_images=True) == 1
    assert resolve_counts(ClassificationTrain(), RunOptions())[1].num_threads is None  # chosen once the device is
    assert (
        resolve_counts(ClassificationTrain(), RunOptions(num_threads=3))[1].num_threads == 3
    )  # an explicit count wins


def test_the_loader_says_which_thread_and_process_counts_it_chose_and_why(datasets, caplog, monkeypatch):
    import logging

    from dali_pipes.loading.options import default_num_threads

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with caplog.at_level(logging.INFO, logger="dali_pipes.loading.options"):
        with DALILoader(datasets["lmdb", "images"], EncodedBytes(), batch_size=4, run=CPU) as loader:
            assert loader.num_threads == default_num_threads()
        three = RunOptions(device="cpu", num_threads=3)
        with DALILoader(datasets["lmdb", "images"], EncodedBytes(), batch_size=4, run=three) as loader:
            assert loader.num_threads == 3
    lines = [r.getMessage() for r in caplog.records if "DALI threads" in r.getMessage()]
    cores = len(os.sched_getaffinity(0))
    assert lines == [
        f"DALILoader: {default_num_threads()} DALI threads (the default for {cores} cores per rank where the CPU "
        f"decodes) and 0 reader processes (the default for {cores} cores per rank where the CPU decodes)",
        "DALILoader: 3 DALI threads (set by the caller, a settings file or the pipeline spec) and 0 reader processes "
        f"(the default for {cores} cores per rank where the CPU decodes)",
    ]


#: How long a batch's read waits for the others before it gives up on meeting them (only a failure waits it out).
MEET_WITHIN_S = 60.0


@dataclass(frozen=True)
class Meeting:
    """Per-batch inputs that mark each batch's read in ``folder`` and wait there for ``parties`` batches.

    Run by the source wherever it reads, so in the reader processes: a batch's ``met`` is 1 when ``parties``
    batches were being read at the same moment, 0 when it gave up waiting for them.
    """

    folder: str
    parties: int
    outputs: tuple = (("met", "int32", 0),)
    names: tuple = ("met",)

    def make(self, *, seed, rank, epoch, batch, size, is_pad):
        Path(self.folder, f"{epoch}-{batch}").touch()
        deadline = time.monotonic() + MEET_WITHIN_S
        while len(os.listdir(self.folder)) < self.parties and time.monotonic() < deadline:
            time.sleep(0.01)
        met = len(os.listdir(self.folder)) >= self.parties
        return [np.full(len(is_pad), met, dtype=np.int32)]


@dataclass(frozen=True)
class MeetingSpec:
    """The label, and each batch's ``met``."""

    batch_inputs: Meeting
    required_fields: tuple[str, ...] = ("label",)
    needs_conditionals: bool = False

    def build(self, inputs, *, device):
        return {"label": inputs["label"], "met": inputs["met"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [3, 4])
def test_every_reader_process_reads_a_batch_at_once(datasets, tmp_path, workers):
    # DALI gives each batch of a batch-mode source to one reader process, and hands out only as many batches
    # as the source's prefetch depth: with 4 processes and the loader's prefetch of 2, two of them idled.
    meeting = Meeting(str(tmp_path), parties=workers)
    run = RunOptions(device="cpu", py_num_workers=workers, prefetch=2)
    with DALILoader(datasets["lmdb", "arrays"], MeetingSpec(meeting), batch_size=2, run=run) as loader:
        met = [int(batch["met"][0]) for batch in loader]
    assert len(met) == 12 and met[:workers] == [1] * workers, met
