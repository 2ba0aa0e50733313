"""Batch reads (one call per batch, sorted and coalesced per shard) give exactly what per-sample reads gave."""

from __future__ import annotations

import numpy as np
import pytest

from dali_pipes import DALILoader, LoaderError, StoreError, open_store
from dali_pipes.pipelines import Features

from loader_helpers import TinySpec, damage_shard, flip_image_header, write_dataset

FORMATS = ("lmdb", "hdf5", "tfrecord")
N = 23


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
    if fmt == "hdf5":  # the fixed fields were gathered from the mapped file, not through h5py
        maps = store.shard_readers[0]._h_maps
        assert maps["label"] is not None and (kind == "images" or maps["features"] is not None)
    store.close()


def _spec(kind):
    return TinySpec() if kind == "images" else Features(fields=("features", "label"))


def _epochs(path, kind, batch_reads, *, rank=0, world_size=1, state=None, workers=1):
    loader = DALILoader(
        path,
        _spec(kind),
        batch_size=4,
        seed=5,
        device="cpu",
        rank=rank,
        world_size=world_size,
        py_num_workers=workers,
        with_index=True,
        batch_reads=batch_reads,
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
    loader = DALILoader(path, TinySpec(), batch_size=4, device="cpu", py_num_workers=1, shuffle=False, batch_reads=True)
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
