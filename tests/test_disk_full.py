"""A disk that fills mid-job: a one-line error naming the shard, no partial shard kept, and a
re-run after space is freed finishes with the same bytes as an uninterrupted run.

The full disk is a file-size limit (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored so that a
write fails with ``EFBIG`` instead of killing the process): no root, no loop device, and
the writers see what a full disk gives them. LMDB turns the short write into a bare
``EIO`` (``mdb_txn_commit: Input/output error``) and HDF5, left alone, crashes the process
when it closes such a file; both are covered here for real, with every format.

A worker process that crashes (a real ``SIGSEGV``) is reported by the shard it was writing.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from converters.synth import make_imagefolder
from dali_pipes.cli.verify import verify_dataset
from dali_pipes.dataset.manifest import FORMATS

from test_convert import CLI, run_cli, shard_digests  # noqa: E402 - shared helpers

LIMIT = 200_000  # bytes a file may grow to: the small shards fit, the large one does not
_LIMITED = (
    "import os, resource, signal, sys\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """20 small images (shards 0 and 1), then 10 large noisy ones (shard 2, several times LIMIT)."""
    root = make_imagefolder(tmp_path_factory.mktemp("disk") / "images", 20, size=(64, 48), classes=1)
    large = root / "zz-large"
    large.mkdir()
    rng = np.random.default_rng(5)
    for i in range(10):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(out, format="JPEG", quality=95)
        (large / f"{i:02d}.jpg").write_bytes(out.getvalue())
    return root


@pytest.mark.parametrize(("fmt", "workers"), [(fmt, 1) for fmt in FORMATS] + [("hdf5", 2), ("lmdb", 2)])
def test_full_disk_mid_job_is_a_clear_error_and_a_rerun_completes(images, tmp_path, fmt, workers):
    args = [
        "convert",
        "imagefolder",
        images,
        "--format",
        fmt,
        "--samples-per-shard",
        "10",
        "--workers",
        workers,
        "--no-progress",
        "--order",
        "source",  # the large images in the third shard
    ]
    reference = tmp_path / "reference"
    run_cli(*args[:3], reference, *args[3:])
    sizes = {p.name: p.stat().st_size for p in reference.glob("shard-*")}
    first_two = sorted(name for name in sizes if name.startswith(("shard-00000.", "shard-00001.")))
    assert max(sizes.values()) > LIMIT > max(sizes[name] for name in first_two), (
        "the test data no longer fills the limit in the third shard only"
    )

    out = tmp_path / "out"
    full = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(LIMIT), *CLI, *map(str, [*args[:3], out, *args[3:]])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert full.returncode == 2, f"not a clean exit ({full.returncode}):\n{full.stderr}"
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line of error, got:\n{full.stderr}"
    suffix = {"lmdb": ".lmdb", "hdf5": ".h5", "tfrecord": ".tfrecord"}[fmt]
    assert lines[0].startswith(f"dali-pipes: error: {out / f'shard-00002{suffix}'}: disk full while writing this shard")
    # Which limit was hit, and what the output folder has left.
    assert "file-size limit (ulimit -f) of 200.0 KB" in lines[0] and f"free on {out}" in lines[0]
    # Nothing looks complete: no manifest, and of the failed shard not even its temporary file.
    assert not (out / "index.json").exists()
    assert not list(out.glob("shard-00002*")) and not list(out.glob("*.tmp*"))
    # Every shard recorded as done is whole (with two workers, the other shard may have been abandoned).
    records = sorted(p.stem for p in (out / ".dali-pipes-job").glob("shard-*.json"))
    assert records and set(records) <= {"shard-00000", "shard-00001"}
    assert sorted(p.name for p in out.glob("shard-*")) == [name for name in first_two if name.split(".")[0] in records]
    for name in first_two:
        if (out / name).exists():
            assert (out / name).read_bytes() == (reference / name).read_bytes()

    # Space freed: the same command continues and ends where an uninterrupted run does.
    rerun = run_cli(*args[:3], out, *args[3:])
    assert f"{len(records)} shard(s) kept from an earlier run" in rerun.stdout
    assert shard_digests(out) == shard_digests(reference)
    assert (out / "index.json").read_bytes() == (reference / "index.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert verify_dataset(out, progress=False).ok


def writer_filling_the_disk_at(writer: type, sample: int) -> type:
    """``writer`` whose ``write`` fails with ``ENOSPC`` at the ``sample``-th sample of the job (counted from 1)."""
    import errno

    class FillsUp(writer):  # type: ignore[misc, valid-type]
        written = 0

        def write(self, item):
            FillsUp.written += 1
            if FillsUp.written == sample:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write(item)

    return FillsUp


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "tfrecord"])
def test_a_write_failing_with_enospc_names_the_shard_and_keeps_nothing_of_it(images, tmp_path, monkeypatch, fmt):

    from converters import runner
    from converters.base import ConversionError
    from converters.sources import ImageFolderSource

    # The disk fills at the 25th sample: in the third shard, after two were written.
    fills_up = writer_filling_the_disk_at(runner.writer_class(fmt), 25)
    monkeypatch.setattr(runner, "writer_class", lambda name: fills_up)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"shard-00002\.\S+: disk full"):
        runner.convert(ImageFolderSource(images), out, format=fmt, samples_per_shard=10, workers=1, progress=False)
    assert not (out / "index.json").exists()
    assert not list(out.glob("shard-00002*")), "nothing of the shard that failed may be left"
    assert len(list((out / ".dali-pipes-job").glob("shard-*.json"))) == 2


def test_an_unfinished_job_resumes_only_with_the_same_options_and_shard_layout(images, tmp_path, monkeypatch):
    """Resuming must never mix shards of two jobs: other options or another writer layout are refused."""

    from converters import runner
    from converters.base import ConversionError
    from converters.sources import ImageFolderSource

    fills_up = writer_filling_the_disk_at(runner.writer_class("hdf5"), 25)
    out = tmp_path / "out"
    options = dict(format="hdf5", samples_per_shard=10, workers=1, progress=False)
    with monkeypatch.context() as patch:
        patch.setattr(runner, "writer_class", lambda name: fills_up)
        with pytest.raises(ConversionError, match="disk full"):
            runner.convert(ImageFolderSource(images), out, **options)
    kept = sorted(p.name for p in out.glob("shard-*"))
    assert len(kept) == 2

    with pytest.raises(ConversionError, match="unfinished conversion .* other options or by another version"):
        runner.convert(ImageFolderSource(images), out, **{**options, "samples_per_shard": 7})
    with monkeypatch.context() as patch:
        patch.setattr(runner, "SHARD_LAYOUT_VERSION", runner.SHARD_LAYOUT_VERSION + 1)
        with pytest.raises(ConversionError, match="another version of dali-pipes"):
            runner.convert(ImageFolderSource(images), out, **options)
    assert sorted(p.name for p in out.glob("shard-*")) == kept, "a refused re-run must not touch the job"

    result = runner.convert(ImageFolderSource(images), out, **options)
    assert result.manifest.num_samples == 30 and verify_dataset(out, progress=False).ok
    # A dataset another version finished is a valid dataset: recognised as complete, not refused.
    with monkeypatch.context() as patch:
        patch.setattr(runner, "SHARD_LAYOUT_VERSION", runner.SHARD_LAYOUT_VERSION + 1)
        assert runner.convert(ImageFolderSource(images), out, **options).already_complete


# A source whose worker crashes for real (a segmentation fault, as h5py did on a full disk)
# while a flag file exists; spawned workers import it from this folder.
CRASH_ON = "img_000009z.jpg"  # sorts between the 10th and 11th image


@pytest.fixture(scope="module")
def crash_images(tmp_path_factory) -> Path:
    """Two shards of 10: the first item of shard 1 is the one whose loading crashes the worker."""
    root = make_imagefolder(tmp_path_factory.mktemp("crash") / "images", 19, size=(64, 48), classes=1)
    (cls,) = [p for p in root.iterdir() if p.is_dir()]
    shutil.copyfile(min(cls.iterdir()), cls / CRASH_ON)
    names = sorted(p.name for p in cls.iterdir())
    assert names.index(CRASH_ON) == 10, names
    return root


def test_a_worker_that_crashes_is_named_by_its_shard_and_a_rerun_completes(crash_images, tmp_path):
    from converters.base import ConversionError
    from converters.runner import convert
    from converters.sources import ImageFolderSource

    from crashing_source import CrashingSource

    options = dict(
        format="hdf5", samples_per_shard=10, workers=2, progress=False, order="source"
    )  # CRASH_ON opens shard 1
    reference = tmp_path / "reference"
    convert(ImageFolderSource(crash_images), reference, **options)

    flag = tmp_path / "crash-now"
    flag.touch()
    out = tmp_path / "out"
    source = CrashingSource(crash_images, crash_on=CRASH_ON, flag=str(flag))
    with pytest.raises(ConversionError) as failure:
        convert(source, out, **options)
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith(f"{out / 'shard-00001.h5'}: the worker writing this shard died (signal SIGSEGV"), message
    assert "run the same command again" in message
    assert not (out / "index.json").exists() and not list(out.glob("*.tmp*"))

    flag.unlink()  # the cause is gone: the same job resumes and completes
    result = convert(source, out, **options)
    assert result.num_samples == 20
    assert shard_digests(out) == shard_digests(reference)
    assert (out / "index.json").read_bytes() == (reference / "index.json").read_bytes()
    assert verify_dataset(out, progress=False).ok
