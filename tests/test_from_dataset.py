"""``dali_pipes.convert.from_dataset``: a map-style dataset converted in worker processes."""

from __future__ import annotations

import numpy as np
import pytest
from packed_helpers import PhotoDataset, assert_converted, error_inputs, photos

from converters.base import ConversionError
from dali_pipes.convert import Field, from_dataset
from dali_pipes.manifest import load_manifest


def dataset_rows(imagenet_mini, tmp_path):
    """The photos as files of their own (a truncated copy of photo 5), and the dataset rows naming them."""
    expected = photos(imagenet_mini)
    rows = []
    for i, (key, image, label) in enumerate(expected):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(image[: len(image) // 2] if i == 5 else image)
        rows.append((key, str(path), label))
    return rows, expected


def test_dataset_converts_byte_for_byte_in_workers(imagenet_mini, tmp_path):
    rows, expected = dataset_rows(imagenet_mini, tmp_path)
    dataset = PhotoDataset(rows, fail_at=3)
    result = from_dataset(
        dataset,
        tmp_path / "out",
        fields=["image", "label", "key"],
        format="tfrecord",
        workers=2,
        samples_per_shard=10,
        progress=False,
    )
    good = [row for i, row in enumerate(expected) if i not in (3, 5)]
    assert_converted(tmp_path / "out", good)
    manifest = load_manifest(tmp_path / "out")
    assert manifest.fields["image"].is_image and manifest.fields["label"].dtype == "int64"
    assert list(manifest.classes) == dataset.classes and len(manifest.shards) == 5
    errors = error_inputs(tmp_path / "out")
    assert set(errors) == {"sample 3", "sample 5"} and len(result.errors) == 2
    assert "OSError: cannot fetch sample 3" in errors["sample 3"] and "truncated" in errors["sample 5"].lower()


def test_explicit_fields_and_array_samples(tmp_path):
    class Arrays:
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return np.full((2, 3), i, np.float32), np.arange(i % 4, dtype=np.int64)

    fields = {"x": Field.array("float32", (2, 3)), "ids": Field.array("int64", (-1,))}
    from_dataset(Arrays(), tmp_path / "out", fields=fields, format="hdf5", workers=1, progress=False)
    from dali_pipes import open_store

    store = open_store(tmp_path / "out")
    assert len(store) == 12 and float(store[7]["x"][1, 2]) == 7.0 and store[7]["ids"].tolist() == [0, 1, 2]


def test_a_dataset_without_len_or_of_unknown_values_is_refused(tmp_path):
    with pytest.raises(ConversionError, match="no len"):
        from_dataset(iter([1]), tmp_path / "a", fields=["x"])
    with pytest.raises(ConversionError, match="field 'x' is a object; give its Field"):
        from_dataset([(object(),)], tmp_path / "b", fields=["x"])
