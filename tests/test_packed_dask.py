"""The packed-input sources on a real Dask cluster write what a local run writes, byte for byte."""

from __future__ import annotations

import pytest
from packed_helpers import photos
from test_dask_engine import cluster, needs_dask  # noqa: F401 - the fixture is used by name
from test_lmdb_source import write_lmdb
from test_tfrecord_source import imagenet_example, write_records
from test_webdataset_source import sample_members, write_tar

from test_convert import run_cli, shard_digests


def _inputs(imagenet_mini, folder) -> dict[str, list[str]]:
    """The 47 photos as tars, TFRecord files, Parquet files and an LMDB: the CLI arguments of each."""
    expected = photos(imagenet_mini)
    parts = [expected[:20], expected[20:35], expected[35:]]
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
