"""Stores other than S3 take the same fsspec path: a missing backend names its extra, and inputs held in fsspec's
in-memory filesystem (no ETag, no S3 errors, its own listing) convert to the same shards as from disk."""

from __future__ import annotations

import importlib.util
import uuid
from importlib.metadata import metadata

import numpy as np
import pytest
from test_lmdb_source import write_lmdb
from test_remote_arrays import shard_hashes, write_arrays

from converters.base import ConversionError
from converters.runner import convert
from converters.sources import ArraysSource, LmdbSource
from dali_pipes import RemoteError
from dali_pipes.remote.fs import filesystem
from dali_pipes.remote.urls import SCHEMES

#: The URL kinds whose backend is an optional extra; s3fs comes with the test extra.
OPTIONAL_KINDS = sorted(kind for kind, extra in SCHEMES.items() if extra and extra != "s3")
#: fsspec has no entry of its own for abfss:// (adlfs adds it once installed), so without adlfs the URL fails in
#: fsspec as an unknown protocol before dali-pipes can name the extra.
UNKNOWN_TO_FSSPEC = pytest.mark.xfail(reason="fsspec: 'Protocol not known: abfss' without adlfs", strict=True)


def _backend_module(kind: str) -> str | None:
    """The package fsspec imports for ``kind://`` URLs; None where fsspec has no entry for the kind."""
    from fsspec.registry import known_implementations

    entry = known_implementations.get(kind)
    return entry["class"].split(".")[0] if entry else None


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=UNKNOWN_TO_FSSPEC) if k == "abfss" else k for k in OPTIONAL_KINDS]
)
def test_a_missing_backend_names_the_extra_to_install(kind):
    url, extra, module = f"{kind}://bucket/ds", SCHEMES[kind], _backend_module(kind)
    assert extra in metadata("dali-pipes").get_all("Provides-Extra"), f"{kind}:// names an extra pip does not know"
    if module is not None and importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    with pytest.raises(RemoteError) as raised:
        filesystem(url)
    assert str(raised.value).startswith(f"{url}: ") and f'pip install "dali-pipes[{extra}]"' in str(raised.value)
    with pytest.raises(ConversionError, match=rf'pip install "dali-pipes\[{extra}\]"'):
        ArraysSource([f"{url}/feats.npy"]).fields()


@pytest.fixture
def memory_root():
    """A folder of its own in fsspec's in-memory filesystem (this process only: conversions run with workers=1)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/dali-pipes-test-{uuid.uuid4().hex[:8]}"
    yield fs, root
    fs.rm(root, recursive=True)


def test_arrays_from_the_memory_filesystem_are_the_same_shards_as_from_disk(tmp_path, memory_root):
    fs, root = memory_root
    files = write_arrays(tmp_path / "feats")
    for f in files:
        fs.pipe(f"{root}/feats/{f.name}", f.read_bytes())
    local = convert(ArraysSource(files), tmp_path / "local", format="tfrecord", samples_per_shard=9, progress=False)
    urls = [f"memory://{root}/feats/{f.name}" for f in files[:2]] + [f"memory://{root}/feats/*.npz"]
    urls.append(f"memory://{root}/feats/c.h5")
    remote = convert(ArraysSource(urls), tmp_path / "out", format="tfrecord", samples_per_shard=9, workers=1)
    assert shard_hashes(remote) == shard_hashes(local)


def test_an_lmdb_from_the_memory_filesystem_is_downloaded_and_removed(imagenet_mini, tmp_path, memory_root):
    from packed_helpers import photos

    fs, root = memory_root
    local = write_lmdb(tmp_path / "train.lmdb", {k.encode(): d for k, d, _ in photos(imagenet_mini)})
    fs.pipe(f"{root}/train.lmdb/data.mdb", (local / "data.mdb").read_bytes())
    expected = convert(LmdbSource(local), tmp_path / "local", format="hdf5", progress=False)
    source = LmdbSource(f"memory://{root}/train.lmdb", download_dir=tmp_path / "dl")
    remote = convert(source, tmp_path / "out", format="hdf5", progress=False, workers=1)
    assert shard_hashes(remote) == shard_hashes(expected)
    source.release()
    assert not (tmp_path / "dl").exists()


def test_a_short_object_read_past_its_end_stops_there(memory_root):
    """The ranged reads ask for one byte past the expected end; the in-memory store answers with no bytes."""
    from dali_pipes.remote.transfer import CHUNK, download_to

    fs, root = memory_root
    data = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    fs.pipe(f"{root}/blob", data)
    import io

    out = io.BytesIO()
    count, _ = download_to(fs, f"{root}/blob", f"memory://{root}/blob", out, CHUNK)
    assert count == CHUNK and out.getvalue() == data
    count, _ = download_to(fs, f"{root}/blob", f"memory://{root}/blob", io.BytesIO(), CHUNK + 10)
    assert count == CHUNK  # shorter than expected: said by the count, never padded


def test_a_pattern_expands_to_urls_in_the_spelling_it_was_given(memory_root):
    """The backend's paths are spelled otherwise than its URLs (here a leading ``/``; for Azure the account, for the
    Hub a revision): each match keeps the pattern's spelling."""
    from converters.remote_inputs import expand_url

    fs, root = memory_root
    for name in ("b.npy", "a.npy", "c.txt"):
        fs.pipe(f"{root}/feats/{name}", b"x")
    given = f"memory:/{root}/feats"  # memory://dali-pipes-test-.../feats: no leading "/" in the URL's path
    assert expand_url(f"{given}/*.npy") == [f"{given}/a.npy", f"{given}/b.npy"]


def test_convert_to_stage_from_and_verify_a_dataset_in_the_memory_filesystem(tmp_path, memory_root):
    """Upload, listing, ranged downloads and remote hashing through a backend that is not S3."""
    from converters.sources import ImageFolderSource
    from converters.synth import make_imagefolder
    from converters.upload import convert_to_url
    from dali_pipes.cli.verify import verify_dataset
    from dali_pipes.staging.stage import stage_dataset

    from test_convert import shard_digests

    _, root = memory_root
    images = make_imagefolder(tmp_path / "images", 30, size=(64, 48), classes=2)
    url = f"memory://{root}/train"
    options = dict(format="tfrecord", samples_per_shard=8, progress=False)
    local = convert(ImageFolderSource(images), tmp_path / "local", **options)
    convert_to_url(ImageFolderSource(images), url, work_dir=tmp_path / "work", workers=1, **options)
    assert verify_dataset(url, progress=False).ok
    report = stage_dataset(url, tmp_path / "staged", workers=4, progress=False)
    assert len(report.copied) == 2 * len(local.manifest.shards) + 1  # shards, their indexes, errors.jsonl
    assert shard_digests(tmp_path / "staged") == shard_digests(tmp_path / "local")


def test_a_connection_lost_mid_body_is_retried_and_a_refusal_is_not():
    # aiobotocore wraps a connection lost while a body is read in botocore's ResponseStreamingError, whose name says
    # nothing of a connection: it was taken for a lasting error and the download failed at once. Classified by the
    # classes an error derives from (botocore's HTTPClientError), with the real libraries' errors.
    aiohttp = pytest.importorskip("aiohttp")
    from botocore.exceptions import ClientError, ConnectionClosedError, ResponseStreamingError

    from dali_pipes.remote.transfer import transient

    lost = ResponseStreamingError(error=aiohttp.ServerDisconnectedError())
    assert transient(lost) and transient(ConnectionClosedError(endpoint_url="http://127.0.0.1:1"))
    assert transient(aiohttp.ClientPayloadError("Response payload is not completed"))
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "GetObject")
    assert not transient(denied) and not transient(PermissionError("denied")) and not transient(ValueError("bad"))
