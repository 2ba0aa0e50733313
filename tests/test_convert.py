"""End-to-end conversion: real photos to every format, read back byte for byte, via the API and the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from converters.base import ConversionError, SampleError
from converters.runner import convert
from converters.sources import CocoSource, ImageFolderSource
from dali_pipes import open_store
from dali_pipes.cli.verify import verify_dataset
from dali_pipes.dataset.manifest import FORMATS, load_manifest

CLI = [sys.executable, "-m", "dali_pipes"]  # the CLI wherever the package imports, no script needed


def run_cli(*args, check=True):
    proc = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"dali-pipes {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def shard_digests(out: Path) -> dict[str, str]:
    manifest = load_manifest(out)
    return {s.path: s.sha256 for s in manifest.shards} | {
        s.index_path: s.index_sha256 for s in manifest.shards if s.index_path
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_imagefolder_reads_back_byte_for_byte(imagenet_mini, tmp_path, fmt):
    out = tmp_path / "out"
    result = convert(ImageFolderSource(imagenet_mini), out, format=fmt, samples_per_shard=10, workers=2, progress=False)
    assert len(result.manifest.shards) == 5 and result.errors == []
    store = open_store(out)
    classes = sorted(p.name for p in imagenet_mini.iterdir() if p.is_dir())
    assert list(store.manifest.classes) == classes
    files = sorted(p for p in imagenet_mini.glob("*/*") if p.is_file())
    assert len(store) == len(files) == 47
    seen = set()
    for i in range(len(store)):
        sample = store[i]
        key = sample["key"].decode()
        seen.add(key)
        assert sample["image"] == (imagenet_mini / key).read_bytes(), f"sample {i} ({key}) differs from its file"
        assert sample["label"].dtype == np.int64 and sample["label"].shape == ()
        assert classes[int(sample["label"])] == key.split("/")[0]
    assert seen == {str(f.relative_to(imagenet_mini)) for f in files}
    assert verify_dataset(out, decode=True, progress=False).ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_coco_reads_back_boxes_and_categories(coco_mini, tmp_path, fmt):
    out = tmp_path / "out"
    convert(CocoSource(coco_mini / "images", coco_mini / "instances.json"), out, format=fmt, workers=1, progress=False)
    store = open_store(out)
    coco = json.loads((coco_mini / "instances.json").read_text())
    by_image = {img["id"]: [] for img in coco["images"]}
    for ann in coco["annotations"]:
        by_image[ann["image_id"]].append(ann)
    files = {img["id"]: img["file_name"] for img in coco["images"]}
    assert len(store) == len(coco["images"]) == 61
    categories = sorted(coco["categories"], key=lambda c: c["id"])
    assert list(store.manifest.classes) == [c["name"] for c in categories]
    pngs = 0
    for i in range(len(store)):
        sample = store[i]
        image_id = int(sample["image_id"])
        anns = by_image[image_id]
        assert sample["key"].decode() == files[image_id]
        assert sample["image"] == (coco_mini / "images" / files[image_id]).read_bytes()
        pngs += sample["image"][:4] == b"\x89PNG"
        assert sample["boxes"].dtype == np.float32 and sample["boxes"].shape == (len(anns), 4)
        np.testing.assert_array_equal(sample["boxes"], np.array([a["bbox"] for a in anns], np.float32).reshape(-1, 4))
        assert sample["category_id"].tolist() == [a["category_id"] for a in anns]
        assert sample["iscrowd"].tolist() == [a.get("iscrowd", 0) for a in anns]
    assert pngs == 3


def test_output_is_the_same_bytes_whatever_the_worker_count(imagenet_mini, tmp_path):
    options = dict(format="hdf5", samples_per_shard=7, progress=False)
    one = convert(ImageFolderSource(imagenet_mini), tmp_path / "one", workers=1, **options)
    convert(ImageFolderSource(imagenet_mini), tmp_path / "two", workers=2, **options)
    assert len(one.manifest.shards) == 7
    assert shard_digests(tmp_path / "one") == shard_digests(tmp_path / "two")
    assert (tmp_path / "one" / "index.json").read_bytes() == (tmp_path / "two" / "index.json").read_bytes()


def _bad_image_folder(imagenet_mini: Path, root: Path) -> dict[str, str]:
    """A copy of two classes plus broken files; returns the broken names."""
    for cls in sorted(p for p in imagenet_mini.iterdir() if p.is_dir())[:2]:
        shutil.copytree(cls, root / cls.name)
    first = sorted((root).iterdir())[0]
    good = sorted(first.iterdir())[0].read_bytes()
    (first / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (first / "empty.jpg").write_bytes(b"")
    (first / "notes.jpg").write_text("this is not an image\n")
    return {f"{first.name}/{n}" for n in ("truncated.jpg", "empty.jpg", "notes.jpg")}


def test_bad_inputs_are_skipped_and_listed(imagenet_mini, tmp_path):
    root = tmp_path / "in"
    broken = _bad_image_folder(imagenet_mini, root)
    out = tmp_path / "out"
    proc = run_cli("convert", "imagefolder", root, out, "--format", "tfrecord", "--workers", "2", "--no-progress")
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert {Path(e["input"]).as_posix().split(str(root.as_posix()) + "/")[-1] for e in errors} == broken
    assert all(e["reason"] for e in errors)
    assert "left out 3 input(s)" in proc.stdout
    store = open_store(out)
    good = sum(1 for p in root.glob("*/*") if p.is_file()) - 3
    assert len(store) == good
    assert run_cli("verify", out, "--decode").returncode == 0


def test_on_error_fail_names_the_input_and_leaves_nothing(imagenet_mini, tmp_path):
    root = tmp_path / "in"
    _bad_image_folder(imagenet_mini, root)
    out = tmp_path / "out"
    proc = run_cli(
        "convert",
        "imagefolder",
        root,
        out,
        "--on-error",
        "fail",
        "--workers",
        "2",
        "--samples-per-shard",
        "2",
        check=False,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert any(name in proc.stderr for name in ("truncated.jpg", "empty.jpg", "notes.jpg")), proc.stderr
    assert not out.exists(), f"half-written output left behind: {list(out.iterdir())}"
    with pytest.raises(SampleError):
        convert(ImageFolderSource(root), out, format="lmdb", on_error="fail", workers=1, progress=False)
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["convert", "imagefolder", "{tmp}/missing", "{tmp}/out"], "missing"),
        (["convert", "imagefolder", "{tmp}/empty", "{tmp}/out"], "empty"),
        (["convert", "imagefolder", "{imagenet}", "{tmp}/occupied"], "not empty"),
        (["convert", "imagefolder", "{imagenet}", "{tmp}/out", "--format", "zip"], "unknown format"),
        (["convert", "imagefolder", "{imagenet}", "{tmp}/out", "--shard-size", "lots"], "size"),
        (["inspect", "{tmp}/empty"], "no index.json"),
        (["verify", "{tmp}/empty"], "no index.json"),
    ],
)
def test_user_errors_are_one_line_without_traceback(imagenet_mini, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("keep me")
    args = [a.format(tmp=tmp_path, imagenet=imagenet_mini) for a in args]
    proc = run_cli(*args, check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("dali-pipes: error:")]
    assert len(error_lines) == 1 and message in error_lines[0].lower(), proc.stderr
    assert (tmp_path / "occupied" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "out").exists()


def test_rerun_of_a_finished_job_is_a_no_op_and_another_job_is_refused(imagenet_mini, coco_mini, tmp_path):
    out = tmp_path / "out"
    run_cli("convert", "imagefolder", imagenet_mini, out, "--no-progress")
    before = shard_digests(out)
    proc = run_cli("convert", "imagefolder", imagenet_mini, out, "--no-progress")
    assert "already complete" in proc.stdout and shard_digests(out) == before
    proc = run_cli("convert", "imagefolder", imagenet_mini, out, "--format", "hdf5", check=False)
    assert proc.returncode != 0 and "different dataset" in proc.stderr
    with pytest.raises(ConversionError, match="different dataset"):
        convert(CocoSource(coco_mini / "images", coco_mini / "instances.json"), out, format="lmdb", progress=False)


def test_inspect_and_verify_cli(imagenet_mini, tmp_path):
    out = tmp_path / "out"
    run_cli(
        "convert",
        "imagefolder",
        imagenet_mini,
        out,
        "--format",
        "tfrecord",
        "--samples-per-shard",
        "20",
        "--no-progress",
    )
    summary = json.loads(run_cli("inspect", out, "--json").stdout)
    assert summary["num_samples"] == 47 and summary["num_shards"] == 3 and summary["format"] == "tfrecord"
    assert summary["fields"]["image"] == {"kind": "bytes", "encoding": "image"}
    assert summary["classes"] == sorted(p.name for p in imagenet_mini.iterdir() if p.is_dir())
    text = run_cli("inspect", out).stdout
    assert "47 in 3 shard(s)" in text and "shard-00000.tfrecord.idx" in text
    assert (
        "3 shard(s), 47 samples read, 47 images decoded" in run_cli("verify", out, "--decode", "--no-progress").stdout
    )


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "swap_index"])
def test_verify_names_a_damaged_shard(imagenet_mini, tmp_path, damage):
    out = tmp_path / "out"
    convert(ImageFolderSource(imagenet_mini), out, format="tfrecord", samples_per_shard=20, workers=1, progress=False)
    victim = out / "shard-00001.tfrecord"
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "delete":
        victim.unlink()
    else:
        shutil.copyfile(out / "shard-00000.tfrecord.idx", out / "shard-00001.tfrecord.idx")
    proc = run_cli("verify", out, "--no-progress", check=False)
    assert proc.returncode == 1
    assert "shard-00001.tfrecord" in proc.stderr
    assert "shard-00000" not in proc.stderr and "shard-00002" not in proc.stderr
