"""Conversion throughput, measured side by side with a plain file copy of the same bytes.

``dali-pipes bench-convert [IMAGES] --workers 2`` times, in one run and on the
same files (page cache warmed first, so every row reads from memory alike):

- ``copy``: each image copied to a new folder by ``workers`` processes (the floor
  of any conversion: the bytes have to be read and written once);
- ``load+check``: each image read and fully decoded (the integrity check every
  conversion does), without writing: where the time of a conversion goes;
- one row per format: the whole ``convert`` (read, check, write shards, fsync,
  hash, manifest).

Each row is the median of ``repeats`` runs; the ratio column is copy time over
the row's time (1.0 = as fast as copying).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from converters.runner import convert
from converters.sources import ImageFolderSource
from dali_pipes._version import __version__
from dali_pipes.dataset.fileio import atomic_write_json
from dali_pipes.dataset.manifest import FORMATS

log = logging.getLogger(__name__)


def machine_description() -> dict[str, Any]:
    """Cores, processor, OS and library versions: the context every figure needs."""
    import h5py
    import lmdb
    import numpy
    import PIL

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "dali_pipes": __version__,
        "numpy": numpy.__version__,
        "pillow": PIL.__version__,
        "h5py": h5py.__version__,
        "lmdb": lmdb.__version__,
    }


def run_conversion_benchmark(
    images: str | os.PathLike | None = None,
    *,
    num: int = 1000,
    workers: int = 2,
    formats: Sequence[str] = FORMATS,
    repeats: int = 3,
    json_out: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Time copy, load+check and every format's conversion of one image folder; return the figures.

    Without ``images``, a synthetic ImageNet-like folder of ``num`` images is made
    in a temporary folder first (not timed).
    """
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if repeats < 1 or workers < 1:
        raise ValueError("--repeats and --workers must be at least 1")
    with tempfile.TemporaryDirectory(prefix="dali-pipes-bench-") as tmp:
        tmp_path = Path(tmp)
        if images is None:
            from converters.synth import make_imagefolder

            log.info("making %d synthetic images in %s", num, tmp_path / "images")
            images = make_imagefolder(tmp_path / "images", num)
        source = ImageFolderSource(images)
        items = source.items()
        files = [Path(item.name) for item in items]
        total_bytes = sum(item.size for item in items)
        for path in files:  # warm the page cache: every row then reads from memory alike
            path.read_bytes()

        rows: list[dict[str, Any]] = []

        def timed(name: str, run) -> None:
            rows.append(_timed_row(name, run, tmp_path, repeats, len(files), total_bytes))

        timed("copy", lambda target: _copy_files(files, Path(images), target, workers))
        timed("load+check", lambda target: _load_all(source, items, workers))
        runner_log = logging.getLogger("converters.runner")
        level = runner_log.level
        runner_log.setLevel(logging.WARNING)  # one summary line per timed run would drown the table
        try:
            for fmt in formats:
                timed(fmt, lambda target, fmt=fmt: convert(source, target, format=fmt, workers=workers, progress=False))
        finally:
            runner_log.setLevel(level)

    report = _report(rows, len(files), total_bytes, workers, repeats)
    if json_out is not None:
        atomic_write_json(json_out, report)
    return report


def _report(rows: list[dict[str, Any]], images: int, total_bytes: int, workers: int, repeats: int) -> dict[str, Any]:
    """The benchmark's figures: each row gets its ``ratio_to_copy`` (the first row, the plain copy, is the yardstick)."""
    copy_seconds = rows[0]["seconds"]
    for row in rows:
        row["ratio_to_copy"] = copy_seconds / row["seconds"]
    return {
        "benchmark": "conversion",
        "images": images,
        "input_bytes": total_bytes,
        "workers": workers,
        "repeats": repeats,
        "machine": machine_description(),
        "rows": rows,
    }


def format_report(report: dict[str, Any]) -> str:
    """A table of the figures, with the machine they were measured on."""
    m = report["machine"]
    lines = [
        f"conversion of {report['images']} images ({report['input_bytes'] / 1e6:.1f} MB) with {report['workers']} workers, "
        f"median of {report['repeats']}",
        f"machine: {m['cores']} cores, {m['cpu']}, Python {m['python']}",
        f"{'row':<12} {'seconds':>8} {'images/s':>10} {'MB/s':>8} {'x copy':>8}",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['name']:<12} {row['seconds']:>8.2f} {row['images_per_s']:>10.1f} {row['mb_per_s']:>8.1f} {row['ratio_to_copy']:>8.2f}"
        )
    return "\n".join(lines)


def _copy_one(args: tuple[str, str]) -> None:
    shutil.copyfile(*args)


def _copy_files(files: Sequence[Path], root: Path, target: Path, workers: int) -> None:
    pairs = []
    for path in files:
        dest = target / path.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        pairs.append((str(path), str(dest)))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_copy_one, pairs, chunksize=32))


def _load_chunk(args) -> int:
    source, items = args
    for item in items:
        source.load(item)
    return len(items)


def _load_all(source, items, workers: int) -> None:
    chunks = [(source, items[i : i + 64]) for i in range(0, len(items), 64)]
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_load_chunk, chunks))


def _timed_row(name: str, run, tmp_path: Path, repeats: int, images: int, total_bytes: int) -> dict[str, Any]:
    """Run ``run(target)`` ``repeats`` times into fresh folders under ``tmp_path``; the row of its median time."""
    seconds = []
    for r in range(repeats):
        target = tmp_path / f"{name}-{r}"
        start = time.perf_counter()
        run(target)
        seconds.append(time.perf_counter() - start)
        shutil.rmtree(target, ignore_errors=True)
    median = statistics.median(seconds)
    log.info("%-12s %.2f s", name, median)
    return {
        "name": name,
        "seconds": median,
        "seconds_all": seconds,
        "images_per_s": images / median,
        "mb_per_s": total_bytes / median / 1e6,
    }
