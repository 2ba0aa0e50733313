"""A disk that fills mid-job: a one-line error naming the shard, no partial shard kept, and a
re-run after space is freed finishes with the same bytes as an uninterrupted run.

The full disk is a file-size limit (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored so that a
write fails with ``EFBIG`` instead of killing the process): no root, no loop device.
Only TFRecord is covered: on a failed write LMDB reports a bare ``EIO`` and h5py can
crash the process (see the README's table of faults).
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from converters.synth import make_imagefolder
from dali_pipes.verify import verify_dataset

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


def test_full_disk_mid_job_is_a_clear_error_and_a_rerun_completes(images, tmp_path):
    args = ["convert", "imagefolder", images, "--format", "tfrecord", "--samples-per-shard", "10", "--workers", "1", "--no-progress"]
    reference = tmp_path / "reference"
    run_cli(*args[:3], reference, *args[3:])
    assert max(p.stat().st_size for p in reference.glob("shard-*")) > LIMIT > sum(
        p.stat().st_size for p in reference.glob("shard-0000[01].*")
    ), "the test data no longer fills the limit in the third shard only"

    out = tmp_path / "out"
    full = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(LIMIT), *CLI, *map(str, [*args[:3], out, *args[3:]])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert full.returncode != 0
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line of error, got:\n{full.stderr}"
    assert "shard-00002.tfrecord" in lines[0] and "disk full" in lines[0]
    # Nothing looks complete: no manifest, and of the failed shard not even its temporary file.
    assert not (out / "index.json").exists()
    assert sorted(p.name for p in out.glob("shard-*")) == sorted(
        ["shard-00000.tfrecord", "shard-00000.tfrecord.idx", "shard-00001.tfrecord", "shard-00001.tfrecord.idx"]
    )
    assert len(list((out / ".dali-pipes-job").glob("shard-*.json"))) == 2

    # Space freed: the same command continues and ends where an uninterrupted run does.
    rerun = run_cli(*args[:3], out, *args[3:])
    assert "2 shard(s) kept from an earlier run" in rerun.stdout
    assert shard_digests(out) == shard_digests(reference)
    assert (out / "index.json").read_bytes() == (reference / "index.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert verify_dataset(out, progress=False).ok


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "tfrecord"])
def test_a_write_failing_with_enospc_names_the_shard_and_keeps_nothing_of_it(images, tmp_path, monkeypatch, fmt):
    import errno

    from converters import runner
    from converters.base import ConversionError
    from converters.sources import ImageFolderSource

    real = runner.writer_class(fmt)

    class FillsUp(real):  # type: ignore[misc, valid-type]
        """The disk fills at the 25th sample: in the third shard, after two were written."""

        written = 0

        def write(self, sample):
            FillsUp.written += 1
            if FillsUp.written == 25:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write(sample)

    monkeypatch.setattr(runner, "writer_class", lambda name: FillsUp)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"shard-00002\.\S+: disk full"):
        runner.convert(ImageFolderSource(images), out, format=fmt, samples_per_shard=10, workers=1, progress=False)
    assert not (out / "index.json").exists()
    assert not list(out.glob("shard-00002*")), "nothing of the shard that failed may be left"
    assert len(list((out / ".dali-pipes-job").glob("shard-*.json"))) == 2
