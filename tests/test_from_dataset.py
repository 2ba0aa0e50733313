"""``dali_pipes.convert.from_dataset``: a map-style dataset converted in worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from packed_helpers import CountedPickles, PhotoDataset, assert_converted, error_inputs, photos
from test_resume import _records

from converters.base import ConversionError
from converters.synth import make_imagefolder
from dali_pipes.convert import Field, from_dataset
from dali_pipes.dataset.manifest import load_manifest

from test_convert import shard_digests


def dataset_rows(imagenet_mini, tmp_path):
    """The photos as files of their own (a truncated copy of photo 5), and the dataset rows naming them."""
    expected = photos(imagenet_mini)
    rows = []
    for i, (key, image, label) in enumerate(expected):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(image[: len(image) // 2] if i == 5 else image)
        rows.append((key, str(path), label))
    return rows, expected


def convert_photos(dataset, out: Path, fmt: str, samples_per_shard: int):
    """``dataset`` (rows of :func:`dataset_rows`: image, label, key) converted by two worker processes."""
    fields = ["image", "label", "key"]
    return from_dataset(
        dataset, out, fields=fields, format=fmt, workers=2, samples_per_shard=samples_per_shard, progress=False
    )


def test_dataset_converts_byte_for_byte_in_workers(imagenet_mini, tmp_path):
    rows, expected = dataset_rows(imagenet_mini, tmp_path)
    dataset = PhotoDataset(rows, fail_at=3)
    result = convert_photos(dataset, tmp_path / "out", "tfrecord", samples_per_shard=10)
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


_CONVERT = """
import json, sys
sys.path.insert(0, {tests!r})
from packed_helpers import PhotoDataset
from dali_pipes.convert import from_dataset
rows = [tuple(r) for r in json.loads(open({rows!r}).read())]
from_dataset(PhotoDataset(rows), {out!r}, fields=["image", "label", "key"], format="lmdb", workers={workers},
             samples_per_shard=10, progress=False)
"""


def _start(rows_file, out, workers: int) -> subprocess.Popen:
    script = _CONVERT.format(tests=str(Path(__file__).parent), rows=str(rows_file), out=str(out), workers=workers)
    return subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stderr=subprocess.DEVNULL)


@pytest.mark.timeout(300)
def test_killed_conversion_resumes_to_identical_output(tmp_path):
    images = make_imagefolder(tmp_path / "images", 160, size=(96, 64), classes=4, seed=9)
    files = sorted(p for p in images.glob("*/*") if p.is_file())
    rows_file = tmp_path / "rows.json"
    rows_file.write_text(json.dumps([(f.name, str(f), i % 4) for i, f in enumerate(files)]))
    assert _start(rows_file, tmp_path / "reference", 2).wait(timeout=240) == 0

    out = tmp_path / "killed"
    proc = _start(rows_file, out, 2)
    deadline = time.monotonic() + 120
    try:
        while _records(out) < 3:
            assert proc.poll() is None, "the conversion finished before it could be killed"
            assert time.monotonic() < deadline, "the conversion made no progress"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 3 <= _records(out) < 16 and not (out / "index.json").exists()
    assert _start(rows_file, out, 1).wait(timeout=240) == 0
    assert shard_digests(out) == shard_digests(tmp_path / "reference")
    assert (out / "index.json").read_bytes() == (tmp_path / "reference" / "index.json").read_bytes()


def test_image_and_text_fields_take_only_what_they_can_hold(photo_bytes, tmp_path):
    photo = photo_bytes[0]
    # A 1-D uint8 array (torchvision.io.read_file's result) is encoded bytes and is checked as an image;
    # pixels in an image field, or a number in a text field, are bad samples rather than stored unchecked.
    good = np.frombuffer(photo, np.uint8)
    broken = np.frombuffer(photo[: len(photo) // 2], np.uint8)
    pixels = np.zeros((4, 4, 3), np.uint8)
    rows = [(good, "a"), (broken, "b"), (pixels, "c"), (photo, 7), (photo, "e")]
    fields = {"image": Field.image(), "key": Field.text()}
    result = from_dataset(rows, tmp_path / "out", fields=fields, format="hdf5", workers=1, progress=False)
    from dali_pipes import open_store

    store = open_store(tmp_path / "out")
    assert [store[i]["key"] for i in range(len(store))] == [b"a", b"e"]
    assert store[0]["image"] == photo
    errors = error_inputs(tmp_path / "out")
    assert set(errors) == {"sample 1", "sample 2", "sample 3"} and len(result.errors) == 3
    assert "truncated" in errors["sample 1"].lower()
    assert "Field.array('uint8'" in errors["sample 2"]
    assert "text field" in errors["sample 3"] and "int" in errors["sample 3"]


def test_the_dataset_is_sent_once_per_worker_not_once_per_shard(imagenet_mini, tmp_path):
    # A large dataset pickled into every shard task cost its whole size per task (101 MB for 1.28M rows).
    rows, expected = dataset_rows(imagenet_mini, tmp_path)
    rows, expected = rows[:12], expected[:12]
    rows[5] = (rows[5][0], rows[4][1], expected[4][2])  # photo 5 is a truncated copy in dataset_rows
    expected[5] = (rows[5][0], expected[4][1], expected[4][2])
    CountedPickles.pickled = 0
    convert_photos(CountedPickles(rows), tmp_path / "out", "lmdb", samples_per_shard=2)
    assert len(load_manifest(tmp_path / "out").shards) == 6
    assert CountedPickles.pickled <= 2  # once per worker process
    assert_converted(tmp_path / "out", expected)
