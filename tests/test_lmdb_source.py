"""``convert lmdb``: a plain LMDB of encoded images written with the ``lmdb`` package; pickles refused unread."""

from __future__ import annotations

import pickle
from pathlib import Path

import lmdb
import pytest
from packed_helpers import assert_converted, assert_killed_conversion_resumes, error_inputs, photos

from converters.base import ConversionError
from converters.runner import convert
from converters.sources import LmdbSource
from converters.synth import make_imagefolder
from dali_pipes.dataset.manifest import load_manifest

from test_convert import run_cli


def write_lmdb(path: Path, values: dict[bytes, bytes]) -> Path:
    env = lmdb.open(str(path), map_size=1 << 28)
    with env.begin(write=True) as txn:
        for key, value in values.items():
            txn.put(key, value)
    env.close()
    return path


def test_keys_in_byte_order_convert_byte_for_byte(imagenet_mini, tmp_path):
    expected = photos(imagenet_mini)
    db = write_lmdb(tmp_path / "db", {key.encode(): image for key, image, _ in reversed(expected)})
    out = tmp_path / "out"
    run_cli("convert", "lmdb", db, out, "--format", "tfrecord", "--samples-per-shard", "20", "--no-progress")
    manifest = load_manifest(out)
    assert "label" not in manifest.fields and [s.num_samples for s in manifest.shards] == [20, 20, 7]
    from dali_pipes import open_store

    store = open_store(out)
    by_key = sorted(expected)
    assert [store[i]["key"].decode() for i in range(len(store))] == [k for k, _, _ in by_key]
    assert all(store[i]["image"] == by_key[i][1] for i in range(len(store)))


def test_key_list_gives_order_labels_and_bad_members(imagenet_mini, tmp_path):
    expected = photos(imagenet_mini)[:8]
    values = {key.encode(): image for key, image, _ in expected}
    values[b"pickled"] = pickle.dumps((expected[0][1], 3))
    values[b"truncated"] = expected[1][1][: len(expected[1][1]) // 2]
    db = write_lmdb(tmp_path / "db", values)
    keys = tmp_path / "keys.txt"
    chosen = expected[::-1][:6]
    lines = [f"{k} {lab}" for k, _, lab in chosen[:3]] + ["pickled 1", "missing 2", "truncated 4"]
    keys.write_text("\n".join(lines + [f"{k} {lab}" for k, _, lab in chosen[3:]]) + "\n")
    out = tmp_path / "out"
    convert(LmdbSource(db, keys_file=keys), out, format="hdf5", workers=1, progress=False)
    assert_converted(out, chosen)
    errors = error_inputs(out)
    assert set(errors) == {f"{db}:pickled", f"{db}:missing", f"{db}:truncated"}
    assert "pickle" in errors[f"{db}:pickled"] and "never unpickles" in errors[f"{db}:pickled"]
    assert "no such key" in errors[f"{db}:missing"]


def test_an_lmdb_of_pickles_is_refused_before_anything_is_written(imagenet_mini, tmp_path):
    image = photos(imagenet_mini)[0][1]
    db = write_lmdb(tmp_path / "db", {f"{i:04d}".encode(): pickle.dumps((image, i)) for i in range(20)})
    with pytest.raises(ConversionError, match="none of the first 8 values is an encoded image.*pickle"):
        convert(LmdbSource(db), tmp_path / "out", format="lmdb", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(300)
def test_killed_conversion_resumes_to_identical_output(tmp_path):
    images = make_imagefolder(tmp_path / "images", 160, size=(96, 64), classes=4, seed=7)
    files = sorted(p for p in images.glob("*/*") if p.is_file())
    db = write_lmdb(tmp_path / "db", {f.name.encode(): f.read_bytes() for f in files})
    options = ("--format", "hdf5", "--samples-per-shard", "10", "--no-progress")
    assert_killed_conversion_resumes("lmdb", db, tmp_path, *options, shards=16)
