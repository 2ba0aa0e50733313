"""HDF5 merge: physical and virtual files read back sample for sample, by h5py and by open_store;
a full disk while merging is a one-line error that leaves nothing behind."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from converters.base import ConversionError
from converters.merge import merge_hdf5
from dali_pipes.dataset.manifest import Field
from dali_pipes.stores import StoreError, open_store

from test_convert import CLI, run_cli  # noqa: E402 - shared helpers

#: ``python -c LIMITED BYTES COMMAND...`` runs COMMAND under a file-size limit with SIGXFSZ ignored, so
#: that a write past it fails with EFBIG as on a full disk (as in test_disk_full.py).
LIMITED = (
    "import os, resource, signal, sys\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)

FIELDS = {
    "image": Field.image(),
    "key": Field.text(),
    "label": Field.array("int64", ()),
    "boxes": Field.array("float32", (-1, 4)),
    "feat": Field.array("float16", (4, 640)),
}


@pytest.fixture(scope="module")
def samples(photo_bytes) -> list[dict]:
    rng = np.random.default_rng(7)
    return [
        {
            "image": photo,
            "key": f"img-{i}".encode(),
            "label": np.array(i * 3 - 5, np.int64),
            "boxes": rng.random((i % 3, 4)).astype(np.float32),  # samples 0, 3, 6, 9 have none
            "feat": rng.standard_normal((4, 640)).astype(np.float16),
        }
        for i, photo in enumerate(photo_bytes)
    ]


@pytest.fixture
def dataset(tmp_path, samples, write_dataset) -> Path:
    """An HDF5 dataset of 3 shards (4 + 4 + 3 samples) in ``tmp_path/data/ds``."""
    return write_dataset(tmp_path / "data" / "ds", "hdf5", FIELDS, samples, per_shard=4, classes=["a", "b"])


def check_plain_h5py(path: Path, samples: list[dict]) -> None:
    """Read the merged file as a user would, with h5py and the documented layout."""
    with h5py.File(path, "r") as f:
        assert f.attrs["num_samples"] == len(samples)
        image, image_offsets = f["image/data"], f["image/offsets"][()]
        boxes, box_offsets = f["boxes/data"], f["boxes/offsets"][()]
        for i, want in enumerate(samples):
            assert image[image_offsets[i] : image_offsets[i + 1]].tobytes() == want["image"], f"image {i}"
            assert np.array_equal(boxes[box_offsets[i] : box_offsets[i + 1]], want["boxes"]), f"boxes {i}"
            assert f["label"][i] == want["label"]
            assert f["feat"][i].tobytes() == want["feat"].tobytes()


def check_store(path: Path, samples: list[dict]) -> None:
    store = open_store(path)
    assert len(store) == len(samples) and store.manifest.classes == ("a", "b")
    for i, want in enumerate(samples):
        got = store[i]
        for name, value in want.items():
            if isinstance(value, bytes):
                assert got[name] == value, f"{name} {i}"
            else:
                assert got[name].dtype == value.dtype and got[name].shape == value.shape
                assert got[name].tobytes() == value.tobytes(), f"{name} {i}"
    store.close()


def test_physical_merge_reads_back_sample_for_sample(dataset, samples, tmp_path):
    out = merge_hdf5(dataset, tmp_path / "merged.h5")
    assert out == tmp_path / "merged.h5"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
    with h5py.File(out, "r") as f:
        assert not f["image/data"].is_virtual and not f["label"].is_virtual
    check_plain_h5py(out, samples)
    check_store(out, samples)
    shutil.rmtree(dataset)  # a physical merge stands alone
    check_store(out, samples)


def test_virtual_merge_is_small_and_survives_moving_the_folder(dataset, samples, tmp_path, monkeypatch):
    out = merge_hdf5(dataset, dataset / "virtual.h5", virtual=True)
    shard_bytes = sum(p.stat().st_size for p in dataset.glob("shard-*.h5"))
    assert out.stat().st_size < shard_bytes / 10
    with h5py.File(out, "r") as f:
        assert f["image/data"].is_virtual and f["feat"].is_virtual
        assert {s.file_name for s in f["image/data"].virtual_sources()} == {f"shard-0000{i}.h5" for i in range(3)}
    check_plain_h5py(out, samples)
    check_store(out, samples)

    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    shutil.move(str(dataset), str(moved))
    monkeypatch.chdir(tmp_path / "elsewhere")  # neither the old folder nor the working folder helps
    check_plain_h5py(moved / "virtual.h5", samples)
    check_store(moved / "virtual.h5", samples)


def test_virtual_merge_outside_the_dataset_folder_uses_relative_paths(dataset, samples, tmp_path):
    out_dir = tmp_path / "data" / "merged"
    out_dir.mkdir()
    out = merge_hdf5(dataset, out_dir / "v.h5", virtual=True)
    with h5py.File(out, "r") as f:
        assert {s.file_name for s in f["label"].virtual_sources()} == {f"../ds/shard-0000{i}.h5" for i in range(3)}
    shutil.move(str(tmp_path / "data"), str(tmp_path / "data2"))
    check_store(tmp_path / "data2" / "merged" / "v.h5", samples)


def test_virtual_merge_with_a_missing_shard_is_a_store_error(dataset, tmp_path):
    out = merge_hdf5(dataset, tmp_path / "data" / "v.h5", virtual=True)
    (dataset / "shard-00001.h5").unlink()
    store = open_store(out)
    with pytest.raises(StoreError, match=r"shard-00001\.h5.*missing"):
        store[0]  # not the zeros HDF5 would read in place of the missing source


def test_merge_refuses_other_formats_and_existing_outputs(samples, tmp_path, write_dataset, dataset):
    lmdb_ds = write_dataset(tmp_path / "lmdb", "lmdb", FIELDS, samples, per_shard=6)
    with pytest.raises(ConversionError, match="lmdb dataset.*only HDF5"):
        merge_hdf5(lmdb_ds, tmp_path / "m.h5")
    (tmp_path / "m.h5").write_bytes(b"keep me")
    with pytest.raises(ConversionError, match="already exists"):
        merge_hdf5(dataset, tmp_path / "m.h5")
    assert (tmp_path / "m.h5").read_bytes() == b"keep me"


def test_open_store_refuses_an_h5_file_that_is_not_a_merge(dataset):
    from dali_pipes.dataset.manifest import ManifestError

    with pytest.raises(ManifestError, match="not a merged"):
        open_store(dataset / "shard-00000.h5")


@pytest.mark.parametrize(("virtual", "limit"), [(False, None), (True, 4096)])
def test_a_full_disk_while_merging_is_one_line_and_leaves_nothing(dataset, samples, tmp_path, virtual, limit):
    """The full disk is a real file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored): writes fail with EFBIG.

    Given a path, HDF5 meeting it printed a traceback from h5py's close (physical) or
    crashed with a segmentation fault (virtual); through the guarded file it is one line.
    A physical merge copies the photos: half their bytes is a limit it must hit.
    """
    if limit is None:
        limit = sum(len(s["image"]) for s in samples) // 2
    out = tmp_path / "merged.h5"
    args = ["merge", *(["--virtual"] if virtual else []), dataset, out]
    full = subprocess.run(
        [sys.executable, "-c", LIMITED, str(limit), *CLI, *map(str, args)], capture_output=True, text=True, timeout=120
    )
    assert full.returncode == 2, f"not a clean exit ({full.returncode}):\n{full.stderr}"
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line of error, got:\n{full.stderr}"
    kind = "virtual merge" if virtual else "merge"
    assert lines[0].startswith(f"dali-pipes: error: {out}: disk full while writing the {kind} of {dataset} ("), lines[0]
    assert "the file-size limit (ulimit -f) of " in lines[0] and f"free on {tmp_path});" in lines[0], lines[0]
    assert "run the same command again" in lines[0]
    # Neither the merged file nor its temporary is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]

    run_cli(*args)  # the limit gone, the same command succeeds
    assert out.stat().st_size > limit, "the merged file no longer exceeds the limit: the test proves nothing"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "merged.h5"]
    check_plain_h5py(out, samples)
    check_store(out, samples)
