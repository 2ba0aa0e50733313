"""Feature arrays converted from object storage (moto's S3 server on 127.0.0.1): ``.npy`` files and ``.npz``
members read as a header then row ranges, HDF5 through h5py's file-object driver; the same shards as from disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converters.base import ConversionError
from converters.runner import convert
from converters.sources import ArraysSource

ROWS = 40


def write_arrays(folder: Path) -> list[Path]:
    """Every layout the source reads: C and big-endian ``.npy``, stored and compressed ``.npz`` (with a Fortran-ordered
    member), contiguous and chunked-gzip HDF5 datasets."""
    import h5py

    rng = np.random.default_rng(27)
    folder.mkdir(parents=True)
    np.save(folder / "feats.npy", rng.standard_normal((ROWS, 3, 5)).astype(np.float32))
    np.save(folder / "labels.npy", np.arange(ROWS, dtype=">i2"))
    np.savez(folder / "a.npz", emb=rng.standard_normal((ROWS, 8)), fortran=np.asfortranarray(rng.random((ROWS, 3))))
    np.savez_compressed(folder / "b.npz", mask=rng.integers(0, 255, (ROWS, 4), dtype=np.uint8))
    with h5py.File(folder / "c.h5", "w") as f:
        f.create_dataset("h5/x", data=rng.standard_normal((ROWS, 6)).astype(np.float32))
        f.create_dataset("h5/y", data=rng.integers(0, 9, (ROWS, 2)), chunks=(7, 2), compression="gzip")
    return [folder / name for name in ("feats.npy", "labels.npy", "a.npz", "b.npz", "c.h5")]


def shard_hashes(result) -> list[tuple[str, int, str]]:
    return [(s.path, s.num_samples, s.sha256) for s in result.manifest.shards]


def test_arrays_from_s3_are_the_same_shards_as_from_disk(tmp_path, s3_env):
    s3 = s3_env
    files = write_arrays(tmp_path / "feats")
    bucket = s3.new_bucket()
    s3.fs().put(f"{tmp_path / 'feats'}/", f"{bucket}/feats/", recursive=True)
    local = convert(ArraysSource(files), tmp_path / "local", format="hdf5", samples_per_shard=7, progress=False)
    drop = s3.proxy.add("drop", path=r"feats\.npy", times=1)  # a connection dropped mid-answer: retried
    urls = [f"s3://{bucket}/feats/{f.name}" for f in files]
    remote = convert(
        ArraysSource(urls), tmp_path / "out", format="hdf5", samples_per_shard=7, workers=2, progress=False
    )
    assert drop.seen == 1
    assert remote.manifest.fields == local.manifest.fields
    assert remote.manifest.num_samples == ROWS and not remote.errors
    assert shard_hashes(remote) == shard_hashes(local)
    assert remote.manifest.source["files"] == urls
    # Rows come by ranged reads of large blocks: a handful of requests per file, never one per row.
    gets = [path for method, path in s3.proxy.requests if method == "GET" and "feats.npy" in path]
    assert 2 <= len(gets) < ROWS // 4


def test_a_pattern_of_urls_is_expanded_in_the_bucket(tmp_path, s3_env):
    parts = tmp_path / "parts"
    for n in range(3):
        (parts / f"part-{n}").mkdir(parents=True)
        np.save(parts / f"part-{n}" / "x.npy", np.full((n + 2, 2), n, dtype=np.int32))
    bucket = s3_env.new_bucket()
    s3_env.fs().put(f"{parts}/", f"{bucket}/parts/", recursive=True)
    local = convert(ArraysSource(sorted(parts.glob("part-*/x.npy"))), tmp_path / "local", format="lmdb", progress=False)
    source = ArraysSource([f"s3://{bucket}/parts/part-*/x.npy"])
    assert list(source.fields()) == ["x"] and len(source) == 2 + 3 + 4  # one field, its parts concatenated
    remote = convert(source, tmp_path / "out", format="lmdb", progress=False)
    assert shard_hashes(remote) == shard_hashes(local)


def test_a_truncated_npy_object_names_the_rows_it_lacks(tmp_path, s3_env):
    folder = tmp_path / "cut"
    folder.mkdir()
    np.save(folder / "x.npy", np.arange(10 * 16, dtype=np.float64).reshape(10, 16))
    whole = (folder / "x.npy").read_bytes()
    bucket = s3_env.new_bucket()
    s3_env.fs().pipe(f"{bucket}/x.npy", whole[: len(whole) - 16 * 8 * 3 + 5])  # the last 3 rows short
    url = f"s3://{bucket}/x.npy"
    result = convert(ArraysSource([url]), tmp_path / "out", format="lmdb", progress=False, workers=1)
    assert result.manifest.num_samples == 7
    assert [e["input"] for e in result.errors] == ["sample 7", "sample 8", "sample 9"]
    assert all(url in e["reason"] and "truncated object" in e["reason"] for e in result.errors)


def test_a_missing_object_is_named(s3_env):
    bucket = s3_env.new_bucket()
    with pytest.raises(ConversionError, match=rf"s3://{bucket}/nope\.npy: no such bucket or object"):
        ArraysSource([f"s3://{bucket}/nope.npy"]).fields()
