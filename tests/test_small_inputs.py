"""Many small input files are packed into shards of the target size, one input file open at a time.

A dataset delivered as 1,000 one-sample tars (or small TFRecord or Parquet files) made 1,000 shards when each
shard task read exactly one input file. Shards are now cut by count or size whatever the files; a task reads
its files one after another, and each process keeps at most one open (checked under a low limit on open files).
"""

from __future__ import annotations

import io
import resource
import subprocess
import tarfile
from pathlib import Path

from converters.synth import render
from dali_pipes.dataset.manifest import load_manifest
from dali_pipes.stores import open_store

from test_convert import CLI, shard_digests

#: Three times the open-file limit below: one descriptor per input file would not fit (1,000 once; 300 shows it as well).
FILES = 300
#: Well above what Python, LMDB and the pool need, far below one descriptor per input file.
OPEN_FILES_LIMIT = 96


def _one_sample_tars(folder: Path) -> list[bytes]:
    folder.mkdir()
    images = []
    for n in range(FILES):
        buffer = io.BytesIO()
        render(n, size=(24, 16)).save(buffer, format="JPEG", quality=70)
        image = buffer.getvalue()
        images.append(image)
        with tarfile.open(folder / f"part-{n:04d}.tar", "w") as tar:
            for name, data in ((f"s{n:04d}.jpg", image), (f"s{n:04d}.cls", str(n % 5).encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return images


def _convert(pattern: str, out: Path, *options: str) -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES_LIMIT, OPEN_FILES_LIMIT))

    args = [*CLI, "convert", "webdataset", pattern, str(out), "--format", "lmdb", "--no-progress", *options]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, preexec_fn=low_limit)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hundreds_of_one_sample_tars_make_shards_of_the_target_size(tmp_path):
    images = _one_sample_tars(tmp_path / "tars")
    pattern = str(tmp_path / "tars" / "part-*.tar")
    _convert(pattern, tmp_path / "auto", "--workers", "2")
    assert [s.num_samples for s in load_manifest(tmp_path / "auto").shards] == [FILES]  # one automatic shard

    # By size: each shard spans many tars; every shard but the last is full (the next sample would not fit).
    sizes = [len(image) + 1 for image in images]  # the image and its one-byte label
    _convert(pattern, tmp_path / "sized", "--workers", "2", "--shard-size", "40KB")
    counts = [s.num_samples for s in load_manifest(tmp_path / "sized").shards]
    assert sum(counts) == FILES and 1 < len(counts) < FILES // 20
    start = 0
    for count in counts[:-1]:
        assert sum(sizes[start : start + count]) <= 40_000 < sum(sizes[start : start + count + 1])
        start += count
    store = open_store(tmp_path / "sized")
    assert [store[i]["image"] for i in (0, FILES // 2, FILES - 1)] == [images[0], images[FILES // 2], images[FILES - 1]]

    # Any worker count writes the same bytes.
    _convert(pattern, tmp_path / "one-worker", "--workers", "1", "--shard-size", "40KB")
    assert shard_digests(tmp_path / "one-worker") == shard_digests(tmp_path / "sized")
