"""Equal content for the ``formats`` suite: the same images as files and as every shard format.

The images are taken from the dataset itself (its encoded bytes, unchanged),
written as an image folder, and that folder is converted to LMDB, HDF5 and
TFRecord: every storage then holds byte-identical images, whatever the dataset
was made from.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

_SUFFIXES = (
    (b"\xff\xd8\xff", ".jpg"),
    (b"\x89PNG", ".png"),
    (b"BM", ".bmp"),
    (b"RIFF", ".webp"),
    (b"II*\x00", ".tif"),
    (b"MM\x00*", ".tif"),
)


@dataclass
class EqualContent:
    """The image folder (``files`` as ``(path, label)``) and one dataset folder per format."""

    root: Path
    files: tuple[tuple[Path, int], ...]
    datasets: dict[str, Path] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.files)

    @property
    def bytes(self) -> int:
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
    runner_log = logging.getLogger("converters.runner")
    level = runner_log.level
    runner_log.setLevel(logging.WARNING)  # the line below says it once; the runner's summaries would repeat it
    try:
        for fmt in FORMATS:
            log.info("formats: converting %d images to %s", content.count, fmt)
            out = tmp / fmt
            convert(ImageFolderSource(root), out, format=fmt, workers=workers, progress=progress)
            content.datasets[fmt] = out
    finally:
        runner_log.setLevel(level)
    return content
