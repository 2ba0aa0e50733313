"""The ImageNet example streaming a dataset from the loopback S3-protocol server (issue 54, items 1, 11, 15, 16).

A user's way: ``python -m dali_pipes.examples.train_imagenet s3://bucket/ds --stream-cache SIZE``, the
credentials and endpoint in the environment (``s3_env``), the node's cache folder under ``DALI_PIPES_CACHE``.
"""

from __future__ import annotations

import gc
import re
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest
from test_remote_stage import upload

from converters.runner import convert
from converters.sources import ImageFolderSource
from converters.synth import make_imagefolder
from dali_pipes.dataset.manifest import load_manifest

IMAGES = 24
PER_SHARD = 2
COMMON = ["--epochs", "1", "--batch-size", "4", "--size", "32"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """24 images of 3 classes in 12 LMDB shards of 2."""
    root = tmp_path_factory.mktemp("stream-example")
    images = make_imagefolder(root / "images", IMAGES, size=(64, 48), classes=3, seed=2, workers=1)
    convert(ImageFolderSource(images), root / "shards", format="lmdb", workers=1, progress=False,
            samples_per_shard=PER_SHARD)  # fmt: skip
    return root / "shards"


def shard_bytes(dataset: Path) -> list[int]:
    return [s.bytes for s in load_manifest(dataset).shards]


def files_under(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow  # a training run (DALI builds its graph in ~10 s on 2 cores)
def test_the_example_streams_a_url_and_leaves_nothing_but_the_stream_cache(
    shards, s3_env, tmp_path, monkeypatch, capsys
):
    from dali_pipes.examples.train_imagenet import main

    sizes = shard_bytes(shards)
    limit = 6 * max(sizes)  # two windows of one shard and a read outside them, for each of 2 loaders; half the data
    assert limit < sum(sizes)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DALI_PIPES_CACHE", str(cache))
    url = upload(s3_env, shards)
    main([url, *COMMON, "--stream-cache", f"{limit}B"])
    out = capsys.readouterr().out
    assert re.search(rf"^epoch 0: {IMAGES} samples", out, re.M), out
    held = files_under(cache)
    assert held and all(name.startswith("stream/") for name in held), sorted(held)  # no staged copy beside it
    assert sum(size for name, size in held.items() if "/shard-" in name) <= limit


def test_a_stream_cache_too_small_for_two_loaders_is_one_line_in_the_flags_unit(shards, monkeypatch, capsys):
    from dali_pipes.examples.train_imagenet import check_stream_cache, main, parse_args

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's two ranks of a node: they read one window together
    largest = max(shard_bytes(shards))
    given = f"{5 * largest // 1000}KB"  # two and a half shards for each of StreamOptions' 2 loaders a node
    with pytest.raises(SystemExit) as exit:
        main([str(shards), *COMMON, "--stream-cache", given])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"--stream-cache {given} leaves" in err and "each of the 2 loaders of the dataset a node" in err, err
    least = re.search(r"give --stream-cache (\S+) or more", err)[1]
    assert least.endswith("KB") and "StreamOptions" not in err and "bytes" not in err
    manifest = load_manifest(shards)
    plan = check_stream_cache(parse_args([str(shards), "--stream-cache", least]).stream_cache, manifest)
    # The least that works is enough: a node window of one shard, and the next one fetched ahead meanwhile.
    assert (plan.window, plan.ahead) == (1, 1)
    assert capsys.readouterr().out == ""


@pytest.fixture
def dead_endpoint(monkeypatch) -> Iterator[str]:
    """Credentials, and an endpoint on a loopback port that nothing listens on (closed: connections refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in dict(
        AWS_ACCESS_KEY_ID="key", AWS_SECRET_ACCESS_KEY="secret", AWS_DEFAULT_REGION="eu-west-1",
        AWS_ENDPOINT_URL=endpoint, AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null",
    ).items():  # fmt: skip
        monkeypatch.setenv(name, value)
    # fsspec reuses a filesystem made with the same arguments, and the endpoint from the environment is none of them:
    # an earlier test's filesystem would still go to its server (a process's environment does not change under it).
    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()
    yield endpoint
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow  # three refusals of ~2 s each (the first imports the S3 backend)
def test_a_dead_endpoint_is_one_line_within_seconds_from_the_example_and_the_loader(dead_endpoint, capsys):
    from dali_pipes import ClassificationTrain, DALILoader, DataOptions, RemoteError, StreamOptions
    from dali_pipes.examples.train_imagenet import main

    start = time.monotonic()
    with pytest.raises(SystemExit) as exit:
        main(["s3://bucket/ds", *COMMON, "--stream-cache", "1GB"])
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert dead_endpoint in err and "did not answer" in err and "--storage-option" in err
    assert "resumes" not in err  # nothing had started: nothing resumes
    assert took < 10, took
    for data in (DataOptions(stream=StreamOptions(cache_limit="1GB")), DataOptions()):  # streamed, staged
        start = time.monotonic()
        with pytest.raises(RemoteError, match="did not answer") as refused:
            DALILoader("s3://bucket/ds", ClassificationTrain(size=32), batch_size=4, data=data)
        assert time.monotonic() - start < 10 and "resumes" not in str(refused.value)


@pytest.mark.slow  # two training runs
def test_the_example_takes_storage_options_a_cache_folder_and_resumes_a_streamed_epoch_mid_way(
    shards, s3, tmp_path, monkeypatch, capsys
):
    from s3_helpers import SECRET_KEY

    from dali_pipes.examples import long_runs
    from dali_pipes.examples.train_imagenet import main

    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)  # everything from the flags
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "default-cache"))
    options = s3.options
    flags = [f"--storage-option={key}={options[key]}" for key in ("endpoint_url", "key", "secret")]
    flags += ["--storage-option", "client_kwargs.region_name=eu-west-1", "--stream-folder", str(tmp_path / "nvme")]
    checkpoint = tmp_path / "ck.pt"
    flags += ["--checkpoint", str(checkpoint), "--checkpoint-every", "2", "--progress-every", "1e-9"]
    url = upload(s3, shards)
    save = long_runs.Checkpoints.after_step

    def interrupted(self, step):  # Ctrl-C during step 3, after the save at step 2
        save(self, step)
        if step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(long_runs.Checkpoints, "after_step", interrupted)
    with pytest.raises(SystemExit) as exit:
        main([url, *COMMON, "--stream-cache", f"{6 * max(shard_bytes(shards))}B", *flags])
    assert exit.value.code == 130  # Ctrl-C's status, as a shell gives it
    gc.collect()
    monkeypatch.setattr(long_runs.Checkpoints, "after_step", save)
    first = capsys.readouterr()
    assert "Traceback" not in first.err and first.err.strip().splitlines()[-1].endswith(
        f": interrupted; the checkpoint {checkpoint} holds step 2; --resume continues from it"
    ), first.err
    assert re.search(r"^rank 0 of 1: 6 batches of 4 per epoch on cpu, streamed through --stream-cache \S+: "
                     r"a node window of \d+ shards? of 12, \d+ fetched ahead$", first.out, re.M), first.out  # fmt: skip
    assert "epoch 0: step 2 of 6, " in first.out and "images/s" in first.out
    main([url, *COMMON, "--stream-cache", f"{6 * max(shard_bytes(shards))}B", *flags, "--resume"])
    out = capsys.readouterr()
    steps = re.findall(r"^epoch 0: step (\d+) of 6", out.out, re.M)
    assert steps == ["3", "4", "5", "6"], out.out  # the resumed epoch goes on from its saved step
    assert re.search(rf"^epoch 0: {IMAGES - 2 * 4} samples", out.out, re.M), out.out
    assert any((tmp_path / "nvme").glob("*/shard-*")) and not (tmp_path / "default-cache").exists()
    assert SECRET_KEY not in first.out + first.err + out.out + out.err
