"""``convert tfrecord``: TF/TPU ImageNet-layout TFRecords written by the ``tfrecord`` package, CRCs checked."""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from packed_helpers import assert_converted, assert_killed_conversion_resumes, error_inputs, photos
from test_webdataset_source import photo_parts

from converters.base import ConversionError
from converters.runner import convert
from converters.sources import TFRecordSource
from dali_pipes import open_store
from dali_pipes.dataset.manifest import load_manifest

from test_convert import run_cli

tfrecord = pytest.importorskip("tfrecord")


def imagenet_example(key: str, image: bytes, label: int, boxes: list[list[float]]) -> dict:
    """One record in the layout of TensorFlow's build_imagenet_data.py (labels 1..1000 there)."""
    columns = np.array(boxes, dtype=np.float32).reshape(-1, 4).T
    return {
        "image/encoded": (image, "byte"),
        "image/class/label": (label, "int"),
        "image/class/synset": (b"n0144076" + str(label).encode(), "byte"),
        "image/filename": (key.encode(), "byte"),
        "image/format": (b"JPEG", "byte"),
        "image/height": (100, "int"),
        **{
            f"image/object/bbox/{side}": (list(map(float, col)), "float")
            for side, col in zip("xmin ymin xmax ymax".split(), columns)
        },
    }


def write_records(path: Path, examples: list[dict]) -> Path:
    writer = tfrecord.TFRecordWriter(str(path))
    for example in examples:
        writer.write(example)
    writer.close()
    return path


def boxes_of(i: int) -> list[list[float]]:
    return [[0.1 * k, 0.05, 0.5 + 0.01 * i, 0.9] for k in range(i % 3)]


@pytest.fixture(scope="module")
def imagenet_records(imagenet_mini, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tfr")
    expected = photos(imagenet_mini)
    parts = (expected[:16], expected[16:32], expected[32:])
    paths = []
    for n, part in enumerate(parts):
        start = sum(len(p) for p in parts[:n])
        examples = [imagenet_example(k, img, lab, boxes_of(start + i)) for i, (k, img, lab) in enumerate(part)]
        paths.append(write_records(folder / f"train-{n:05d}-of-00003", examples))
    return paths, expected


def test_imagenet_layout_converts_byte_for_byte_with_boxes(imagenet_records, tmp_path):
    paths, expected = imagenet_records
    out = tmp_path / "out"
    run_cli("convert", "tfrecord", str(paths[0].parent / "train-*-of-00003"), out, "--format", "hdf5", "--no-progress")
    assert_converted(out, expected)
    manifest = load_manifest(out)
    assert [s.num_samples for s in manifest.shards] == [47]  # three small files packed into one automatic shard
    assert "boxes" not in manifest.fields and "xmin ymin xmax ymax" in manifest.extra["bbox"]
    store = open_store(out)
    for i in (0, 1, 2, 46):
        np.testing.assert_array_equal(store[i]["bbox"], np.array(boxes_of(i), np.float32).reshape(-1, 4))


def test_damaged_records_are_listed_and_the_rest_converted(imagenet_mini, tmp_path):
    expected = photos(imagenet_mini)[:6]
    path = write_records(tmp_path / "mixed.tfrecord", [imagenet_example(k, i, lab, []) for k, i, lab in expected])
    data = bytearray(path.read_bytes())
    # Record 1: one flipped byte inside its data (the data CRC catches it). Record 2: a truncated JPEG, CRCs right.
    first = struct.unpack_from("<Q", data, 0)[0] + 16
    data[first + 12 + 200] ^= 0xFF
    path.write_bytes(bytes(data[: len(data) - 7]))  # and the last record cut short: a damaged tail
    broken = imagenet_example("broken", expected[2][1][:3000], 1, [])
    write_records(tmp_path / "broken.tfrecord", [broken])
    source = TFRecordSource([path, tmp_path / "broken.tfrecord"], bbox_prefix=None)
    convert(source, tmp_path / "out", format="lmdb", workers=1, progress=False)
    assert_converted(tmp_path / "out", [expected[0], *expected[2:5]])
    errors = error_inputs(tmp_path / "out")
    assert set(errors) == {f"{path}:1", f"{path}:5", f"{tmp_path / 'broken.tfrecord'}:0"}
    assert "data CRC mismatch" in errors[f"{path}:1"]
    assert "truncated" in errors[f"{path}:5"] and "cannot be read" in errors[f"{path}:5"]


def test_missing_image_feature_is_refused_naming_the_features(tmp_path):
    path = write_records(tmp_path / "x.tfrecord", [{"jpeg": (b"abc", "byte")}])
    with pytest.raises(ConversionError, match="--image-feature") as info:
        TFRecordSource(path).items()
    assert "jpeg" in str(info.value)


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_compressed_file_is_refused_before_converting(imagenet_records, tmp_path, compression):
    # Among good files, a compressed one used to cost all its records while counting as one bad input.
    paths, _ = imagenet_records
    data = paths[1].read_bytes()
    packed = tmp_path / "train-00001-of-00003"
    packed.write_bytes(gzip.compress(data, mtime=0) if compression == "GZIP" else zlib.compress(data))
    source = TFRecordSource([paths[0], packed, paths[2]])
    with pytest.raises(ConversionError, match=f"{packed}: the file is {compression}-compressed.*decompress it"):
        convert(source, tmp_path / "out", format="lmdb", workers=1, progress=False)
    assert not (tmp_path / "out" / "index.json").exists()


@pytest.mark.timeout(300)
def test_killed_conversion_resumes_to_identical_output(tmp_path):
    for n, part in enumerate(photo_parts(tmp_path, seed=6)):
        write_records(tmp_path / f"r-{n:02d}", [imagenet_example(f.name, f.read_bytes(), n, []) for f in part])
    # 7 records a shard: most shards span two files of 10, read one after the other by their task.
    options = ("--format", "lmdb", "--samples-per-shard", "7", "--no-progress")
    assert_killed_conversion_resumes("tfrecord", str(tmp_path / "r-*"), tmp_path, *options, shards=23)
