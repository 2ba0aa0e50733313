"""An image folder of real-photo crops: benchmark data whose JPEGs decode like photographs.

Synthetic images (:mod:`converters.synth`) cost about what photos cost, but a
decoder's and a resizer's speed depends on real content (entropy, detail,
chroma). :func:`make_photo_crops` makes any number of distinct ``size`` JPEGs
from a few real photos: image ``i`` is photo ``i % len(photos)``, scaled up by a
random factor (so the crop can reach ``size`` and neighbouring crops differ),
cropped at a random window, flipped at random and saved at ``quality``. Each
image keeps its photo's class folder, and depends on ``(seed, i)`` alone, so the
same arguments write the same bytes whatever the worker count.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image

from converters.base import ConversionError
from converters.synth import DEFAULT_SIZE, save_whole, write_chunks

log = logging.getLogger(__name__)

_PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png")
#: Images per task sent to a worker.
_CHUNK = 32
#: Extra scale drawn on top of the least that covers ``size``: crops of one photo differ.
_ZOOM = (1.0, 1.6)


def photo_paths(folder: str | os.PathLike) -> list[Path]:
    """The photos of an image folder (``CLASS/NAME.jpg``), sorted; raises when there are none."""
    folder = Path(folder)
    photos = sorted(p for p in folder.glob("*/*") if p.suffix.lower() in _PHOTO_SUFFIXES)
    if not photos:
        raise ConversionError(f"{folder}: no photos found as CLASS/NAME.jpg (or .png); give a class-folder tree")
    return photos


def make_photo_crops(
    out: str | os.PathLike,
    num: int,
    photos: str | os.PathLike | None = None,
    size: tuple[int, int] = DEFAULT_SIZE,
    seed: int = 0,
    quality: int = 90,
    workers: int | None = None,
) -> Path:
    """Write ``num`` crops of ``size`` (width, height) from ``photos`` into ``out/CLASS/crop_XXXXXX.jpg``.

    ``photos`` is a class-folder tree of photos (default: the package's ImageNet
    sample photos). Files appear whole (temporary name, then rename). Returns ``Path(out)``.
    """
    if num < 1:
        raise ConversionError(f"synth --photos: --num must be at least 1, got {num}")
    if not 1 <= quality <= 100:
        raise ConversionError(f"synth --photos: JPEG quality must be between 1 and 100, got {quality}")
    if photos is None:
        from dali_pipes.sample_data import imagenet_mini

        photos = imagenet_mini()
    sources = [str(p) for p in photo_paths(photos)]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a folder; synth writes an image folder there")
    # Only the classes of the photos drawn (crop i comes from photo i % len): an empty class folder would be
    # refused by the converter, so `synth DIR --num 40 --photos` must not leave any.
    for name in sorted({Path(sources[i % len(sources)]).parent.name for i in range(min(num, len(sources)))}):
        (out / name).mkdir(parents=True, exist_ok=True)
    job = (sources, str(out), tuple(size), seed, quality)
    write_chunks(_write_chunk, [(job, start, min(start + _CHUNK, num)) for start in range(0, num, _CHUNK)], workers)
    log.info("synth: wrote %d crops of %dx%d from %d photos to %s", num, size[0], size[1], len(sources), out)
    return out


def render_crop(photo: Image.Image, index: int, size: tuple[int, int], seed: int) -> Image.Image:
    """Crop ``index`` of ``photo``: scaled to cover ``size`` times a random zoom, a random window, a random flip."""
    width, height = size
    rng = np.random.default_rng([seed, 2, index])
    scale = max(width / photo.width, height / photo.height) * rng.uniform(*_ZOOM)
    scaled_w, scaled_h = max(width, round(photo.width * scale)), max(height, round(photo.height * scale))
    scaled = photo.resize((scaled_w, scaled_h), Image.Resampling.LANCZOS)
    left = int(rng.integers(0, scaled_w - width + 1))
    top = int(rng.integers(0, scaled_h - height + 1))
    crop = scaled.crop((left, top, left + width, top + height))
    return crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop


def _write_chunk(task: tuple[tuple[list[str], str, tuple[int, int], int, int], int, int]) -> None:
    (sources, out, size, seed, quality), start, stop = task
    for index in range(start, stop):
        source = Path(sources[index % len(sources)])
        with Image.open(source) as opened:
            photo = opened.convert("RGB")
        path = Path(out) / source.parent.name / f"crop_{index:06d}.jpg"
        save_whole(render_crop(photo, index, size, seed), path, format="JPEG", quality=quality)
