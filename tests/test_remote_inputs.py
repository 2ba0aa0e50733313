"""Conversion from object storage (moto's S3 server on 127.0.0.1): tars and Parquet files read by ranged requests,
faults on the way retried; Parquet image structs that give a path and no bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from packed_helpers import assert_converted, photos
from test_parquet_source import write_hf_parquet
from test_webdataset_source import sample_members, write_tar

from converters.base import ImageOptions
from converters.runner import convert
from converters.sources import ParquetSource, WebDatasetSource
from dali_pipes.cli import main as cli

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_path_parquet(path: Path, rows, image_paths) -> Path:
    """A Parquet file as ``datasets`` writes one built from files: each image struct has a path and no bytes."""
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image_type), ("label", pa.int64())])
    images = [{"bytes": None, "path": p} for p in image_paths]
    pq.write_table(pa.table({"image": images, "label": [r[2] for r in rows]}, schema=schema), path, row_group_size=8)
    return path


def path_rows(imagenet_mini, folder: Path):
    """The photos as files in ``folder/images/`` and their rows, keyed by the path the struct gives."""
    rows = photos(imagenet_mini)[:12]
    (folder / "images").mkdir(parents=True)
    for key, data, _ in rows:
        (folder / "images" / f"{key}.jpg").write_bytes(data)
    return rows


def test_parquet_images_given_by_a_relative_or_absolute_path(imagenet_mini, tmp_path):
    rows = path_rows(imagenet_mini, tmp_path / "data")
    names = [f"images/{key}.jpg" if i % 2 else str(tmp_path / "data" / "images" / f"{key}.jpg")
             for i, (key, _, _) in enumerate(rows)]  # fmt: skip
    write_path_parquet(tmp_path / "data" / "train.parquet", rows, names)
    convert(ParquetSource(str(tmp_path / "data" / "train.parquet")), tmp_path / "out", format="lmdb", progress=False)
    assert_converted(tmp_path / "out", [(name, data, label) for name, (_, data, label) in zip(names, rows)])


def test_parquet_from_s3_by_row_group_with_images_by_path(imagenet_mini, tmp_path, s3_env):
    s3 = s3_env
    rows = path_rows(imagenet_mini, tmp_path / "data")
    names = [f"images/{key}.jpg" for key, _, _ in rows]
    write_path_parquet(tmp_path / "data" / "train-0.parquet", rows[:5], names[:5])
    write_hf_parquet(tmp_path / "data" / "train-1.parquet", rows[5:])  # bytes inside
    bucket = s3.new_bucket()
    s3.fs().put(f"{tmp_path / 'data'}/", f"{bucket}/data/", recursive=True)
    drop = s3.proxy.add("drop", path=r"train-1\.parquet", times=2)  # dropped mid-answer, twice: retried
    source = ParquetSource(f"s3://{bucket}/data/train-*.parquet", ImageOptions())
    convert(source, tmp_path / "out", format="tfrecord", progress=False, workers=1)
    expected = [(n, d, label) for n, (_, d, label) in zip(names[:5], rows[:5])] + rows[5:]
    assert_converted(tmp_path / "out", expected)
    assert not (tmp_path / "out" / "errors.jsonl").read_text().strip()
    assert drop.seen == 2


def test_webdataset_tars_from_s3_read_by_ranges(imagenet_mini, tmp_path, s3_env):
    s3 = s3_env
    expected = photos(imagenet_mini)
    folder = tmp_path / "tars"
    folder.mkdir()
    for n, part in enumerate((expected[:20], expected[20:])):
        write_tar(
            folder / f"train-{n:06d}.tar", [m for key, image, label in part for m in sample_members(key, image, label)]
        )
    bucket = s3.new_bucket()
    s3.fs().put(f"{folder}/", f"{bucket}/wds/", recursive=True)
    slow = s3.proxy.add("slowdown", path=r"train-000001\.tar", times=3)
    source = WebDatasetSource(f"s3://{bucket}/wds/train-{{000000..000001}}.tar", ImageOptions())
    convert(source, tmp_path / "out", format="lmdb", progress=False, workers=2)
    assert_converted(tmp_path / "out", expected)
    assert slow.seen == 3


def test_an_image_folder_in_s3_converts_as_the_same_folder_on_disk(imagenet_mini, tmp_path, s3_env):
    from converters.sources import ImageFolderSource

    from loader_helpers import sample_digests

    bucket = s3_env.new_bucket()
    s3_env.fs().put(f"{imagenet_mini}/", f"{bucket}/train/", recursive=True)
    local = convert(ImageFolderSource(imagenet_mini), tmp_path / "local", format="hdf5", progress=False)
    remote = convert(
        ImageFolderSource(f"s3://{bucket}/train"), tmp_path / "out", format="hdf5", progress=False, workers=2
    )
    assert remote.manifest.classes == local.manifest.classes
    assert remote.manifest.source["root"] == f"s3://{bucket}/train"
    assert sample_digests(tmp_path / "out") == sample_digests(tmp_path / "local")
    # The command line too: the URL reaches the source as written (a Path argument once made it "s3:/bucket").
    argv = ["convert", "imagefolder", f"s3://{bucket}/train", str(tmp_path / "cli"), "--format", "hdf5"]
    assert cli([*argv, "--no-progress", "--workers", "1"]) == 0
    assert sample_digests(tmp_path / "cli") == sample_digests(tmp_path / "local")


def test_a_list_file_in_s3_reads_its_images_from_beside_it(imagenet_mini, tmp_path, s3_env):
    from converters.sources import ListFileSource

    rows = path_rows(imagenet_mini, tmp_path / "data")
    lines = [f"{key} images/{key}.jpg {label}" for key, _, label in rows]
    (tmp_path / "data" / "train.txt").write_text("\n".join(lines) + "\n")
    bucket = s3_env.new_bucket()
    s3_env.fs().put(f"{tmp_path / 'data'}/", f"{bucket}/data/", recursive=True)
    source = ListFileSource(f"s3://{bucket}/data/train.txt")
    convert(source, tmp_path / "out", format="lmdb", progress=False, order="source")  # the rows in order
    assert_converted(tmp_path / "out", rows)
    argv = ["convert", "list", f"s3://{bucket}/data/train.txt", str(tmp_path / "cli"), "--format", "lmdb"]
    assert cli([*argv, "--no-progress", "--order", "source"]) == 0
    assert_converted(tmp_path / "cli", rows)


def test_tfrecord_files_in_s3_convert_as_the_same_files_on_disk(imagenet_mini, tmp_path, s3_env):
    """Headers walked in one ordered pass through large ranged reads, records read by range; damage still named."""
    pytest.importorskip("tfrecord")
    from test_tfrecord_source import boxes_of, imagenet_example, write_records

    from converters.sources import TFRecordSource

    from loader_helpers import sample_digests

    expected = photos(imagenet_mini)
    folder = tmp_path / "tfr"
    folder.mkdir()
    for n, part in enumerate((expected[:20], expected[20:])):
        examples = [imagenet_example(k, img, lab, boxes_of(i)) for i, (k, img, lab) in enumerate(part)]
        write_records(folder / f"train-{n:05d}-of-00002", examples)
    # A third file cut short inside its second record: the first record kept, the rest named as damaged.
    whole = (folder / "train-00000-of-00002").read_bytes()
    first = 12 + int.from_bytes(whole[:8], "little") + 4
    (folder / "train-cut").write_bytes(whole[: first + 100])
    bucket = s3_env.new_bucket()
    s3_env.fs().put(f"{folder}/", f"{bucket}/tfr/", recursive=True)
    local = convert(TFRecordSource(str(folder / "train-*")), tmp_path / "local", format="lmdb", progress=False)
    remote = convert(TFRecordSource(f"s3://{bucket}/tfr/train-*"), tmp_path / "out", format="lmdb", progress=False)
    assert remote.manifest.num_samples == local.manifest.num_samples == len(expected) + 1
    assert sample_digests(tmp_path / "out") == sample_digests(tmp_path / "local")
    errors = (tmp_path / "out" / "errors.jsonl").read_text()
    assert f"s3://{bucket}/tfr/train-cut:1" in errors and "runs past the end of the file" in errors


def test_coco_in_s3_converts_as_the_same_files_on_disk(coco_mini, tmp_path, s3_env):
    """The instances JSON streamed through ranged reads, image sizes from one listing, each image by one request."""
    from converters.sources import CocoSource

    from loader_helpers import sample_digests

    bucket = s3_env.new_bucket()
    s3_env.fs().put(f"{coco_mini}/", f"{bucket}/coco/", recursive=True)
    local = convert(
        CocoSource(coco_mini / "images", coco_mini / "instances.json"),
        tmp_path / "local",
        format="lmdb",
        progress=False,
    )
    remote = convert(
        CocoSource(f"s3://{bucket}/coco/images", f"s3://{bucket}/coco/instances.json"),
        tmp_path / "out",
        format="lmdb",
        progress=False,
    )
    assert remote.manifest.num_samples == local.manifest.num_samples == 61
    assert remote.manifest.classes == local.manifest.classes
    assert sample_digests(tmp_path / "out") == sample_digests(tmp_path / "local")
    # A JSON naming an image the bucket does not hold: that image is named in errors.jsonl, the rest kept.
    s3_env.fs().rm(f"{bucket}/coco/images/{sorted(p.name for p in (coco_mini / 'images').iterdir())[0]}")
    partial = convert(
        CocoSource(f"s3://{bucket}/coco/images", f"s3://{bucket}/coco/instances.json"),
        tmp_path / "partial",
        format="lmdb",
        progress=False,
    )
    assert partial.manifest.num_samples == 60 and len(partial.errors) == 1
