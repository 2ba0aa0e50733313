"""The manifest parser accepts what writers write and refuses malformed, future or unsafe manifests."""

from __future__ import annotations

import json
import os

import pytest

from dali_pipes.manifest import (
    Field,
    Manifest,
    ManifestError,
    Shard,
    load_manifest,
    parse_manifest,
    write_manifest,
)

SHA = "ab" * 32


def _manifest(**overrides) -> Manifest:
    values = dict(
        format="lmdb",
        fields={"image": Field.image(), "label": Field.array("int64", ()), "boxes": Field.array("float32", (-1, 4))},
        shards=(Shard("shard-00000.lmdb", 3, 100, SHA), Shard("shard-00001.lmdb", 0, 10, SHA), Shard("shard-00002.lmdb", 2, 50, SHA)),
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
        ({"num_samples": -5}, "inconsistent"),
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
