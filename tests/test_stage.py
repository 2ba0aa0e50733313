"""``dali-pipes stage``: every format and a merged file copied, checked, resumed after SIGKILL, reused."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from converters.merge import merge_hdf5
from converters.writers import writer_class
from dali_pipes.cli.verify import verify_dataset
from dali_pipes.dataset.fileio import sha256_file
from dali_pipes.dataset.manifest import MANIFEST_NAME, Field, Manifest, Shard, write_manifest
from dali_pipes.staging.stage import _CHUNK as STAGE_CHUNK
from dali_pipes.staging.stage import TMP_PREFIX, StageError, stage_dataset

from loader_helpers import sample_digests, shard_name, write_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "tfrecord"])
def test_stage_copies_checks_and_reuses_each_format(tmp_path, fmt):
    source = write_dataset(tmp_path / "src", 20, fmt=fmt)
    dest = tmp_path / "dest"
    report = stage_dataset(source, dest, progress=False)
    files = {p.name for p in source.iterdir() if p.name != MANIFEST_NAME}
    assert set(report.copied) == files and not report.reused
    assert (dest / MANIFEST_NAME).read_bytes() == (source / MANIFEST_NAME).read_bytes()
    assert verify_dataset(dest, progress=False).ok
    assert sample_digests(dest) == sample_digests(source)

    again = stage_dataset(source, dest, verify=True, progress=False)
    assert again.reused and again.copied == [] and again.path == dest


@pytest.mark.parametrize("virtual", [False, True])
def test_stage_a_merged_file_with_its_virtual_sources(tmp_path, virtual):
    data = write_dataset(tmp_path / "work" / "ds", 20, fmt="hdf5")
    merged = merge_hdf5(data, tmp_path / "work" / "all.h5", virtual=virtual)
    expected = sample_digests(merged)
    report = stage_dataset(merged, tmp_path / "dest", progress=False)
    assert report.path == tmp_path / "dest" / "all.h5"
    if virtual:  # the shards the virtual datasets map come along, at the same relative paths
        assert sorted(report.copied) == ["all.h5"] + [f"ds/{shard_name('hdf5', i)}" for i in range(3)]
    else:
        assert report.copied == ["all.h5"]
    shutil.rmtree(tmp_path / "work")  # the staged copy must not read the original
    assert sample_digests(report.path) == expected


def test_a_virtual_file_with_sources_outside_its_folder_is_refused(tmp_path):
    data = write_dataset(tmp_path / "ds", 8, fmt="hdf5")
    (tmp_path / "out").mkdir()
    merged = merge_hdf5(data, tmp_path / "out" / "all.h5", virtual=True)  # sources at ../ds/...
    with pytest.raises(StageError, match="outside the merged file's folder"):
        stage_dataset(merged, tmp_path / "dest", progress=False)


def test_a_damaged_source_shard_is_not_staged(tmp_path):
    source = write_dataset(tmp_path / "src", 20, fmt="tfrecord")
    shard = source / shard_name("tfrecord", 1)
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF  # same size, other content
    shard.write_bytes(bytes(raw))
    with pytest.raises(StageError, match=f"{shard}: SHA-256 does not match the manifest"):
        stage_dataset(source, tmp_path / "dest", progress=False)
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists()
    assert not (tmp_path / "dest" / shard.name).exists()
    assert not list((tmp_path / "dest").glob(f"{TMP_PREFIX}*"))


def test_a_second_dataset_is_refused_in_a_folder_holding_another(tmp_path):
    first = write_dataset(tmp_path / "a", 20, fmt="lmdb")
    other = write_dataset(tmp_path / "b", 12, fmt="lmdb")  # same shard names, other samples
    dest = tmp_path / "dest"
    stage_dataset(first, dest, progress=False)
    expected = sample_digests(dest)
    with pytest.raises(StageError, match=f"{dest}: already holds a staged copy of {first}.*into another folder"):
        stage_dataset(other, dest, progress=False)
    assert sample_digests(dest) == expected  # the first copy is untouched
    assert stage_dataset(first, dest, progress=False).reused  # its own source still reuses it


def blob_dataset(out: Path, shards: int, blob_bytes: int) -> Path:
    """An LMDB dataset of ``shards`` shards of 4 incompressible samples each (slow enough to kill mid-copy)."""
    out.mkdir(parents=True)
    schema = {"blob": Field(kind="bytes", encoding="raw"), "label": Field.array("int64", ())}
    rng = np.random.default_rng(0)
    entries = []
    for number in range(shards):
        name = shard_name("lmdb", number)
        writer = writer_class("lmdb")(out / name, schema)
        for i in range(4):
            writer.write({"blob": rng.bytes(blob_bytes), "label": np.array(i, dtype=np.int64)})
        writer.close()
        entries.append(Shard(name, 4, (out / name).stat().st_size, sha256_file(out / name)))
    write_manifest(out, Manifest(format="lmdb", fields=schema, shards=tuple(entries), source={"kind": "test"}))
    return out


def open_fifo_writer(path: Path, reader: subprocess.Popen):
    """The write end of the FIFO ``path``, once ``reader`` has opened it (failing if ``reader`` ends first)."""
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no process reads it
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            assert reader.poll() is None, "the stage ended before it reached the FIFO"
            time.sleep(0.01)
            continue
        os.set_blocking(fd, True)
        return open(fd, "wb", buffering=0)


@pytest.mark.timeout(120)
def test_a_stage_killed_with_sigkill_resumes_keeping_the_whole_files(tmp_path):
    source = blob_dataset(tmp_path / "src", shards=24, blob_bytes=1 << 20)
    dest = tmp_path / "dest"
    # Shard 12 of the source is, for now, a FIFO with no writer: one stager (--workers 1, in order) copies
    # shards 0-11 and then reads only what the test writes into it, so the kill lands mid-copy of shard 12
    # however busy the machine is (the copy would fail its hash check anyway).
    blocker = source / shard_name("lmdb", 12)
    real = blocker.rename(tmp_path / "shard-12-aside")
    os.mkfifo(blocker)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dali_pipes.cli", "stage", str(source), str(dest), "--workers", "1", "--no-progress"],
        env=env,
    )
    try:
        # The FIFO opens for writing once the stager opened it to read: shards 0-11 are then in place.
        with open_fifo_writer(blocker, proc) as fifo:
            # One chunk and a byte: the stager writes the chunk to its temporary file, then waits for more.
            fifo.write(bytes(STAGE_CHUNK + 1))
            while not any(p.stat().st_size for p in dest.glob(f"{TMP_PREFIX}*")):
                assert proc.poll() is None, "the stage ended before it could be killed"
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (dest / MANIFEST_NAME).exists()  # not a dataset yet
    in_place = {p.name for p in dest.glob("shard-*.lmdb")}
    assert in_place == {shard_name("lmdb", i) for i in range(12)}
    assert list(dest.glob(f"{TMP_PREFIX}*"))  # the killed copy of shard 12, half written
    os.replace(real, blocker)  # the source is whole again

    report = stage_dataset(source, dest, progress=False)
    assert set(report.kept) == in_place  # whole files were kept (after a hash check), not copied again
    assert set(report.copied) | set(report.kept) == {shard_name("lmdb", i) for i in range(24)}
    assert not set(report.copied) & in_place
    assert not list(dest.glob(f"{TMP_PREFIX}*"))  # the killed copy's temporary file is gone
    assert verify_dataset(dest, progress=False).ok


def test_a_staged_file_altered_later_is_found_by_verify_and_restaged(tmp_path):
    source = write_dataset(tmp_path / "src", 20, fmt="lmdb")
    dest = tmp_path / "dest"
    stage_dataset(source, dest, progress=False)
    shard = dest / shard_name("lmdb", 0)
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(StageError, match="does not match the manifest"):
        stage_dataset(source, dest, verify=True, progress=False)
    shard.unlink()  # a missing file makes the copy incomplete: staging again copies it only
    report = stage_dataset(source, dest, progress=False)
    assert report.copied == [shard.name] and not report.reused
    assert verify_dataset(dest, progress=False).ok


def test_cli_stage(tmp_path, capsys):
    from dali_pipes.cli import main

    source = write_dataset(tmp_path / "src", 10, fmt="hdf5")
    assert main(["stage", str(source), str(tmp_path / "dest"), "--no-progress"]) == 0
    assert "staged, 2 file(s) copied" in capsys.readouterr().out
    assert main(["stage", str(source), str(tmp_path / "dest"), "--verify", "--no-progress"]) == 0
    assert "already staged, reused (verified)" in capsys.readouterr().out
    assert main(["stage", str(tmp_path / "nothing"), str(tmp_path / "d2")]) == 2
    assert "no index.json" in capsys.readouterr().err
