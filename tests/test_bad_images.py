"""Awkward and broken input images: each is converted to something that decodes as RGB, or
left out and listed in ``errors.jsonl`` by name with a reason (``--on-error skip``).

DALI's CPU decoder (2.4) reads CMYK and greyscale JPEGs, 16-bit, RGBA and palette PNGs
into RGB as Pillow does, so these are kept as their original bytes, not re-encoded.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dali_pipes import open_store
from dali_pipes.cli.verify import verify_dataset

from test_convert import run_cli  # noqa: E402 - shared helper

SIZE = (48, 40)  # width, height of the test images


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _bomb_png(width: int = 40_000, height: int = 40_000) -> bytes:
    """A valid PNG header claiming ``width`` x ``height`` RGB pixels, with a few bytes of data.

    A hundred bytes on disk, 4.8 GB decoded: the converter must refuse it from the header alone.
    """
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + _png_chunk(b"IEND", b"")
    )


def _encode(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _pixels() -> Image.Image:
    rng = np.random.default_rng(7)
    return Image.fromarray(rng.integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8))


def _deep16() -> Image.Image:
    rng = np.random.default_rng(8)
    return Image.fromarray(rng.integers(0, 65536, (SIZE[1], SIZE[0])).astype(np.uint16))


def _rgb_reference(data: bytes) -> np.ndarray:
    """What an RGB decode of ``data`` should give, by Pillow; 16-bit grey scaled by its range, not clipped."""
    image = Image.open(io.BytesIO(data))
    if image.mode == "I;16":
        image = image.convert("F").point(lambda v: v * 255.0 / 65535.0).convert("L")
    return np.asarray(image.convert("RGB"), dtype=np.float64)


# Kept: name -> bytes. Each must come out of the shards unchanged and decode to RGB.
KEPT = {
    "cmyk.jpg": lambda: _encode(_pixels().convert("CMYK"), "JPEG"),
    "grey.jpg": lambda: _encode(_pixels().convert("L"), "JPEG"),
    "deep16.png": lambda: _encode(_deep16(), "PNG"),
    "rgba.png": lambda: _encode(_pixels().convert("RGBA"), "PNG"),
    "palette.png": lambda: _encode(_pixels().convert("P"), "PNG"),
    # Wrong extensions: the content decides, both ways.
    "png-named.jpg": lambda: _encode(_pixels(), "PNG"),
    "jpeg-named.png": lambda: _encode(_pixels(), "JPEG"),
    "good.jpg": lambda: _encode(_pixels(), "JPEG"),
}
# Left out: name -> (bytes, words the reason must contain).
REFUSED = {
    "bomb.png": (_bomb_png, "too large"),
    "zero.jpg": (lambda: b"", "0 bytes"),
    "truncated-header.jpg": (lambda: _encode(_pixels(), "JPEG")[:300], "unreadable"),
    "truncated-body.jpg": (lambda: _encode(_pixels(), "JPEG")[:-600], "truncated"),
    "text.jpg": (lambda: b"this is not an image\n" * 20, "not an image"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bad") / "images"
    (root / "only").mkdir(parents=True)
    for name, make in KEPT.items():
        (root / "only" / name).write_bytes(make())
    for name, (make, _) in REFUSED.items():
        (root / "only" / name).write_bytes(make())
    out = root.parent / "out"
    run_cli("convert", "imagefolder", root, out, "--on-error", "skip", "--workers", "1", "--no-progress")
    return root, out


def test_each_bad_input_is_listed_by_name_with_its_reason(converted):
    root, out = converted
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    by_name = {Path(e["input"]).name: e["reason"] for e in errors}
    assert sorted(by_name) == sorted(REFUSED)
    for name, (_, words) in REFUSED.items():
        assert words in by_name[name], f"{name}: reason {by_name[name]!r} does not say {words!r}"
    assert verify_dataset(out, progress=False).ok


def test_each_awkward_image_is_kept_unchanged_and_decodes_to_rgb_through_dali(converted):
    from nvidia.dali import fn, pipeline_def, types

    root, out = converted
    store = open_store(out)
    stored = {store[i]["key"].decode().split("/")[-1]: store[i]["image"] for i in range(len(store))}
    assert sorted(stored) == sorted(KEPT)
    names = sorted(stored)
    for name in names:
        assert stored[name] == (root / "only" / name).read_bytes(), f"{name} was changed on the way in"
    # The misnamed files are kept as what they are, not as what their names say.
    assert stored["png-named.jpg"].startswith(b"\x89PNG") and stored["jpeg-named.png"].startswith(b"\xff\xd8")

    # The decoder the loader uses, on the CPU, against Pillow's RGB conversion of the same bytes.
    batch = [np.frombuffer(stored[name], np.uint8) for name in names]

    @pipeline_def(batch_size=len(names), num_threads=1, device_id=None)
    def decode():
        return fn.decoders.image(
            fn.external_source(source=lambda: batch, batch=True), device="cpu", output_type=types.RGB
        )

    pipe = decode()
    pipe.build()
    (images,) = pipe.run()
    for name, decoded in zip(names, images):
        decoded = np.asarray(decoded, dtype=np.float64)
        reference = _rgb_reference(stored[name])
        assert decoded.shape == (SIZE[1], SIZE[0], 3), f"{name} decoded to shape {decoded.shape}"
        # Within rounding: 16-bit to 8-bit may differ by one level.
        assert np.abs(decoded - reference).mean() < 1.0, f"{name} decodes to other colours than Pillow's"


def test_the_loader_delivers_every_kept_image_as_three_channels(converted):
    from dali_pipes import BatchFormat, ClassificationVal, DALILoader, RunOptions

    _, out = converted
    seen = []
    with DALILoader(
        out,
        ClassificationVal(size=32, resize=36),
        batch_size=1,
        shuffle=False,
        last_batch="drop",
        run=RunOptions(device="cpu", py_num_workers=0),
        batch_format=BatchFormat(with_index=True),
    ) as loader:
        for batch in loader:
            assert tuple(batch["image"].shape) == (1, 3, 32, 32)
            assert bool(batch["image"].isfinite().all())
            seen.append(int(batch["index"][0]))
    assert sorted(seen) == list(range(len(KEPT)))
