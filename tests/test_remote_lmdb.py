"""A plain LMDB given by URL (moto's S3 server on 127.0.0.1): downloaded into a local folder first (an LMDB is never
opened over the network), converted to the same shards as from disk, the copy removed afterwards."""

from __future__ import annotations

import pytest
from packed_helpers import photos
from test_lmdb_source import write_lmdb

from converters.base import ConversionError, ImageOptions
from converters.runner import convert
from converters.sources import LmdbSource
from converters.sources.lmdb_download import DATA_NAME, RECORD_NAME


@pytest.fixture
def lmdb_in_s3(imagenet_mini, tmp_path, s3_env):
    """An LMDB of the sample photos on disk and the same files in a bucket: ``(local folder, URL)``."""
    values = {key.encode(): data for key, data, _ in photos(imagenet_mini)}
    local = write_lmdb(tmp_path / "train.lmdb", values)
    bucket = s3_env.new_bucket()
    s3_env.fs().put_file(str(local / DATA_NAME), f"{bucket}/train.lmdb/{DATA_NAME}")
    return local, f"s3://{bucket}/train.lmdb"


def data_gets(s3) -> int:
    return sum(1 for method, path in s3.proxy.requests if method == "GET" and path.endswith(DATA_NAME))


def shard_hashes(result) -> list[tuple[str, int, str]]:
    return [(s.path, s.num_samples, s.sha256) for s in result.manifest.shards]


def test_an_lmdb_url_is_downloaded_converted_and_removed(lmdb_in_s3, tmp_path, s3_env):
    local, url = lmdb_in_s3
    expected = convert(LmdbSource(local), tmp_path / "local", format="tfrecord", progress=False)
    drop = s3_env.proxy.add("drop", path=DATA_NAME, times=1)  # the download's connection dropped once: resumed
    work = tmp_path / "download"
    source = LmdbSource(url, ImageOptions(), download_dir=work)
    result = convert(source, tmp_path / "out", format="tfrecord", progress=False, workers=2)
    assert drop.seen == 1
    assert shard_hashes(result) == shard_hashes(expected)
    assert result.manifest.source["path"] == url
    assert (work / DATA_NAME).stat().st_size == (local / DATA_NAME).stat().st_size
    source.release()
    assert not work.exists()


def test_a_copy_left_by_an_earlier_run_is_used_only_while_it_matches(lmdb_in_s3, tmp_path, s3_env):
    local, url = lmdb_in_s3
    work = tmp_path / "download"
    LmdbSource(url, download_dir=work).items()  # a run that stopped after the download
    downloads = data_gets(s3_env)
    LmdbSource(url, download_dir=work).items()
    assert data_gets(s3_env) == downloads  # the same object, the same bytes: not downloaded again
    (work / DATA_NAME).write_bytes(b"\0" * (local / DATA_NAME).stat().st_size)  # damaged on disk since
    assert len(LmdbSource(url, download_dir=work).items()) == len(photos_in(local))
    assert data_gets(s3_env) > downloads  # downloaded again
    # The object replaced in the bucket by another LMDB: its new bytes are taken, not the old copy.
    other = write_lmdb(tmp_path / "other.lmdb", dict(list(photos_in(local).items())[:5]))
    bucket_key = url.removeprefix("s3://") + f"/{DATA_NAME}"
    s3_env.fs().put_file(str(other / DATA_NAME), bucket_key)
    assert len(LmdbSource(url, download_dir=work).items()) == 5
    assert (work / RECORD_NAME).exists()


def photos_in(path) -> dict[bytes, bytes]:
    import lmdb

    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        values = {bytes(k): bytes(v) for k, v in txn.cursor()}
    env.close()
    return values


def test_the_cli_converts_an_lmdb_url_and_removes_its_download(lmdb_in_s3, tmp_path):
    from test_convert import run_cli

    local, url = lmdb_in_s3
    work = tmp_path / "dl"
    out = run_cli("convert", "lmdb", url, str(tmp_path / "out"), "--download-dir", str(work))  # the environment's keys
    assert f"{len(photos_in(local))} samples" in out.stdout
    assert not work.exists()


def test_a_missing_lmdb_is_named(s3_env, tmp_path):
    bucket = s3_env.new_bucket()
    url = f"s3://{bucket}/none.lmdb"
    with pytest.raises(ConversionError, match=rf"{url}/{DATA_NAME}: no such bucket or object.*holding {DATA_NAME}"):
        LmdbSource(url, download_dir=tmp_path / "dl").items()
