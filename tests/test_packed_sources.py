"""What every packed-input source shares: small shard tasks, and the same bytes on a Dask cluster as locally."""

from __future__ import annotations

import pickle

import pytest
from packed_helpers import photos
from test_dask_engine import cluster, needs_dask  # noqa: F401 - the fixture is used by name
from test_lmdb_source import write_lmdb
from test_tfrecord_source import imagenet_example, write_records
from test_webdataset_source import sample_members, write_tar

from test_convert import run_cli, shard_digests


def _inputs(imagenet_mini, folder, copies: int = 1) -> dict[str, list[str]]:
    """The 47 photos (``copies`` times) as tars, TFRecord files, Parquet files and an LMDB: the CLI arguments of each."""
    expected = [(f"{k}-{c}", i, lab) for c in range(copies) for k, i, lab in photos(imagenet_mini)]
    third = len(expected) // 3
    parts = [expected[:third], expected[third : 2 * third], expected[2 * third :]]
    for n, part in enumerate(parts):
        write_tar(folder / f"w-{n}.tar", [m for k, i, lab in part for m in sample_members(k, i, lab)])
        write_records(folder / f"t-{n}.tfrecord", [imagenet_example(k, i, lab, []) for k, i, lab in part])
    write_lmdb(folder / "db", {k.encode(): i for k, i, _ in expected})
    arguments = {
        "webdataset": [str(folder / "w-{0..2}.tar")],
        "tfrecord": [str(folder / "t-*.tfrecord")],
        "lmdb": [str(folder / "db")],
    }
    try:
        from test_parquet_source import write_hf_parquet
    except pytest.skip.Exception:
        return arguments  # without pyarrow
    for n, part in enumerate(parts):
        write_hf_parquet(folder / f"p-{n}.parquet", part)
    return {**arguments, "parquet": [str(folder / "p-*.parquet")]}


@pytest.mark.timeout(300)
@needs_dask
def test_packed_sources_on_dask_equal_a_local_run(imagenet_mini, tmp_path, cluster):  # noqa: F811
    for kind, args in _inputs(imagenet_mini, tmp_path).items():
        common = ["--format", "tfrecord", "--samples-per-shard", "8", "--no-progress"]
        run_cli("convert", kind, *args, tmp_path / f"{kind}-local", "--workers", "1", *common)
        run_cli(
            "convert",
            kind,
            *args,
            tmp_path / f"{kind}-dask",
            "--engine",
            "dask",
            "--scheduler",
            cluster.address,
            *common,
        )
        local, dask = tmp_path / f"{kind}-local", tmp_path / f"{kind}-dask"
        assert shard_digests(dask) == shard_digests(local), kind
        assert (dask / "index.json").read_bytes() == (local / "index.json").read_bytes(), kind


@pytest.mark.parametrize("kind", ["webdataset", "tfrecord", "lmdb", "parquet"])
def test_a_shard_task_does_not_grow_with_the_dataset(imagenet_mini, tmp_path, kind):
    """The source pickled into each task carries no plan of the whole input: 3 files or 3 times more, same size."""
    from converters.sources import LmdbSource, ParquetSource, TFRecordSource, WebDatasetSource

    if kind == "parquet":
        pytest.importorskip("pyarrow")
    make = {"webdataset": WebDatasetSource, "tfrecord": TFRecordSource, "lmdb": LmdbSource, "parquet": ParquetSource}
    sizes = []
    for copies in (1, 3):
        folder = tmp_path / str(copies)
        folder.mkdir()
        args = _inputs(imagenet_mini, folder, copies)[kind]
        source = make[kind](args[0]) if kind == "lmdb" else make[kind](args)
        assert len(source.items()) == 47 * copies
        sizes.append(len(pickle.dumps(source)) - len(str(folder)) * pickle.dumps(source).count(str(folder).encode()))
    assert sizes[0] == sizes[1]
