"""``convert parquet``: files laid out as Hugging Face ``datasets`` writes them, written with ``pyarrow``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packed_helpers import assert_converted, assert_killed_conversion_resumes, error_inputs, photos

from converters.base import ConversionError
from converters.runner import convert
from converters.sources import ParquetSource
from converters.synth import make_imagefolder
from dali_pipes.dataset.manifest import load_manifest

from test_convert import run_cli

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

CLASS_NAMES = [f"class-{i}" for i in range(10)]


def write_hf_parquet(path: Path, rows: list[tuple[str | None, bytes | None, int | None]], group: int = 8) -> Path:
    """A file as ``datasets`` writes one: an ``image`` struct {bytes, path}, a ``label`` ClassLabel."""
    features = {
        "image": {"_type": "Image"},
        "label": {"names": CLASS_NAMES, "_type": "ClassLabel"},
    }
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image_type), ("label", pa.int64())]).with_metadata(
        {"huggingface": json.dumps({"info": {"features": features}})}
    )
    images = [None if data is None else {"bytes": data, "path": key} for key, data, _ in rows]
    table = pa.table({"image": images, "label": [label for _, _, label in rows]}, schema=schema)
    pq.write_table(table, path, row_group_size=group)
    return path


def test_hf_layout_converts_byte_for_byte_with_class_names(imagenet_mini, tmp_path):
    expected = photos(imagenet_mini)
    write_hf_parquet(tmp_path / "train-00000-of-00002.parquet", expected[:30])
    write_hf_parquet(tmp_path / "train-00001-of-00002.parquet", expected[30:])
    out = tmp_path / "out"
    run_cli("convert", "parquet", str(tmp_path / "train-*.parquet"), out, "--format", "tfrecord", "--no-progress")
    assert_converted(out, expected)
    manifest = load_manifest(out)
    assert [s.num_samples for s in manifest.shards] == [47]  # two small files packed into one shard
    assert list(manifest.classes) == CLASS_NAMES


def test_bad_rows_are_listed_and_the_rest_converted(imagenet_mini, tmp_path):
    expected = photos(imagenet_mini)[:10]
    rows = [
        *expected[:3],
        ("null.jpg", None, 1),
        ("cut.jpg", expected[0][1][:2000], 2),
        ("nolabel.jpg", expected[1][1], None),
        *expected[3:],
    ]
    path = write_hf_parquet(tmp_path / "mixed.parquet", rows, group=4)
    convert(ParquetSource(path), tmp_path / "out", format="lmdb", shard_size=10_000, workers=2, progress=False)
    assert_converted(tmp_path / "out", expected)
    errors = error_inputs(tmp_path / "out")
    assert set(errors) == {f"{path}:3", f"{path}:4", f"{path}:5"}
    assert "null" in errors[f"{path}:3"] and "label" in errors[f"{path}:5"]


def test_plain_binary_column_and_wrong_columns(imagenet_mini, tmp_path):
    expected = photos(imagenet_mini)[:5]
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"jpg": [d for _, d, _ in expected], "cls": [lab for _, _, lab in expected]}), path)
    with pytest.raises(ConversionError, match="no column 'image' .*jpg, cls.*--image-column"):
        ParquetSource(path).items()
    convert(
        ParquetSource(path, image_column="jpg", label_column="cls"), tmp_path / "out", format="hdf5", progress=False
    )
    assert_converted(tmp_path / "out", [(f"plain.parquet:{i}", d, lab) for i, (_, d, lab) in enumerate(expected)])


@pytest.mark.timeout(300)
def test_killed_conversion_resumes_to_identical_output(tmp_path):
    images = make_imagefolder(tmp_path / "images", 160, size=(96, 64), classes=4, seed=8)
    files = sorted(p for p in images.glob("*/*") if p.is_file())
    rows = [(f.name, f.read_bytes(), i % 4) for i, f in enumerate(files)]
    write_hf_parquet(tmp_path / "a.parquet", rows[:80], group=20)
    write_hf_parquet(tmp_path / "b.parquet", rows[80:], group=20)
    options = ("--format", "lmdb", "--samples-per-shard", "10", "--no-progress")
    assert_killed_conversion_resumes("parquet", str(tmp_path / "*.parquet"), tmp_path, *options, shards=16)


def test_a_damaged_row_group_lists_its_rows_and_keeps_the_others(imagenet_mini, tmp_path):
    expected = photos(imagenet_mini)[:12]
    path = write_hf_parquet(tmp_path / "a.parquet", expected, group=4)
    start = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + 64] = bytes(b ^ 0xFF for b in data[start : start + 64])  # the page header of group 1
    path.write_bytes(bytes(data))
    convert(ParquetSource(path), tmp_path / "out", format="lmdb", workers=1, progress=False)
    assert_converted(tmp_path / "out", expected[:4] + expected[8:])
    errors = error_inputs(tmp_path / "out")
    assert set(errors) == {f"{path}:{row}" for row in range(4, 8)}
    assert all("cannot read row group 1" in why and "\n" not in why for why in errors.values())
