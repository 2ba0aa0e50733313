"""The same images in every storage format (``dali-pipes bench DATASET --suite formats``).

The images are taken from the dataset itself (its encoded bytes, unchanged),
written as an image folder in a temporary folder, and that folder is converted to
LMDB, HDF5 and TFRecord: every storage then holds byte-identical images, whatever
the dataset was made from. Each is read three ways: the encoded bytes alone in one
process (what the format itself costs), through DALI (this package's loader over
the shards, ``fn.readers.file`` over the files), and by the ``DataLoader`` + PIL
baseline; ``x ref`` is each row over the files read the same way.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.runner import Job, Skipped, quiet, warm_page_cache
from dali_pipes.bench.streams import anchor_job, dali_job, dataloader_job, file_dataset, store_dataset
from dali_pipes.bench.suites import SuiteRun

log = logging.getLogger(__name__)

_SUFFIXES = (
    (b"\xff\xd8\xff", ".jpg"),
    (b"\x89PNG", ".png"),
    (b"BM", ".bmp"),
    (b"RIFF", ".webp"),
    (b"II*\x00", ".tif"),
    (b"MM\x00*", ".tif"),
)
READ_ONLY = "read the encoded bytes only, one process"


def run(bench: SuiteRun) -> BenchReport:
    """The same images as files, LMDB, HDF5 and TFRecord: raw reads, DALI, and the DataLoader baseline."""
    import torch

    inputs, target = bench.inputs, bench.target
    # Enough images for steady windows, few enough to copy four times into a temporary folder.
    limit = max(inputs.batch_size * 4, 64) if bench.quick else 1000
    device = "gpu" if torch.cuda.is_available() else "cpu"
    b = inputs.batch_size
    with tempfile.TemporaryDirectory(prefix="dali-pipes-formats-") as tmp:
        copies = equal_content(inputs.dataset, Path(tmp), limit=limit, workers=inputs.cores, progress=bench.progress)
        warm_page_cache(p for d in copies.datasets.values() for p in d.iterdir() if p.is_file())
        warm_page_cache(path for path, _ in copies.files)
        files = lambda: copies.files  # noqa: E731 - a factory, as the row helpers take
        jobs = [
            Job("files", functools.partial(file_read_stream, copies.files, batch_size=b), READ_ONLY),
            anchor_job("files", inputs, device, target, files=files),
            dataloader_job("files", file_dataset(inputs, files), inputs, target, "DataLoader + PIL"),
        ]
        for fmt, dataset in copies.datasets.items():
            jobs += [
                Job(fmt, functools.partial(store_read_stream, dataset, batch_size=b), READ_ONLY),
                dali_job(fmt, inputs, device, target, dataset=dataset),
                dataloader_job(fmt, store_dataset(inputs, dataset=dataset), inputs, target, "DataLoader + PIL"),
            ]
        # Each format read three ways, in this order; the table groups by reader, the loader settings are in the context.
        for job, reader in zip(jobs, itertools.cycle(("read-only", f"dali {device}", "DataLoader+PIL"))):
            job.params = {"reader": reader}
        title = f"storage formats at equal content ({copies.count} images, {copies.bytes / 1e6:.1f} MB)"
        report = bench.measure(title, jobs, reference="files", reference_match=("reader",))
    report.context["formats_images"] = copies.count
    report.notes.append("files through DALI: fn.readers.file (the dali-pipes loader reads shards only)")
    return report


# --- the same images in every format ---------------------------------------------------------


@dataclass
class EqualContent:
    """The image folder (``files`` as ``(path, label)``) and one dataset folder per format."""

    root: Path
    files: tuple[tuple[Path, int], ...]
    datasets: dict[str, Path] = field(default_factory=dict)

    @property
    def count(self) -> int:
        """How many images each storage holds."""
        return len(self.files)

    @property
    def bytes(self) -> int:
        """The images' encoded bytes."""
        return sum(path.stat().st_size for path, _ in self.files)


def image_suffix(data: bytes) -> str:
    """The file extension of an encoded image, from its first bytes."""
    for magic, suffix in _SUFFIXES:
        if data.startswith(magic):
            return suffix
    raise ValueError("not an image format the formats suite knows (JPEG, PNG, BMP, WebP, TIFF)")


def equal_content(
    dataset: str | os.PathLike, tmp: Path, *, limit: int, workers: int, progress: bool = True
) -> EqualContent:
    """Write the first ``limit`` images of ``dataset`` into ``tmp/images`` and convert them to every format."""
    from converters.runner import convert
    from converters.sources import ImageFolderSource
    from dali_pipes.bench.baselines import imagefolder_files
    from dali_pipes.dataset.manifest import FORMATS
    from dali_pipes.stores import open_store

    store = open_store(dataset)
    classes = store.manifest.classes
    root = tmp / "images"
    try:
        for index in range(min(limit, len(store))):
            sample = store[index]
            data = bytes(sample["image"])
            label = int(sample["label"]) if "label" in sample else 0
            name = classes[label] if classes and 0 <= label < len(classes) else f"class_{label:04d}"
            folder = root / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{index:08d}{image_suffix(data)}").write_bytes(data)
    finally:
        store.close()
    content = EqualContent(root, tuple(imagefolder_files(root)))
    with quiet("converters.runner"):  # the line below says it once; the runner's summaries would repeat it
        for fmt in FORMATS:
            log.info("formats: converting %d images to %s", content.count, fmt)
            out = tmp / fmt
            convert(ImageFolderSource(root), out, format=fmt, workers=workers, progress=progress)
            content.datasets[fmt] = out
    return content


# --- raw reads -------------------------------------------------------------------------------


def _reads(keys: Sequence[Any], read: Callable[[Any], Any], batch_size: int) -> Iterator[int]:
    """``read`` each of ``keys`` in a shuffled order, epoch after epoch, counting whole batches."""
    order = list(keys)
    rng = random.Random(0)
    while True:
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            for key in order[start : start + batch_size]:
                read(key)
            yield batch_size


@contextlib.contextmanager
def store_read_stream(dataset: str | os.PathLike, *, batch_size: int) -> Iterator[Iterator[int]]:
    """Raw reads of the encoded images in shuffled order, one process: what the format itself costs."""
    from dali_pipes.stores import open_store

    store = open_store(dataset)
    try:
        if len(store) < batch_size:
            raise ValueError(f"{dataset}: {len(store)} samples is less than one batch of {batch_size}")
        # The image alone, as the loader's source reads it.
        yield _reads(range(len(store)), lambda index: store.read(index, ("image",)), batch_size)
    finally:
        store.close()


@contextlib.contextmanager
def file_read_stream(files: Sequence[tuple[Path, int]], *, batch_size: int) -> Iterator[Iterator[int]]:
    """Raw reads of the original image files in shuffled order, one process."""
    if not files:
        raise Skipped("no image files")
    if len(files) < batch_size:
        raise ValueError(f"{len(files)} image files is less than one batch of {batch_size}")
    yield _reads([path for path, _ in files], lambda path: Path(path).read_bytes(), batch_size)
