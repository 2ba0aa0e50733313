"""Image checks and the optional resize on the way into a shard.

Every image a source loads goes through :func:`prepare_image`: it is decoded in
full (a truncated, unreadable or non-image file raises :class:`SampleError` with
a reason), and then either kept as its original bytes (the default) or, when
``ImageOptions.max_size`` is set and the image is larger, resized and
re-encoded as an RGB JPEG.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps

from converters.base import ImageOptions, SampleError, process_wide_error
from converters.image_formats import HEAD_BYTES, image_format, refusal
from dali_pipes.remote.urls import is_url

#: Decompression-bomb guard: images with more pixels than this are refused before
#: decoding. It is Pillow's own error threshold (twice ``Image.MAX_IMAGE_PIXELS``'s
#: default), so the guard holds even where a caller has switched Pillow's off.
#: A 16k x 10k panorama still passes.
MAX_PIXELS = 2 * 89_478_485

#: ``Image.thumbnail``'s default: JPEG DCT scaling reduces to at least twice the
#: target size, so the final LANCZOS pass still has detail to filter from.
_REDUCING_GAP = 2.0


@dataclass(frozen=True)
class ImageInfo:
    """What a full decode found: the container ``format`` (Pillow's name, e.g.
    ``"JPEG"``), the size in pixels and Pillow's ``mode`` (``"RGB"``, ``"RGBA"``, ``"L"``, ...)."""

    format: str
    width: int
    height: int
    mode: str


def check_image(data: bytes, name: str, *, max_pixels: int = MAX_PIXELS) -> ImageInfo:
    """Decode ``data`` completely and describe it; raise :class:`SampleError` if it is not a whole image.

    ``name`` (a path or key) is only used in the error. JPEGs are decoded with
    DCT scaling (Pillow's draft mode): every entropy-coded byte is still read, so
    truncation is caught exactly as by a full-size decode, at a fraction of the cost.
    """
    image, info = _decode(data, name, draft_to=(1, 1), max_pixels=max_pixels)
    image.close()
    return info


def prepare_image(data: bytes, name: str, options: ImageOptions, *, max_pixels: int = MAX_PIXELS) -> bytes:
    """Check an encoded image and return the bytes to store.

    The original ``data`` is returned unchanged (same object) unless
    ``options.max_size`` is set and the longest side exceeds it; then the image is
    resized (LANCZOS, aspect kept, longest side = ``max_size``), turned upright
    by its EXIF orientation (the re-encoded file carries no EXIF), converted to
    RGB (alpha dropped, as the loader's RGB decode does) and encoded as a
    baseline JPEG at ``options.quality``. The same input and options always give
    the same bytes. Raises :class:`SampleError` for anything :func:`check_image` refuses.
    """
    max_size = options.max_size
    if max_size is None:
        check_image(data, name, max_pixels=max_pixels)
        return data
    if max_size < 1:
        raise ValueError(f"max_size must be a positive number of pixels, got {max_size}")

    # Peek at the header first so that images needing no resize take the cheap check.
    width, height = _header_size(data, name)
    if max(width, height) <= max_size:
        check_image(data, name, max_pixels=max_pixels)
        return data

    target = _fit(width, height, max_size)
    draft = (int(target[0] * _REDUCING_GAP), int(target[1] * _REDUCING_GAP))
    image, _ = _decode(data, name, draft_to=draft, max_pixels=max_pixels)
    try:
        image = ImageOps.exif_transpose(image)
        image = _to_rgb(image, name)
        # EXIF rotation may have swapped the sides: fit again on what we now hold.
        target = _fit(image.width, image.height, max_size)
        if image.size != target:
            image = image.resize(target, Image.Resampling.LANCZOS)
        out = io.BytesIO()
        # Explicit settings (4:2:0, no optimize pass, no progressive, no metadata) keep the
        # bytes a pure function of the pixels and the quality.
        image.save(out, format="JPEG", quality=options.quality, subsampling=2, optimize=False, progressive=False)
    finally:
        image.close()
    return out.getvalue()


def _read_url(url: str, name: str) -> bytes:
    from converters.remote_inputs import read_input
    from dali_pipes.remote.fs import RemoteError

    try:
        return read_input(url)
    except RemoteError as exc:  # a missing object, access denied: this input's problem, named
        raise SampleError(name, str(exc)) from None


def load_image_file(path: str | os.PathLike, name: str, options: ImageOptions) -> bytes:
    """Read an image file and :func:`prepare_image` it; a file that cannot be read is a :class:`SampleError`."""
    try:
        if is_url(path):  # an input in object storage (one request, retried)
            data = _read_url(str(path), name)
        else:
            with open(path, "rb") as f:
                data = f.read()
    except FileNotFoundError:
        raise SampleError(name, "file not found") from None
    except OSError as exc:
        fatal = process_wide_error(exc, str(path))
        if fatal is not None:
            raise fatal from exc
        raise SampleError(name, f"cannot read the file ({exc.strerror or exc})") from None
    return prepare_image(data, name, options)


def _fit(width: int, height: int, max_size: int) -> tuple[int, int]:
    """The size with the longest side ``max_size`` and the aspect kept (never below 1 px)."""
    longest = max(width, height)
    if longest <= max_size:
        return width, height
    scale = max_size / longest
    return max(1, round(width * scale)), max(1, round(height * scale))


def _header_size(data: bytes, name: str) -> tuple[int, int]:
    image = _open(data, name)
    try:
        return image.size
    finally:
        image.close()


def _open(data: bytes, name: str) -> Image.Image:
    # The format is told by content, as DALI's decoder tells it: formats DALI does not read are
    # refused here rather than failing later inside a training job, whatever Pillow could do.
    if image_format(data[:HEAD_BYTES]) is None:
        raise SampleError(name, refusal(data[:HEAD_BYTES]))
    try:
        with warnings.catch_warnings():
            # The pixel limit in _decode decides; Pillow's warning would only be noise (or an error under -W error).
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise SampleError(name, f"image too large to decode safely ({exc})") from None
    except Image.UnidentifiedImageError:
        kind = image_format(data[:HEAD_BYTES])
        raise SampleError(name, f"starts like a {kind} file but its header is unreadable") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for malformed headers
        raise SampleError(name, f"unreadable image header ({type(exc).__name__}: {exc})") from None


def _decode(data: bytes, name: str, *, draft_to: tuple[int, int], max_pixels: int) -> tuple[Image.Image, ImageInfo]:
    """Open and fully decode; return the loaded image (possibly DCT-reduced) and the full-size info."""
    image = _open(data, name)
    fmt = image.format or "unknown"
    width, height = image.size
    info = ImageInfo(format=fmt, width=width, height=height, mode=image.mode)
    try:
        if width < 1 or height < 1:
            raise SampleError(name, f"{fmt} image has an empty size {width}x{height}")
        if width * height > max_pixels:
            raise SampleError(
                name,
                f"{fmt} image is {width}x{height} pixels, more than the limit of {max_pixels} (decompression bomb guard)",
            )
        if image_format(data[:HEAD_BYTES]) == "JPEG":  # Pillow says "MPO" for a camera's multi-picture JPEG
            image.draft(None, draft_to)
        try:
            image.load()
        except OSError as exc:
            if "truncated" in str(exc):
                raise SampleError(name, f"truncated {fmt} ({exc})") from None
            raise SampleError(name, f"unreadable {fmt} ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - decoders raise SyntaxError, ValueError, struct.error, ...
            raise SampleError(name, f"unreadable {fmt} ({type(exc).__name__}: {exc})") from None
    except BaseException:
        image.close()
        raise
    return image, info


def _to_rgb(image: Image.Image, name: str) -> Image.Image:
    if image.mode == "RGB":
        return image
    try:
        if image.mode == "P" and "transparency" in image.info:
            # Going through RGBA avoids Pillow's warning about palette transparency.
            image = image.convert("RGBA")
        if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
            # 16-bit greyscale (assumed 0..65535) and float (assumed 0..1): scale to 8 bits
            # by the type's range rather than clipping everything above 255 to white.
            top = 255.0 / 65535.0 if image.mode != "F" else 255.0
            image = image.convert("F").point(lambda v: v * top).convert("L")
        return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001
        raise SampleError(name, f"cannot convert a {image.mode} image to RGB ({exc})") from None
