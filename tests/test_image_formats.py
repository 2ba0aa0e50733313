"""Images are recognised by content: every format DALI decodes is kept, everything else is listed.

Real files written by Pillow (JPEG 2000 through OpenJPEG) and plain-text PNM written by
hand, from a real photo; DALI's CPU decoder reads back what the conversion stored.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from nvidia.dali import fn, pipeline_def, types
from PIL import Image

from converters.image_formats import image_format, refusal
from dali_pipes import open_store

from test_convert import run_cli

#: Formats whose pixels both decoders must give exactly; the others are lossy and may differ by rounding.
LOSSLESS = {"png", "bmp", "tiff", "webp-lossless", "ppm", "pgm", "pbm", "plain-pbm", "plain-pgm", "plain-ppm"}


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _plain_pnm(image: Image.Image, magic: str) -> bytes:
    """P1 (bitmap), P2 (greymap) or P3 (pixmap) in ASCII, which Pillow does not write."""
    if magic == "P1":
        pixels = (np.asarray(image.convert("L")) < 128).astype(int)  # 1 is black in a PBM
        header = f"P1\n{image.width} {image.height}\n"
    elif magic == "P2":
        pixels = np.asarray(image.convert("L"))
        header = f"P2\n# a comment\n{image.width} {image.height}\n255\n"
    else:
        pixels = np.asarray(image.convert("RGB")).reshape(image.height, -1)
        header = f"P3\n{image.width} {image.height}\n255\n"
    return (header + "\n".join(" ".join(map(str, row)) for row in pixels) + "\n").encode()


def accepted_files(photo: Path) -> dict[str, bytes]:
    """One file of each accepted format (and of lying or missing extensions), by file name."""
    with Image.open(photo) as full:
        image = full.convert("RGB").resize((60, 40))
    jpeg = _encode(image, "JPEG", quality=90)
    return {
        "jpeg.jpg": jpeg,
        "png.png": _encode(image, "PNG"),
        "bmp.bmp": _encode(image, "BMP"),
        "tiff.tif": _encode(image, "TIFF", compression="tiff_lzw"),
        "webp.webp": _encode(image, "WEBP", quality=90),
        "webp-lossless.webp": _encode(image, "WEBP", lossless=True),
        "jpeg2000.jp2": _encode(image, "JPEG2000"),
        "codestream.j2k": _encode(image, "JPEG2000", no_jp2=True),
        "ppm.ppm": _encode(image, "PPM"),
        "pgm.pgm": _encode(image.convert("L"), "PPM"),
        "pbm.pbm": _encode(image.convert("1"), "PPM"),
        "plain-pbm.pnm": _plain_pnm(image, "P1"),
        "plain-pgm.pnm": _plain_pnm(image, "P2"),
        "plain-ppm.pnm": _plain_pnm(image, "P3"),
        "jpeg-named.png": jpeg,
        "png-without-extension": _encode(image, "PNG"),
        "jpeg2000-named.dat": _encode(image, "JPEG2000"),
    }


def dali_decode(encoded: list[bytes]) -> list[np.ndarray]:
    """RGB pixels from DALI's CPU decoder, as the loader decodes."""

    @pipeline_def(batch_size=len(encoded), num_threads=1, device_id=None)
    def decode():
        data = fn.external_source(source=lambda: [np.frombuffer(b, np.uint8) for b in encoded], batch=True)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    (out,) = pipe.run()
    return [np.array(out[i]) for i in range(len(encoded))]


def test_a_folder_of_every_format_converts_with_each_file_kept_or_listed(imagenet_mini, tmp_path):
    photo = sorted(imagenet_mini.glob("*/*.jpg"))[0]
    files = accepted_files(photo)
    root = tmp_path / "images"
    (root / "good").mkdir(parents=True)
    (root / "bad").mkdir()
    for name, data in files.items():
        (root / "good" / name).write_bytes(data)
    with Image.open(photo) as full:
        full.resize((30, 20)).save(root / "bad" / "anim.gif")
    (root / "bad" / "notes.txt").write_text("labels are in the folder names")
    (root / "bad" / "empty.jpg").write_bytes(b"")
    shutil.copy(photo, root / "bad" / "photo.jpg")  # so that class 'bad' keeps one sample

    out = tmp_path / "shards"
    proc = run_cli("convert", "imagefolder", root, out, "--no-progress", "--workers", "1")
    summary = proc.stdout.splitlines()[0]
    assert f"{len(files) + 1} samples in 1 lmdb shard(s)" in summary and "left out 3 input(s)" in summary, proc.stdout

    errors = {
        Path(e["input"]).name: e["reason"] for e in map(json.loads, (out / "errors.jsonl").read_text().splitlines())
    }
    assert sorted(errors) == ["anim.gif", "empty.jpg", "notes.txt"]
    assert errors["anim.gif"].startswith("a GIF file, not a format DALI's decoder reads")
    assert errors["notes.txt"].startswith("not an image file") and errors["empty.jpg"] == "empty file (0 bytes)"
    for name in errors:  # each reason is also in the summary the user sees
        assert name in proc.stdout

    store = open_store(out)
    stored = {store[i]["key"].decode(): store[i]["image"] for i in range(len(store))}
    assert set(stored) == {f"good/{name}" for name in files} | {"bad/photo.jpg"}
    names = sorted(files)
    decoded = dali_decode([stored[f"good/{name}"] for name in names])
    for name, pixels in zip(names, decoded):
        assert stored[f"good/{name}"] == files[name], f"{name}: stored bytes differ from the file"
        with Image.open(io.BytesIO(files[name])) as image:
            reference = np.asarray(image.convert("RGB"))
        assert pixels.shape == reference.shape == (40, 60, 3), name
        diff = np.abs(pixels.astype(int) - reference.astype(int))
        if name.split(".")[0] in LOSSLESS:
            assert diff.max() == 0, f"{name}: DALI and Pillow disagree on a lossless image (max {diff.max()})"
        else:
            assert diff.mean() < 2.0, f"{name}: DALI and Pillow differ by {diff.mean():.2f} on average"


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"\xff\xd8\xff\xe1\x00\x10Exif", "JPEG"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "PNG"),
        (b"BM6\x00\x00\x00", "BMP"),
        (b"II*\x00\x08\x00", "TIFF"),
        (b"MM\x00*\x00\x00", "TIFF"),
        (b"RIFF\x10\x00\x00\x00WEBPVP8 ", "WebP"),
        (b"\x00\x00\x00\x0cjP  \r\n\x87\n\x00", "JPEG 2000"),
        (b"\xffO\xffQ\x00/", "JPEG 2000"),
        (b"P6\n640 480\n255\n", "PNM"),
        (b"P1 2 2\n", "PNM"),
        (b"P7\nWIDTH 2\n", None),  # PAM: DALI does not read it
        (b"Photo of a cat", None),  # starts with P, but not a PNM header
        (b"RIFF\x10\x00\x00\x00WAVEfmt ", None),
        (b"GIF89a", None),
        (b"", None),
    ],
)
def test_image_format_by_first_bytes(head, expected):
    assert image_format(head) == expected


def test_refusals_name_what_the_file_is():
    assert refusal(b"") == "empty file (0 bytes)"
    assert refusal(b"GIF89a\x01\x00").startswith("a GIF file, not a format DALI's decoder reads (accepted: JPEG, PNG")
    assert refusal(b"%PDF-1.7").startswith("a PDF file")
    assert refusal(b"hello").startswith("not an image file (starts with b'hello'")


def test_the_benchmarks_original_files_are_the_images_the_conversion_keeps(imagenet_mini, tmp_path):
    from dali_pipes.bench.baselines import imagefolder_files

    photo = sorted(imagenet_mini.glob("*/*.jpg"))[0]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "photo.jp2").write_bytes(accepted_files(photo)["jpeg2000.jp2"])
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    shutil.copy(photo, tmp_path / "b" / "photo")
    assert imagefolder_files(tmp_path) == [(tmp_path / "a" / "photo.jp2", 0), (tmp_path / "b" / "photo", 1)]
