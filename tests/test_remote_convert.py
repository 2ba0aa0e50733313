"""Conversion into object storage (moto's S3 server on 127.0.0.1): shards uploaded whole, the manifest last,
a failed run resumed without uploading again the shards already there, the local work folder left without shards."""

from __future__ import annotations

import pytest
from test_remote_cli import cli, s3_env

from converters.base import ImageOptions
from converters.runner import convert
from converters.sources import ImageFolderSource
from converters.upload import convert_to_url
from dali_pipes import RemoteError
from dali_pipes.dataset.manifest import MANIFEST_NAME

from loader_helpers import sample_digests


def source_of(root):
    return ImageFolderSource(root, ImageOptions())


def test_convert_to_s3_uploads_whole_shards_and_the_manifest_last(imagenet_mini, tmp_path, s3):
    local = convert(
        source_of(imagenet_mini), tmp_path / "local", format="tfrecord", samples_per_shard=8, progress=False
    )
    url = f"s3://{s3.new_bucket()}/train"
    work = tmp_path / "work"
    result = convert_to_url(
        source_of(imagenet_mini), url, work_dir=work, storage_options=s3.options,
        format="tfrecord", samples_per_shard=8, workers=2, progress=False,
    )  # fmt: skip
    assert result.manifest.shards == local.manifest.shards  # the same bytes as a local conversion
    puts = [path for method, path in s3.proxy.requests if method == "PUT"]
    assert puts[-1].endswith("/train/index.json")  # the manifest last
    assert not list(work.glob("shard-*"))  # no shard left in the work folder
    fs = s3.fs()
    for shard in local.manifest.shards:
        assert fs.cat_file(f"{url[5:]}/{shard.path}") == (tmp_path / "local" / shard.path).read_bytes()
    staged = tmp_path / "staged"
    out = cli("stage", url, str(staged), "--no-progress", env=s3_env(s3))
    assert out.returncode == 0, out.stderr
    assert sample_digests(staged) == sample_digests(tmp_path / "local")

    s3.proxy.clear()  # a re-run finds the job complete: nothing uploaded again
    again = convert_to_url(source_of(imagenet_mini), url, work_dir=work, storage_options=s3.options,
                           format="tfrecord", samples_per_shard=8, progress=False)  # fmt: skip
    assert again.already_complete
    assert [p for m, p in s3.proxy.requests if m == "PUT" and "shard-" in p] == []


def test_a_failed_upload_resumes_without_uploading_whole_shards_again(imagenet_mini, tmp_path, s3):
    url = f"s3://{s3.new_bucket()}/train"
    work = tmp_path / "work"
    kwargs = dict(work_dir=work, storage_options=s3.options, format="lmdb", samples_per_shard=8, workers=1)
    s3.proxy.add("deny", method="PUT", path=r"shard-00003", times=None)
    with pytest.raises(RemoteError, match=rf"{url}/shard-00003.lmdb: access denied"):
        convert_to_url(source_of(imagenet_mini), url, progress=False, **kwargs)
    fs = s3.fs()
    assert not fs.exists(f"{url[5:]}/{MANIFEST_NAME}")  # no manifest: the URL is not a dataset yet
    assert fs.exists(f"{url[5:]}/shard-00002.lmdb") and not fs.exists(f"{url[5:]}/shard-00003.lmdb")

    s3.proxy.clear()
    result = convert_to_url(source_of(imagenet_mini), url, progress=False, **kwargs)
    puts = [p for m, p in s3.proxy.requests if m == "PUT"]
    assert not [p for p in puts if any(f"shard-0000{i}" in p for i in range(3))]  # checked remotely, not re-sent
    assert [p for p in puts if "shard-00003" in p] and puts[-1].endswith(MANIFEST_NAME)
    assert result.resumed_shards == 4  # 0-2 found uploaded, 3 found whole in the work folder
    staged = tmp_path / "staged"
    out = cli("stage", url, str(staged), "--no-progress", env=s3_env(s3))
    assert out.returncode == 0, out.stderr
    local = convert(source_of(imagenet_mini), tmp_path / "local", format="lmdb", samples_per_shard=8, progress=False)
    assert sample_digests(staged) == sample_digests(local.out)


def test_the_convert_command_writes_to_a_url(imagenet_mini, tmp_path, s3):
    url = f"s3://{s3.new_bucket()}/train"
    env = s3_env(s3)
    out = cli("convert", "imagefolder", str(imagenet_mini), url, "--format", "hdf5", "--no-progress",
              "--work-dir", str(tmp_path / "work"), "--workers", "1", env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{url}: 47 samples in 1 hdf5 shard(s)")
    out = cli("verify", url, "--no-progress", env=env)
    assert out.returncode == 0, out.stderr


def test_a_url_holding_another_dataset_is_refused(imagenet_mini, tmp_path, s3):
    from converters.base import ConversionError

    url = f"s3://{s3.new_bucket()}/train"
    convert_to_url(source_of(imagenet_mini), url, work_dir=tmp_path / "a", storage_options=s3.options,
                   format="lmdb", progress=False, workers=1)  # fmt: skip
    before = s3.fs().cat_file(f"{url[5:]}/{MANIFEST_NAME}")
    with pytest.raises(ConversionError, match=rf"{url}: already holds a dataset"):
        convert_to_url(source_of(imagenet_mini), url, work_dir=tmp_path / "b", storage_options=s3.options,
                       format="hdf5", progress=False, workers=1)  # fmt: skip
    assert s3.fs().cat_file(f"{url[5:]}/{MANIFEST_NAME}") == before
