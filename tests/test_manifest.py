"""The manifest parser accepts what writers write and refuses malformed, future or unsafe manifests."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dali_pipes import Manifest, ManifestError
from dali_pipes.dataset.manifest import Field, Shard, load_manifest, parse_manifest, write_manifest

SHA = "ab" * 32


def _manifest(**overrides) -> Manifest:
    values = dict(
        format="lmdb",
        fields={"image": Field.image(), "label": Field.array("int64", ()), "boxes": Field.array("float32", (-1, 4))},
        shards=(
            Shard("shard-00000.lmdb", 3, 100, SHA),
            Shard("shard-00001.lmdb", 0, 10, SHA),
            Shard("shard-00002.lmdb", 2, 50, SHA),
        ),
        source={"kind": "imagefolder", "root": "train"},
        classes=("cat", "dog"),
    )
    values.update(overrides)
    return Manifest(**values)


def test_round_trip_through_disk(tmp_path):
    manifest = _manifest()
    write_manifest(tmp_path, manifest)
    loaded = load_manifest(tmp_path)
    assert loaded.to_json() == manifest.to_json()
    assert loaded.fields["boxes"].variable_length and not loaded.fields["label"].variable_length
    assert loaded.fields["image"].is_image
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file of the atomic write was left behind"


def test_locate_walks_cumulative_counts_and_skips_empty_shards():
    manifest = _manifest()
    assert manifest.num_samples == 5
    assert [manifest.locate(i) for i in range(5)] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]
    with pytest.raises(IndexError, match="out of range"):
        manifest.locate(5)
    with pytest.raises(IndexError):
        manifest.locate(-1)


def _data(**changes):
    data = _manifest().to_json()
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kind": "other"}, "not a dali-pipes manifest"),
        ({"version": 99}, "newer than this dali-pipes reads"),
        ({"version": "1"}, "version must be an integer"),
        ({"format": "zip"}, "unknown format"),
        ({"num_samples": 6}, "inconsistent"),
        ({"num_samples": -5}, "num_samples is -5; expected a non-negative integer"),
        ({"num_samples": True}, "num_samples is True"),
        ({"num_samples": 5.0}, "num_samples is 5.0"),
        ({"fields": {}}, "non-empty"),
        ({"fields": {"x": {"kind": "array", "dtype": "float32", "shape": [3, -1]}}}, "only the first dimension"),
        ({"fields": {"x": {"kind": "array", "dtype": "nonsense", "shape": []}}}, "unknown dtype"),
        ({"fields": {"x": {"kind": "array", "dtype": "object", "shape": []}}}, "object"),
        ({"fields": {"x": {"kind": "pickle"}}}, "unknown kind"),
        ({"classes": [1, 2]}, "classes"),
        ({"shards": []}, "non-empty list"),
    ],
)
def test_malformed_manifests_are_refused_with_a_reason(changes, message):
    with pytest.raises(ManifestError, match=message):
        parse_manifest(_data(**changes))


def test_negative_and_missing_shard_counts_are_refused():
    data = _data()
    data["shards"][0]["num_samples"] = -3
    data["num_samples"] = sum(s["num_samples"] for s in data["shards"])
    with pytest.raises(ManifestError, match="non-negative"):
        parse_manifest(data)
    data = _data()
    del data["shards"][1]["sha256"]
    with pytest.raises(ManifestError, match="sha256"):
        parse_manifest(data)


def test_not_json_and_missing_manifest_name_the_file(tmp_path):
    with pytest.raises(ManifestError, match="no index.json"):
        load_manifest(tmp_path)
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("bad_path", ["../elsewhere.lmdb", "/etc/passwd", "sub/../../x.lmdb"])
def test_shard_paths_leaving_the_folder_are_refused(tmp_path, bad_path):
    data = _data()
    data["shards"][0]["path"] = bad_path
    (tmp_path / "index.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="leaves the dataset folder"):
        load_manifest(tmp_path)


def test_symlink_out_of_the_folder_is_refused(tmp_path):
    dataset = tmp_path / "ds"
    dataset.mkdir()
    outside = tmp_path / "outside.lmdb"
    outside.write_bytes(b"x")
    os.symlink(outside, dataset / "shard-00000.lmdb")
    write_manifest(dataset, _manifest())
    with pytest.raises(ManifestError, match="outside the dataset folder"):
        load_manifest(dataset)


def _one_shard(**shard) -> dict:
    """A valid manifest's JSON with one shard of one sample; ``shard`` overrides that shard's entries."""
    data = _manifest(shards=(Shard("shard-00000.lmdb", 1, 100, SHA),)).to_json()
    data["shards"][0].update(shard)
    return data


@pytest.mark.parametrize(
    "dtype", ["i4,i4", "[('a','i4')]", "(2,)i4", "O", "object", "S5", "U3", "V8", "M8[s]", "m8", 5, None, ["i4"]]
)
def test_structured_object_string_and_time_dtypes_are_refused_naming_the_field(dtype):
    data = _data(fields={"feat": {"kind": "array", "dtype": dtype, "shape": [3]}})
    with pytest.raises(ManifestError, match=r"field 'feat'.*dtype"):
        parse_manifest(data)


@pytest.mark.parametrize(
    "dtype", ["bool", "uint8", "int16", "uint64", "float16", "float32", "float64", "complex64", "<i4"]
)
def test_plain_numeric_dtypes_are_accepted(dtype):
    manifest = parse_manifest(_data(fields={"feat": {"kind": "array", "dtype": dtype, "shape": [-1, 2]}}))
    assert manifest.fields["feat"].dtype == np.dtype(dtype).name


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([-2], "only the first dimension may be -1"),
        ([3, -1], "only the first dimension may be -1"),
        ([0], "holds no values"),
        ([-1, 0], "holds no values"),
        ([2**62, 2**62], "too large"),
        ([True], "list of integers"),
        ([1.0], "list of integers"),
        ("3", "list of integers"),
        ([1] * 33, "at most 32"),
    ],
)
def test_bad_shapes_are_refused_naming_the_field(shape, message):
    data = _data(fields={"feat": {"kind": "array", "dtype": "float32", "shape": shape}})
    with pytest.raises(ManifestError, match=rf"field 'feat'.*{message}"):
        parse_manifest(data)


@pytest.mark.parametrize("count", [2**63, 2**64, True, False, 1.0, "1", None, -1])
def test_shard_counts_must_be_integers_below_2_63_naming_the_shard(count):
    data = _one_shard(num_samples=count)
    data["num_samples"] = count
    with pytest.raises(ManifestError, match=r"shard 0 \(shard-00000\.lmdb\) has num_samples"):
        parse_manifest(data)
    with pytest.raises(ManifestError, match=r"shard 0 \(shard-00000\.lmdb\) has bytes"):
        parse_manifest(_one_shard(bytes=count))


def test_true_is_not_a_count_even_where_it_equals_one():
    data = _one_shard()
    assert data["num_samples"] == 1
    data["num_samples"] = True  # True == 1 in Python
    with pytest.raises(ManifestError, match="num_samples is True"):
        parse_manifest(data)


def test_counts_that_add_up_past_2_63_are_refused():
    data = _data()
    for shard in data["shards"]:
        shard["num_samples"] = 2**62
    data["num_samples"] = 3 * 2**62
    with pytest.raises(ManifestError, match="num_samples"):
        parse_manifest(data)


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ({"sha256": "AB" * 32}, "sha256"),
        ({"sha256": "zz" * 32}, "sha256"),
        ({"path": "a\0b"}, "no valid path"),
        ({"path": ""}, "no valid path"),
        ({"index_path": "shard-00000.lmdb.idx"}, "both index_path and index_sha256"),
        ({"index_sha256": SHA}, "both index_path and index_sha256"),
        ({"index_path": "x.idx", "index_sha256": "nope"}, "index_sha256"),
        ({"index_path": "shard-00000.lmdb", "index_sha256": SHA}, "same path"),
    ],
)
def test_bad_shard_entries_are_refused_naming_the_shard(shard, message):
    with pytest.raises(ManifestError, match=message):
        parse_manifest(_one_shard(**shard))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"source": ["train"]}, "'source' must be an object"),
        ({"extra": 3}, "'extra' must be an object"),
        ({"created_by": ["me"]}, "'created_by' must be a string"),
        ({"fields": {"..": {"kind": "bytes", "encoding": "raw"}}}, "field name '..'"),
        ({"fields": {"a\0": {"kind": "bytes", "encoding": "raw"}}}, "field name"),
        ({"fields": {"x": {"kind": "bytes", "encoding": ["image"]}}}, "unknown encoding"),
    ],
)
def test_other_malformed_entries_are_refused(changes, message):
    with pytest.raises(ManifestError, match=message):
        parse_manifest(_data(**changes))


def test_a_shard_path_naming_the_folder_itself_is_refused(tmp_path):
    data = _one_shard(path=".")
    (tmp_path / "index.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="names the dataset folder itself"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "tfrecord"])
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"x": Field.array("float32", (1,) * 33)}, "33 dimensions"),
        ({"a\0b": Field.image()}, "not allowed"),
        ({"..": Field.image()}, "not allowed"),
        ({"x": Field.array("float32", (0, 3))}, "holds no values"),
    ],
)
def test_writers_refuse_before_writing_what_the_manifest_would_refuse_after(tmp_path, fmt, fields, message):
    from converters.writers import writer_class

    with pytest.raises(ValueError, match=message):
        writer_class(fmt)(tmp_path / "shard", fields)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_without_manifest_says_why_and_what_to_do(tmp_path):
    with pytest.raises(
        ManifestError,
        match="no such folder, so no index.json; give the folder of a dataset written by 'dali-pipes convert'",
    ):
        load_manifest(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ManifestError, match="not a folder"):
        load_manifest(tmp_path / "file")
    foreign = tmp_path / "foreign"
    (foreign / "n01440764").mkdir(parents=True)
    with pytest.raises(
        ManifestError, match=r"not a dataset written by 'dali-pipes convert'.*dali-pipes convert \{image"
    ):
        load_manifest(foreign)
    unfinished = tmp_path / "unfinished"
    (unfinished / ".dali-pipes-job").mkdir(parents=True)
    with pytest.raises(ManifestError, match="did not finish; run the same 'dali-pipes convert' command again"):
        load_manifest(unfinished)


def test_missing_manifest_names_the_convert_command_for_a_foreign_dataset(tmp_path):
    # A folder of WebDataset tars, TFRecords, Parquet files or an LMDB is a dataset from elsewhere:
    # the message names the converter that fits, not only the image-folder ones.
    import tarfile

    import lmdb

    tars = tmp_path / "wds"
    tars.mkdir()
    with tarfile.open(tars / "train-000000.tar", "w") as tar:
        tar.addfile(tarfile.TarInfo("empty.cls"))
    env = lmdb.open(str(tmp_path / "imgs.lmdb"))
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    records = tmp_path / "tfr"
    records.mkdir()
    (records / "train-00000-of-00002").write_bytes(b"")
    for folder, command in [
        (tars, f"dali-pipes convert webdataset '{tars}/*.tar' OUT"),
        (tmp_path / "imgs.lmdb", f"dali-pipes convert lmdb {tmp_path / 'imgs.lmdb'} OUT"),
        (records, f"dali-pipes convert tfrecord '{records}/*-of-*' OUT"),
    ]:
        with pytest.raises(ManifestError, match="no index.json") as info:
            load_manifest(folder)
        assert command in str(info.value)
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"label": [1]}), tmp_path / "tfr" / "x.parquet")
    with pytest.raises(ManifestError, match="no index.json") as info:
        load_manifest(records)
    assert "convert tfrecord" in str(info.value) and f"convert parquet '{records}/*.parquet' OUT" in str(info.value)
