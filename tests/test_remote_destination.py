"""A conversion into object storage checks its destination first, and ``inspect`` gives up on a dead endpoint
quickly: against moto's S3 server on 127.0.0.1 (and a port where nothing listens), no mocks."""

from __future__ import annotations

import os
import socket
import time

import pytest
from test_remote_cli import cli, s3_env

from converters.base import ImageOptions
from converters.sources import ImageFolderSource
from converters.upload import convert_to_url
from dali_pipes import RemoteError
from dali_pipes.remote.destination import PROBE_PREFIX, check_destination


def closed_port() -> str:
    """An endpoint on 127.0.0.1 where nothing listens (a port just bound and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_bucket_that_does_not_exist_is_refused_before_any_work(imagenet_mini, tmp_path, s3):
    env = {**s3_env(s3), "DALI_PIPES_CACHE": str(tmp_path / "cache")}
    out = cli("convert", "imagefolder", str(imagenet_mini), "s3://no-such-bucket/x", "--workers", "1", env=env)
    assert out.returncode != 0
    assert out.stderr.startswith(
        "dali-pipes: error: s3://no-such-bucket/x: the bucket no-such-bucket does not exist"
    ), out.stderr
    assert "aws s3 mb s3://no-such-bucket" in out.stderr and "nothing was converted" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # no "writing shards in ...", no traceback
    assert not (tmp_path / "cache").exists()  # no work folder left behind (it once held every shard)
    assert not [path for method, path in s3.proxy.requests if method == "PUT" and "shard-" in path]


def test_keys_that_may_not_write_are_refused_before_the_source_is_read(imagenet_mini, tmp_path, s3):
    bucket = s3.new_bucket()
    s3.proxy.add("deny", method="PUT", times=None)  # as S3 answers keys it does not know, or read-only keys
    work = tmp_path / "work"
    with pytest.raises(RemoteError, match=rf"s3://{bucket}/train: these credentials may not write there"):
        convert_to_url(ImageFolderSource(imagenet_mini, ImageOptions()), f"s3://{bucket}/train", work_dir=work,
                       storage_options=s3.options, format="lmdb", workers=1, progress=False)  # fmt: skip
    assert not work.exists()
    assert s3.fs().ls(bucket) == []


def test_no_credentials_are_named_before_any_work(imagenet_mini, tmp_path, s3):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=s3.proxy.url,
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_DEFAULT_REGION="eu-west-1",
        DALI_PIPES_CACHE=str(tmp_path / "cache"),
    )
    url = f"s3://{s3.new_bucket()}/train"
    out = cli("convert", "imagefolder", str(imagenet_mini), url, "--workers", "1", env=env)
    assert out.returncode != 0
    assert out.stderr.startswith(f"dali-pipes: error: {url}: no credentials found to write there"), out.stderr
    assert "AWS_ACCESS_KEY_ID" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "cache").exists()


def test_an_endpoint_that_does_not_answer_is_named_within_seconds(imagenet_mini, tmp_path, s3):
    endpoint = closed_port()
    work = tmp_path / "work"
    start = time.monotonic()
    with pytest.raises(RemoteError) as failure:
        convert_to_url(ImageFolderSource(imagenet_mini, ImageOptions()), "s3://bucket/train", work_dir=work,
                       storage_options={**s3.options, "endpoint_url": endpoint}, format="lmdb", workers=1,
                       progress=False)  # fmt: skip
    assert time.monotonic() - start < 15
    message = str(failure.value)
    assert message.startswith("s3://bucket/train: the storage server did not answer"), message
    assert endpoint in message and "nothing was converted" in message and "it resumes" not in message
    assert not work.exists()


def test_the_check_leaves_nothing_in_a_writable_bucket(s3):
    bucket = s3.new_bucket()
    check_destination(f"s3://{bucket}/train", s3.options)
    puts = [path for method, path in s3.proxy.requests if method == "PUT"]
    assert len(puts) == 1 and PROBE_PREFIX in puts[0]  # it did write, so writing is what it checked
    assert s3.fs().ls(bucket) == []


def test_inspect_of_an_endpoint_that_does_not_answer_says_so_within_seconds(s3):
    endpoint = closed_port()
    start = time.monotonic()
    out = cli("inspect", "s3://bucket/ds", env={**s3_env(s3), "AWS_ENDPOINT_URL": endpoint})
    took = time.monotonic() - start  # the command's start-up (imports) included; once 23 s, 5 tries of 3
    assert out.returncode != 0 and took < 15, (took, out.stderr)
    line = out.stderr.strip()
    assert line.startswith("dali-pipes: error: s3://bucket/ds/index.json: the storage server did not answer"), line
    assert f"check that the endpoint, {endpoint}" in line and "AWS_ENDPOINT_URL" in line
    assert "it resumes" not in line and "retrying" not in line and len(line.splitlines()) == 1


def test_inspect_of_a_throttling_server_makes_a_few_requests_not_twenty(s3):
    s3.proxy.add("slowdown", path=r"index\.json", times=None)
    out = cli("inspect", f"s3://{s3.new_bucket()}/ds", env=s3_env(s3))
    assert out.returncode != 0 and "slow down" in out.stderr, out.stderr
    # One try (s3fs's look-up and listing, each of botocore's 2 attempts), not 5 tries of 3 attempts each.
    assert len([path for _, path in s3.proxy.requests if "index.json" in path]) <= 4, s3.proxy.requests


def test_a_refused_conversion_into_a_url_leaves_no_shard_there(tmp_path, s3):
    """Every input broken: the job is refused and discards its work folder; the shard it uploaded goes too."""
    from converters.base import NothingConverted

    folder = tmp_path / "onlybroken" / "cat"
    folder.mkdir(parents=True)
    for i in range(3):
        (folder / f"{i}.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    bucket = s3.new_bucket()
    work = tmp_path / "work"
    with pytest.raises(NothingConverted):
        convert_to_url(ImageFolderSource(tmp_path / "onlybroken", ImageOptions()), f"s3://{bucket}/train",
                       work_dir=work, storage_options=s3.options, format="lmdb", workers=1,
                       progress=False)  # fmt: skip
    assert not (work / ".dali-pipes-job").exists()
    assert s3.fs().find(bucket) == []  # no shard, no manifest: nothing that looks like a dataset
