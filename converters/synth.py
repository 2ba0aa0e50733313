"""Synthetic ImageNet-like image folders for demos, benchmarks and tests.

:func:`make_imagefolder` writes ``OUT/class_XXX/img_XXXXXX.jpg``: JPEGs that
cost what photographs cost to store and decode (about 60 to 110 KB at quality 90
for 500x375) because they are built like photographs: a smooth lit background
(sky and ground gradients, low-frequency colour variation), a few objects with
sharp outlines (softened by one pixel, as a lens does) and their own shading,
and textured regions (1/f "fractal" grain of low amplitude and an oriented
ripple, strong in some areas and faint in others, like foliage next to sky).
Pure noise would be far larger and nothing like a photo; flat shapes far smaller.

Each class has its own palette, object shapes, texture grain and orientation, so
a classifier has something to learn. Image ``i`` belongs to class ``i % classes``
and is drawn from a random generator seeded by ``(seed, i)`` alone, so the files
do not depend on the worker count: the same arguments give the same bytes (with
the same numpy and Pillow builds).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from PIL import Image, ImageDraw

from converters.base import ConversionError

log = logging.getLogger(__name__)

#: ImageNet's most common image size, (width, height).
DEFAULT_SIZE = (500, 375)
#: Images per task sent to a worker: large enough to hide the pool's overhead.
_CHUNK = 16
# Texture settings, tuned so that 500x375 at quality 90 lands at 60-110 KB: amplitudes as
# fractions of full scale, the 1/f slope range of the grain (kept narrow: it sets the bits
# per image more than anything else), and the region mask as
# (offset, gain, floor) over a smooth noise field.
_GRAIN = 0.14
_RIPPLE = 0.04
_CHROMA = 0.02
_ROUGHNESS = (0.9, 1.0)
_REGION = (0.6, 0.6, 0.25)


@dataclass(frozen=True)
class _ClassStyle:
    """What makes a class recognisable, drawn once per class from ``(seed, class)``."""

    hues: np.ndarray  # 3 base colours (RGB 0..1) the class's images are painted from
    shape: str  # "ellipse", "polygon", "rect" or "stripes"
    texture_angle: float  # radians: direction of the class's oriented texture
    texture_period: float  # pixels per cycle of the oriented texture
    roughness: float  # spectral slope of the fractal texture (lower = more fine grain)


def parse_size(text: str) -> tuple[int, int]:
    """``"500x375"`` -> ``(500, 375)`` (width, height); raises :class:`ConversionError` otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
    if not match or not all(int(v) > 0 for v in match.groups()):
        raise ConversionError(f"image size {text!r} is not WIDTHxHEIGHT in pixels, such as 500x375")
    return int(match.group(1)), int(match.group(2))


def make_imagefolder(
    out: str | os.PathLike,
    num: int,
    size: tuple[int, int] = DEFAULT_SIZE,
    classes: int = 10,
    seed: int = 0,
    quality: int = 90,
    workers: int | None = None,
) -> Path:
    """Write ``num`` photograph-like JPEGs of ``size`` (width, height) into ``out/class_XXX/img_XXXXXX.jpg``.

    Files are written under a temporary name and renamed, so an interrupted run
    leaves only whole images; running again rewrites the same bytes. ``workers``
    processes draw the images (default: all cores). Returns ``Path(out)``.
    """
    width, height = size
    if num < 1:
        raise ConversionError(f"synth: --num must be at least 1, got {num}")
    if classes < 1:
        raise ConversionError(f"synth: --classes must be at least 1, got {classes}")
    if width < 8 or height < 8:
        raise ConversionError(f"synth: image size {width}x{height} is too small; use at least 8x8 pixels")
    if not 1 <= quality <= 100:
        raise ConversionError(f"synth: JPEG quality must be between 1 and 100, got {quality}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a folder; synth writes an image folder there")
    for c in range(classes):
        (out / _class_name(c)).mkdir(parents=True, exist_ok=True)
    if classes > num:
        log.warning("synth: %d classes for %d images; classes %d and up stay empty", classes, num, num)

    job = (str(out), (width, height), classes, seed, quality)
    write_chunks(_write_chunk, [(job, start, min(start + _CHUNK, num)) for start in range(0, num, _CHUNK)], workers)
    log.info("synth: wrote %d images of %dx%d in %d classes to %s", num, width, height, classes, out)
    return out


def write_chunks(write: Callable[[Any], None], chunks: list, workers: int | None) -> None:
    """``write(chunk)`` for every chunk, in ``workers`` processes (default: all cores; one: in this process)."""
    workers = min(workers or os.cpu_count() or 1, len(chunks))
    if workers <= 1:
        for chunk in chunks:
            write(chunk)
        return
    # Spawned: forked from a process whose other threads hold locks (DALI's, downloads), a worker can die at its start.
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for _ in pool.map(write, chunks):
            pass


def save_whole(image: Image.Image, path: Path, **options: Any) -> None:
    """Save ``image`` to ``path`` under a temporary name, then rename: an interrupted run leaves only whole files.

    No fsync: this is regenerable data; the rename alone keeps half files out of view.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        image.save(tmp, **options)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def image_path(out: str | os.PathLike, index: int, classes: int) -> Path:
    """Where :func:`make_imagefolder` puts image ``index``."""
    return Path(out) / _class_name(index % classes) / f"img_{index:06d}.jpg"


def render(index: int, size: tuple[int, int] = DEFAULT_SIZE, classes: int = 10, seed: int = 0) -> Image.Image:
    """Draw image ``index`` of a synthetic set (an RGB :class:`PIL.Image.Image`), without writing it."""
    width, height = size
    style = _class_style(seed, index % classes)
    rng = np.random.default_rng([seed, 1, index])
    return _render(rng, style, width, height)


def _class_name(c: int) -> str:
    return f"class_{c:03d}"


def _write_chunk(task: tuple[tuple[str, tuple[int, int], int, int, int], int, int]) -> None:
    (out, size, classes, seed, quality), start, stop = task
    for index in range(start, stop):
        image = render(index, size, classes, seed)
        save_whole(
            image, image_path(out, index, classes), format="JPEG", quality=quality, subsampling=2, optimize=False
        )


def _class_style(seed: int, c: int) -> _ClassStyle:
    rng = np.random.default_rng([seed, 0, c])
    base_hue = (c * 0.618034) % 1.0  # golden-ratio steps: neighbouring classes get distant hues
    hues = np.stack(
        [_hsv(base_hue + rng.uniform(-0.08, 0.08), rng.uniform(0.3, 0.8), rng.uniform(0.35, 0.9)) for _ in range(3)]
    )
    return _ClassStyle(
        hues=hues,
        shape=("ellipse", "polygon", "rect", "stripes")[c % 4],
        texture_angle=float(rng.uniform(0, np.pi)),
        texture_period=float(rng.uniform(3.0, 14.0)),
        roughness=float(rng.uniform(*_ROUGHNESS)),
    )


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    """One HSV colour (all 0..1) as RGB 0..1."""
    h = (h % 1.0) * 6.0
    i = int(h)
    f = h - i
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    return np.array([(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i % 6], dtype=np.float32)


@functools.lru_cache(maxsize=32)
def _spectrum(width: int, height: int, slope: float) -> np.ndarray:
    """Amplitudes ``1 / f**slope`` over the FFT grid, scaled so that the noise they shape has unit variance."""
    fy = np.fft.fftfreq(height).astype(np.float32)[:, None]
    fx = np.fft.fftfreq(width).astype(np.float32)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    amp = f ** np.float32(-slope)
    amp[0, 0] = 0.0  # no DC: the fields are zero-mean
    amp *= np.float32(height * width / np.sqrt(np.sum(amp.astype(np.float64) ** 2)))
    amp.setflags(write=False)
    return amp


def _noise(rng: np.random.Generator, width: int, height: int, slope: float) -> tuple[np.ndarray, np.ndarray]:
    """Two independent unit-variance ``1/f**slope`` noise fields (0: white; 2: clouds), by one inverse FFT.

    Natural images have power spectra close to ``1/f**2``; shaping the spectrum
    gives that look directly. Uniform white input is enough (the filtered field is
    Gaussian by the central limit theorem) and much cheaper to draw than normals.
    """
    white = rng.random((2, height, width), dtype=np.float32)
    white -= np.float32(0.5)
    white *= np.float32(np.sqrt(12.0))
    field = np.fft.ifft2((white[0] + 1j * white[1]) * _spectrum(width, height, slope))
    return field.real.astype(np.float32), field.imag.astype(np.float32)


def _smooth_noise(rng: np.random.Generator, width: int, height: int, slope: float) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`_noise` for steep spectra, drawn at a quarter of the size and upsampled:
    their power is all at low frequencies, and this costs a sixteenth."""
    small = _noise(rng, max(4, width // 4), max(4, height // 4), slope)
    return tuple(  # type: ignore[return-value]
        np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.BICUBIC)) for f in small
    )


def _soften(image: np.ndarray) -> np.ndarray:
    """A [1, 2, 1] / 4 blur along both axes: the one-pixel transition a lens leaves on a sharp edge."""
    half = np.float32(0.5)
    quarter = np.float32(0.25)
    out = image * half
    out[1:-1] += (image[:-2] + image[2:]) * quarter
    out[[0, -1]] += image[[0, -1]] * half
    image = out
    out = image * half
    out[:, 1:-1] += (image[:, :-2] + image[:, 2:]) * quarter
    out[:, [0, -1]] += image[:, [0, -1]] * half
    return out


def _render(rng: np.random.Generator, style: _ClassStyle, width: int, height: int) -> Image.Image:
    # Coordinates in 0..1 as a row and a column: broadcasting builds full planes only where needed.
    xx = (np.arange(width, dtype=np.float32) / width)[None, :]
    yy = (np.arange(height, dtype=np.float32) / height)[:, None]
    light, region_field = _smooth_noise(rng, width, height, 2.2)
    warp, _ = _smooth_noise(rng, width, height, 2.4)
    grain, fine = _noise(rng, width, height, style.roughness)

    # Background: a lit gradient between two class colours along a random direction,
    # with slow variations of brightness.
    a, b = style.hues[rng.permutation(3)[:2]]
    angle = rng.uniform(0, 2 * np.pi)
    spread = np.float32(rng.uniform(0.8, 1.6))
    t = np.clip(0.5 + (np.float32(np.cos(angle)) * (xx - 0.5) + np.float32(np.sin(angle)) * (yy - 0.5)) * spread, 0, 1)
    t = t * (1 + np.float32(0.22) * light)
    image = a + (b - a) * t[..., None]

    # Objects: sharp-edged shapes of the class's kind, each with its own colour and a light
    # from one side, drawn into one label map and painted in a single pass.
    count = int(rng.integers(3, 7))
    labels = Image.new("L", (width, height))
    draw = ImageDraw.Draw(labels)
    for k in range(1, count + 1):
        _draw_shape(draw, rng, k, style.shape, width, height)
    index = np.asarray(labels)
    colours = np.zeros((count + 1, 3), np.float32)
    slopes = np.zeros((count + 1, 2), np.float32)
    for k in range(1, count + 1):
        colours[k] = style.hues[rng.integers(3)] * rng.uniform(0.6, 1.3) + rng.normal(0, 0.05, 3)
        slopes[k] = rng.uniform(-0.4, 0.4, 2)
    shade = 1 + np.take(slopes[:, 0], index) * (xx - 0.5) + np.take(slopes[:, 1], index) * (yy - 0.5)
    image = np.where((index > 0)[..., None], np.take(colours, index, axis=0) * shade[..., None], image)
    image = _soften(image)

    # Texture: 1/f grain plus the class's oriented ripple, strong in some regions
    # (foliage, fabric) and almost absent in others (sky, walls), and a little colour grain.
    region = np.clip(_REGION[0] + _REGION[1] * region_field, _REGION[2], 1.0)
    phase = np.float32(np.cos(style.texture_angle) * width) * xx + np.float32(np.sin(style.texture_angle) * height) * yy
    ripple = np.sin(np.float32(2 * np.pi / style.texture_period) * phase + 2 * warp)
    texture = (np.float32(_GRAIN) * grain + np.float32(_RIPPLE) * ripple) * region
    image += texture[..., None]
    image[..., 2] += np.float32(_CHROMA) * fine
    image *= np.float32(255)
    image += np.float32(0.5)
    return Image.fromarray(np.clip(image, 0, 255, out=image).astype(np.uint8))


def _draw_shape(
    draw: ImageDraw.ImageDraw, rng: np.random.Generator, fill: int, kind: str, width: int, height: int
) -> None:
    cx, cy = rng.uniform(0.1, 0.9) * width, rng.uniform(0.1, 0.9) * height
    r = rng.uniform(0.08, 0.3) * min(width, height)
    if kind == "ellipse":
        rx, ry = r * rng.uniform(0.6, 1.4), r * rng.uniform(0.6, 1.4)
        draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=fill)
    elif kind == "rect":
        w, h = r * rng.uniform(0.6, 1.8), r * rng.uniform(0.6, 1.8)
        draw.rectangle((cx - w, cy - h, cx + w, cy + h), fill=fill)
    elif kind == "polygon":
        n = int(rng.integers(3, 8))
        angles = np.sort(rng.uniform(0, 2 * np.pi, n))
        radii = r * rng.uniform(0.5, 1.3, n)
        draw.polygon([(cx + q * np.cos(p), cy + q * np.sin(p)) for p, q in zip(angles, radii)], fill=fill)
    else:  # stripes: a band across the frame at an angle
        d = rng.uniform(0, 2 * np.pi)
        half = r * rng.uniform(0.15, 0.4)
        dx, dy = np.cos(d), np.sin(d)
        nx, ny = -dy * half, dx * half
        far = 2 * max(width, height)
        draw.polygon(
            [
                (cx - dx * far + nx, cy - dy * far + ny),
                (cx + dx * far + nx, cy + dy * far + ny),
                (cx + dx * far - nx, cy + dy * far - ny),
                (cx - dx * far - nx, cy - dy * far - ny),
            ],
            fill=fill,
        )
