"""COCO polygons of fewer than 3 points under ``convert coco --masks``: not drawn, listed, and nothing else lost.

DALI_extra's coco-mini (the package's sample) has three: annotations 8, 69 and 79, each its image's only
instance, each one 2-point polygon with ``area`` 0. They used to leave their images out whole ("a polygon
needs at least 3"). Now every image and every instance is kept: such a polygon is not drawn, an instance
left with no other polygon has an empty mask, the boxes, categories and crowd flags are the same as without
``--masks``, and each such annotation is listed in ``errors.jsonl`` with its image and id. The references are
pycocotools' own: ``COCO.annToMask`` for every mask it can draw.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from converters.runner import convert
from converters.sources.coco import CocoSource
from dali_pipes import BatchFormat, DALILoader, RunOptions, open_store
from dali_pipes.pipelines import InstanceSegmentationVal

from test_convert import run_cli  # noqa: E402 - shared helper

COCO = pytest.importorskip("pycocotools.coco", reason="pycocotools is not installed (pip install -e '.[coco]')").COCO

#: coco-mini's real degenerate annotations (2-point polygons, area 0), each the only one of its image.
DEGENERATE = {8, 69, 79}


def _layers(sample: dict) -> np.ndarray:
    layers = np.asarray(Image.open(io.BytesIO(sample["masks"])))
    return layers[:, :, None] if layers.ndim == 2 else layers


def _mask(layers: np.ndarray, code: int) -> np.ndarray:
    return layers[:, :, code // 256] == code % 256


def _errors(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def converted(coco_mini: Path, tmp_path_factory) -> tuple[Path, Path, str]:
    """coco-mini converted by the CLI without and with --masks; the two outputs and the second run's stdout."""
    root = tmp_path_factory.mktemp("polygons")
    args = ["convert", "coco", "--images", coco_mini / "images", "--annotations", coco_mini / "instances.json"]
    run_cli(*args, root / "plain", "--workers", "1", "--no-progress")
    proc = run_cli(*args, "--masks", root / "masks", "--workers", "1", "--no-progress")
    return root / "plain", root / "masks", proc.stdout


def test_every_image_is_kept_and_each_2_point_polygon_is_listed_with_its_image_and_id(coco_mini, converted):
    _, masks, stdout = converted
    data = json.loads((coco_mini / "instances.json").read_text())
    files = {im["id"]: im["file_name"] for im in data["images"]}
    image_of = {a["id"]: a["image_id"] for a in data["annotations"]}
    assert "masks: 61 samples" in stdout.replace(str(masks), "masks")
    # Counted as what they are: no input was left out, three parts of kept inputs were (and inspect says so).
    assert "left out 0 input(s) and 3 part(s) of kept inputs, listed in" in stdout
    shown = run_cli("inspect", masks).stdout
    assert "left out  0 input(s) and 3 part(s) of kept inputs (see errors.jsonl)" in shown
    assert len(open_store(masks)) == 61
    errors = _errors(masks)
    assert sorted(e["part"] for e in errors) == sorted(f"annotation id {i}" for i in DEGENERATE)
    for error in errors:
        ann_id = int(error["part"].split()[-1])
        assert error["input"] == str(coco_mini / "images" / files[image_of[ann_id]])
        assert f"annotation id {ann_id} (image id {image_of[ann_id]}): polygon 0 has 2 point(s)" in error["reason"]
        assert "mask is empty" in error["reason"] and "box, category and image are kept" in error["reason"]
        # The CLI's summary names each one too: nothing changes without a word.
        assert f"{error['input']}: annotation id {ann_id} " in stdout


def test_boxes_are_those_without_masks_and_each_box_has_a_mask_code(converted):
    plain, masks, _ = converted
    with_masks, without = open_store(masks), open_store(plain)
    empty = set()
    for i in range(61):
        a, b = with_masks[i], without[i]
        assert a["key"] == b["key"] and a["image"] == b["image"]
        for name in ("boxes", "category_id", "iscrowd"):
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{a['key']!r}: {name}")
        assert len(a["mask_code"]) == len(a["boxes"])
        layers = _layers(a)
        empty |= {int(a["image_id"]) for code in a["mask_code"] if not _mask(layers, int(code)).any()}
    # The instances without a mask are exactly the three degenerate ones (every other has pixels).
    assert empty == {6, 48, 55}


def test_the_loader_gives_those_boxes_with_empty_masks(converted):
    _, masks, _ = converted
    store = open_store(masks)
    ids = [int(store[i]["image_id"]) for i in range(61)]
    spec = InstanceSegmentationVal(size=(300, 400), crowd="keep")
    seen = 0
    with DALILoader(
        masks,
        spec,
        batch_size=8,
        shuffle=False,
        run=RunOptions(device="cpu", py_num_workers=0),
        batch_format=BatchFormat(with_index=True),
    ) as loader:
        for batch in loader:
            for row in range(len(batch["index"])):
                if not batch["is_pad"][row] and ids[int(batch["index"][row])] in {6, 48, 55}:
                    assert int(batch["num_boxes"][row]) == 1 and not batch["masks"][row].any()
                    seen += 1
    assert seen == 3


def test_a_short_polygon_beside_real_ones_is_not_drawn_and_the_rest_is_annToMask(coco_mini, tmp_path):
    data = json.loads((coco_mini / "instances.json").read_text())
    by_image: dict[int, list[dict]] = {}
    for ann in data["annotations"]:
        by_image.setdefault(ann["image_id"], []).append(ann)
    # An image with two polygon instances: one gets a 2-point and a 1-point polygon after its own, the other
    # becomes a lone 2-point line (as coco-mini's three are).
    image_id = next(i for i, anns in sorted(by_image.items()) if len(anns) >= 2 and len(anns[0]["segmentation"]) == 1)
    first, second = by_image[image_id][:2]
    real = first["segmentation"][0]
    first["segmentation"] = [real, real[:4], real[:2]]
    second["segmentation"] = [second["segmentation"][0][:4]]
    (tmp_path / "instances.json").write_text(json.dumps(data))
    # What the stored masks must be: pycocotools' annToMask of the annotations as drawn.
    reference = COCO(str(tmp_path / "instances.json"))
    with pytest.raises(TypeError):  # pycocotools itself cannot draw the lone line (it reads it as a box)
        reference.annToMask(second)
    drawn = dict(first, segmentation=[real])

    # --on-error fail: a polygon too short to draw is not a bad input, and stops nothing.
    out = tmp_path / "out"
    source = CocoSource(coco_mini / "images", tmp_path / "instances.json", masks=True)
    assert convert(source, out, format="lmdb", workers=1, on_error="fail", progress=False).num_samples == 61
    notes = {e["part"]: e["reason"] for e in _errors(out)}
    assert set(notes) == {f"annotation id {i}" for i in DEGENERATE | {first["id"], second["id"]}}
    assert "polygons 1, 2 have 2, 1 points" in notes[f"annotation id {first['id']}"]
    assert "drawn from its other 1 polygon(s)" in notes[f"annotation id {first['id']}"]
    assert "mask is empty" in notes[f"annotation id {second['id']}"]

    store = open_store(out)
    sample = next(store[i] for i in range(61) if int(store[i]["image_id"]) == image_id)
    layers, anns = _layers(sample), by_image[image_id]
    assert len(sample["mask_code"]) == len(sample["boxes"]) == len(anns)
    for code, ann in zip(sample["mask_code"], anns):
        if ann is second:
            expected = np.zeros(layers.shape[:2], dtype=bool)
        else:
            expected = reference.annToMask(drawn if ann is first else ann).astype(bool)
        np.testing.assert_array_equal(_mask(layers, int(code)), expected, err_msg=f"annotation {ann['id']}")
    # Drawing the short polygons too changes nothing where pycocotools can: they cover no pixel.
    np.testing.assert_array_equal(reference.annToMask(first), reference.annToMask(drawn))


def test_a_shards_progress_counts_its_inputs_not_the_parts_of_kept_ones():
    """Resumed or on Dask, progress adds each finished shard's inputs: a listed polygon is part of a kept sample."""
    from converters.jobdir import ShardRecord

    errors = [
        {"input": "a.jpg", "reason": "not an image", "shard": "shard-00000.lmdb"},
        {
            "input": "b.jpg",
            "reason": "polygon 0 has 2 point(s)",
            "shard": "shard-00000.lmdb",
            "part": "annotation id 8",
        },
    ]
    record = ShardRecord("shard-00000.lmdb", num_samples=10, bytes=1, sha256="0", errors=errors)
    assert record.inputs_done == 11  # b.jpg is one of the 10 samples; a.jpg was left out
