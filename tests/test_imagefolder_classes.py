"""Labels that cannot shift: empty class folders, an output written inside its input, paths recorded absolute.

The case a new user hit: ``convert imagefolder cls cls/new`` wrote the output inside the input, and the next
conversion took ``new`` as a class, moving every label after it, with only "left out" lines as a hint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from converters.synth import make_imagefolder
from dali_pipes.bench.inputs import find_image_folder
from dali_pipes.dataset.manifest import load_manifest

from test_convert import CLI, run_cli


@pytest.fixture
def classes(tmp_path) -> Path:
    """Three classes of 4 images: cat, dog, object."""
    root = make_imagefolder(tmp_path / "cls", 12, size=(64, 48), classes=3)
    for old, new in zip(sorted(p.name for p in root.iterdir()), ["cat", "dog", "object"]):
        (root / old).rename(root / new)
    return root


def _convert(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "convert", "imagefolder", *map(str, args), "--workers", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_an_output_inside_the_input_is_refused_before_anything_is_written(classes):
    proc = _convert(classes, classes / "new")
    assert proc.returncode != 0
    assert "the output folder is inside the input folder" in proc.stderr and str(classes) in proc.stderr
    assert not (classes / "new").exists()  # so it can never become a class


def test_a_class_folder_without_files_is_refused_naming_it_unless_allowed(classes, tmp_path):
    (classes / "bird").mkdir()  # sorts before cat: it would take label 0 and shift all three
    proc = _convert(classes, tmp_path / "out")
    assert proc.returncode != 0
    assert f"{classes / 'bird'}: class folder 'bird' holds no files, yet it would take label 0" in proc.stderr
    assert "--allow-empty-classes" in proc.stderr

    allowed = _convert(classes, tmp_path / "out", "--allow-empty-classes")
    assert allowed.returncode == 0, allowed.stderr
    manifest = load_manifest(tmp_path / "out")
    assert list(manifest.classes) == ["bird", "cat", "dog", "object"] and manifest.num_samples == 12


def test_a_class_whose_files_are_all_left_out_is_refused_leaving_nothing_and_allowing_it_converts(classes, tmp_path):
    # Files, but not one image: found only once every shard is written. The refusal removes them (a job folder
    # left behind would be an "unfinished conversion" that the same command could never finish), and the same
    # command with --allow-empty-classes then converts the input.
    shutil.rmtree(classes / "dog")
    (classes / "dog").mkdir()
    (classes / "dog" / "readme.txt").write_text("not an image\n")
    out = tmp_path / "out"
    proc = _convert(classes, out)
    assert proc.returncode != 0
    assert "class folder 'dog' holds no image (every file in it was left out; " in proc.stderr
    assert not out.exists()

    allowed = _convert(classes, out, "--allow-empty-classes")
    assert allowed.returncode == 0, allowed.stderr
    manifest = load_manifest(out)
    assert list(manifest.classes) == ["cat", "dog", "object"] and manifest.num_samples == 8
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [Path(e["input"]).name for e in errors] == ["readme.txt"]


def test_paths_are_recorded_absolute_so_commands_find_the_source_from_any_folder(classes, tmp_path):
    # Converted from the input's parent with relative paths, then read from somewhere else entirely.
    proc = _convert("cls", "shards", cwd=classes.parent)
    assert proc.returncode == 0, proc.stderr
    dataset = classes.parent / "shards"
    manifest = load_manifest(dataset)
    assert manifest.source["root"] == str(classes) and os.path.isabs(manifest.source["root"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cwd = os.getcwd()
    os.chdir(elsewhere)
    try:
        assert find_image_folder(dataset, manifest, None) == (classes, None)
    finally:
        os.chdir(cwd)
    # And a relative list file too: the manifest names it absolute.
    (classes.parent / "train.txt").write_text("a cls/cat/" + sorted(os.listdir(classes / "cat"))[0] + " 0\n")
    run_cli("convert", "list", classes.parent / "train.txt", tmp_path / "from-list", "--workers", "1")
    assert os.path.isabs(load_manifest(tmp_path / "from-list").source["list_file"])
