"""The sample photos the repository carries: what the tests rely on is there, ships with the package,
and nothing in the project reads data from outside the repository."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from dali_pipes import sample_data

ROOT = Path(__file__).resolve().parents[1]


def test_imagenet_mini_has_mixed_sizes_in_class_folders(imagenet_mini):
    photos = sorted(imagenet_mini.glob("*/*.jpg"))
    sizes = Counter(Image.open(p).size for p in photos)
    assert len(photos) == 47 and len({p.parent.name for p in photos}) == 19
    assert len(sizes) > 20 and sizes[(480, 320)] >= 6  # test_pipelines needs six of one size
    listed = (imagenet_mini / "image_list.txt").read_text().split()
    assert sorted(listed[0::2]) == [p.relative_to(imagenet_mini).as_posix() for p in photos]


def test_coco_mini_annotations_match_the_downscaled_images(coco_mini):
    data = json.loads((coco_mini / "instances.json").read_text())
    images = {i["id"]: i for i in data["images"]}
    assert len(images) == 61 and len(data["annotations"]) == 91 and len(data["categories"]) == 17
    assert {a["category_id"] for a in data["annotations"]} == set(range(17))
    assert sum(a["iscrowd"] for a in data["annotations"]) == 4
    modes = Counter()
    for image in images.values():
        with Image.open(coco_mini / "images" / image["file_name"]) as photo:
            assert photo.size == (image["width"], image["height"]), image["file_name"]
            modes[(photo.format, photo.mode)] += 1
    assert modes == {("JPEG", "RGB"): 58, ("PNG", "RGBA"): 3}
    for ann in data["annotations"]:
        x, y, w, h = ann["bbox"]
        image = images[ann["image_id"]]
        assert w > 0 and h > 0 and x + w <= image["width"] + 0.01 and y + h <= image["height"] + 0.01, ann["id"]
        xs, ys = ann["segmentation"][0][0::2], ann["segmentation"][0][1::2]
        # Polygons were scaled with their boxes, so the box still bounds the polygon: within 3/8 px, as the
        # originals' whole-pixel boxes were within 1 px of their polygons.
        slack = 0.38
        assert x - slack <= min(xs) and max(xs) <= x + w + slack and y - slack <= min(ys) and max(ys) <= y + h + slack


def test_every_sample_file_is_package_data():
    """A file under dali_pipes/sample_data that no package-data pattern names would not be installed."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = patterns["dali_pipes.sample_data"]
    files = [p.relative_to(sample_data.SAMPLE_DATA).as_posix() for p in sample_data.SAMPLE_DATA.rglob("*")]
    data = [f for f in files if not f.endswith((".py", ".pyc")) and "__pycache__" not in f]
    assert data and [f for f in data if (sample_data.SAMPLE_DATA / f).is_file()]
    unshipped = [
        f
        for f in data
        if (sample_data.SAMPLE_DATA / f).is_file()
        and not any(fnmatch.fnmatch(f, p) and f.count("/") == p.count("/") for p in patterns)
    ]
    assert not unshipped, f"add patterns to [tool.setuptools.package-data] for {unshipped[:5]}"
    assert (sample_data.SAMPLE_DATA / "LICENSE.DALI_extra").read_text().lstrip().startswith("Apache License")


#: The folder beside the repository, however it is spelt: the relative path (even in a comment), or a
#: join of its parts with its data folder (with ``/`` or as arguments); built in pieces so that this file does not match.
_BESIDE = re.compile(r"\.\./shar" + r"ed\b|" + "shar" + r"""ed['"]?\s*[/,]\s*['"]?data""")


def test_nothing_reads_data_from_beside_the_repository():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    for spelling in (
        "../shar" + "ed",
        "../shar" + "ed/data",
        'parents[2] / "shar' + 'ed" / "data"',
        "join('..', 'shar" + "ed', 'data')",
    ):
        assert _BESIDE.search(spelling), spelling  # the spellings the check must catch
    readers = [
        f for f in listed.stdout.split() if f.endswith((".py", ".ipynb", ".toml", ".cfg")) or f.startswith(".ci/")
    ]
    offenders = [f for f in readers if (ROOT / f).is_file() and _BESIDE.search((ROOT / f).read_text(errors="replace"))]
    assert offenders == [], f"these read the data folder beside the repository, which a user's clone lacks: {offenders}"
