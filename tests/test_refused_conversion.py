"""A refused conversion leaves nothing behind, and says every reason it was refused for.

The case reported: ``dali-pipes convert imagefolder onlybroken out`` (one class folder of broken files) was
refused ("class folder holds no image") after writing its shard, and left ``out/.dali-pipes-job/`` and
``shard-00000.lmdb``; ``dali-pipes inspect out`` then called it an unfinished conversion to resume, and the
same command was refused again, forever. With ``--allow-empty-classes`` the message gave three reasons "...
and 1 other reasons". Now nothing the refused job created stays (an output folder that existed before stays,
empty as it was), and the message gives every distinct reason with a count and an example. The broken files
are real: a JPEG and a PNG written by Pillow and cut short, a GIF by Pillow, an empty file, a text file.
"""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_resume import _kill_after_shards

from converters.base import NothingConverted
from converters.synth import make_imagefolder

from test_convert import CLI  # noqa: E402 - shared helper

#: The broken files' reasons as the conversion words them. The two JPEGs cut past their header lack different
#: byte counts, yet fail for one reason; the one cut inside its header, for another.
REASONS = {
    "cut-a.jpg": "truncated JPEG (image file is truncated (",
    "cut-b.jpg": "truncated JPEG (image file is truncated (",
    "cut-header.jpg": "unreadable image header",
    "cut.png": "starts like a PNG file but its header is unreadable",
    "empty.jpg": "empty file (0 bytes)",
    "notes.txt": "not an image file",
    "anim.gif": "a GIF file, not a format DALI's decoder reads",
}


def _encoded(fmt: str) -> bytes:
    pixels = np.random.default_rng(1).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def _write_broken(folder: Path) -> Path:
    folder.mkdir(parents=True)
    jpeg, png = _encoded("JPEG"), _encoded("PNG")
    (folder / "cut-a.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (folder / "cut-b.jpg").write_bytes(jpeg[: len(jpeg) * 4 // 5])
    (folder / "cut-header.jpg").write_bytes(jpeg[: len(jpeg) // 4])
    (folder / "cut.png").write_bytes(png[:30])
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "notes.txt").write_text("not an image\n")
    (folder / "anim.gif").write_bytes(_encoded("GIF"))
    return folder


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


def _convert(root: Path, out: Path, *extra) -> subprocess.CompletedProcess:
    return _cli("convert", "imagefolder", root, out, "--workers", "1", "--no-progress", *extra)


@pytest.mark.parametrize("allow", [False, True], ids=["refused", "allow-empty-classes"])
def test_a_folder_of_only_broken_images_leaves_nothing_and_names_every_reason(tmp_path, allow):
    root = tmp_path / "onlybroken"
    _write_broken(root / "cls")
    out = tmp_path / "out"
    proc = _convert(root, out, *(["--allow-empty-classes"] if allow else []))
    assert proc.returncode == 2, proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("dali-pipes: error:")]
    assert len(error) == 1 and "no input could be converted: all 7 inputs failed: " in error[0], proc.stderr
    # Every distinct reason once, with its count and an example; none summed up as "other reasons".
    assert "other reasons" not in error[0] and error[0].count(" x ") == 6
    assert "2 x truncated JPEG (image file is truncated (" in error[0]
    for name, reason in REASONS.items():
        assert reason in error[0], reason
    # One example a reason: the first input refused for it, in the (shuffled) order the conversion read them.
    assert sum(f"(e.g. {root / 'cls' / name})" in error[0] for name in REASONS) == 6
    # Not the advice to allow empty classes, which would fail the same way.
    assert "--allow-empty-classes" not in error[0]
    assert not out.exists()
    inspected = _cli("inspect", out)
    assert inspected.returncode != 0 and "resume" not in inspected.stderr and "no such folder" in inspected.stderr


@pytest.fixture
def mixed(tmp_path) -> Path:
    """Two classes of real images, and a third, ``zzz``, of broken files only."""
    root = make_imagefolder(tmp_path / "mixed", 8, size=(64, 48), classes=2)
    _write_broken(root / "zzz")
    return root


def test_an_output_folder_that_existed_stays_as_it_was(mixed, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = _convert(mixed, out)
    assert proc.returncode == 2 and "class folder 'zzz' holds no image" in proc.stderr, proc.stderr
    assert out.is_dir() and list(out.iterdir()) == []
    allowed = _convert(mixed, out, "--allow-empty-classes")
    assert allowed.returncode == 0, allowed.stderr
    assert "8 samples" in allowed.stdout and "left out 7 input(s)" in allowed.stdout


@pytest.mark.timeout(300)
def test_a_refused_resume_removes_the_folder_its_killed_first_run_made(tmp_path):
    # The first run made the folder and was killed after a few shards; the run that resumes it finds the
    # broken class at the end and is refused: the folder is the job's, so it goes too.
    root = make_imagefolder(tmp_path / "images", 240, size=(160, 120), classes=4, seed=3)
    _write_broken(root / "zzz")
    out = tmp_path / "out"
    args = ["convert", "imagefolder", root, out, "--samples-per-shard", "10", "--no-progress"]
    _kill_after_shards([*args, "--workers", "1"], out, shards=3)
    assert (out / ".dali-pipes-job" / "job.json").exists()
    proc = _cli(*args, "--workers", "2")
    assert proc.returncode == 2 and "resuming" in proc.stderr and "class folder 'zzz'" in proc.stderr, proc.stderr
    assert not out.exists()


def test_more_distinct_reasons_than_are_shown_are_counted_with_an_example():
    kinds = [f"reason {letter}" for letter in "abcdefghijklmnopqrstuvwxy"]  # 25 distinct reasons
    errors = [{"input": f"in/{k}.jpg", "reason": kind} for k, kind in enumerate(kinds)]
    errors.append({"input": "in/again.jpg", "reason": "reason d"})
    message = str(NothingConverted(errors))
    assert "all 26 inputs failed: 2 x reason d (e.g. in/3.jpg); 1 x reason a (e.g. in/0.jpg)" in message
    # Shown: d, then a to t without d (20 in all); counted: u to y.
    assert "1 x reason t (e.g. in/19.jpg); and 5 input(s) for 5 other reasons (e.g. in/20.jpg: reason u)" in message
    assert "reason v" not in message and "nothing was written" in message


def test_reasons_that_differ_only_in_their_numbers_are_one_reason():
    errors = [{"input": f"in/{k}.jpg", "reason": f"truncated JPEG ({k * 7} bytes not processed)"} for k in range(30)]
    message = str(NothingConverted(errors))
    assert "all 30 inputs failed: 30 x truncated JPEG (0 bytes not processed) (e.g. in/0.jpg); nothing" in message
