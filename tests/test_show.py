"""``dali-pipes show`` writes a grid a person can look at: tiles laid out as promised, not blank, boxes drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from converters.runner import convert
from converters.sources import CocoSource, ImageFolderSource
from converters.synth import make_imagefolder
from dali_pipes.cli.show import BOX_WIDTH, CAPTION, box_color, write_grid

from test_convert import run_cli  # noqa: E402 - shared helper


def converted_imagefolder(root: Path, count: int, seed: int) -> Path:
    """``count`` synthetic 96 x 72 images of 3 classes, converted to LMDB shards in ``root / "shards"``: that folder."""
    images = make_imagefolder(root / "images", count, size=(96, 72), classes=3, seed=seed)
    convert(ImageFolderSource(images), root / "shards", format="lmdb", workers=1, progress=False)
    return root / "shards"


@pytest.fixture(scope="module")
def classification(tmp_path_factory) -> Path:
    return converted_imagefolder(tmp_path_factory.mktemp("show-cls"), 12, seed=2)


@pytest.fixture(scope="module")
def coco(tmp_path_factory, coco_mini) -> Path:
    out = tmp_path_factory.mktemp("show-coco") / "shards"
    convert(
        CocoSource(coco_mini / "images", coco_mini / "instances.json"), out, format="lmdb", workers=1, progress=False
    )
    return out


def _tiles(grid: np.ndarray, n: int, columns: int, size: int) -> list[np.ndarray]:
    step = size + CAPTION
    return [
        grid[
            (i // columns) * step + CAPTION : (i // columns) * step + step,
            (i % columns) * size : (i % columns + 1) * size,
        ]
        for i in range(n)
    ]


@pytest.mark.parametrize("pipeline", ["train", "recipe", "val"])
def test_show_classification_grid_has_the_tile_layout_and_real_pixels(classification, tmp_path, pipeline):
    out = tmp_path / "grid.png"
    proc = run_cli(
        "show", classification, "--pipeline", pipeline, "--out", out, "--num", "6", "--size", "64", "--device", "cpu"
    )
    assert str(out) in proc.stdout
    # It says which settings it drew with: the recipe's MixUp/CutMix and erasing, the size asked for.
    drawn = next(line for line in proc.stdout.splitlines() if line.startswith("drawn with "))
    recipe_settings = "mix=Mix(mixup_alpha=0.8" in drawn and "erasing=RandomErasing(prob=1.0" in drawn
    assert "size=64" in drawn and recipe_settings == (pipeline == "recipe"), drawn
    grid = np.asarray(Image.open(out).convert("RGB"))
    # 6 tiles in rows of 4: 2 rows, each a caption strip over a 64 px tile.
    assert grid.shape == (2 * (64 + CAPTION), 4 * 64, 3)
    tiles = _tiles(grid, 6, 4, 64)
    assert all(tile.std() > 5 for tile in tiles), "a tile of the grid is blank"
    # The caption strip holds text (dark pixels on white), not just white.
    assert grid[:CAPTION, :64].min() < 128


def test_show_coco_draws_the_boxes(coco, tmp_path):
    out = tmp_path / "det.png"
    run_cli("show", coco, "--pipeline", "detection-val", "--out", out, "--num", "4", "--size", "128", "--device", "cpu")
    grid = np.asarray(Image.open(out).convert("RGB"))
    assert grid.shape == (128 + CAPTION, 4 * 128, 3)
    assert all(tile.std() > 5 for tile in _tiles(grid, 4, 4, 128))

    # The same batch, recomputed: the first real box of a sample is outlined in its class colour.
    from dali_pipes import DALILoader, RunOptions
    from dali_pipes.cli.show import make_spec

    spec, run = make_spec("detection-val", size=128), RunOptions(device="cpu", py_num_workers=0)
    with DALILoader(coco, spec, batch_size=4, shuffle=True, seed=0, run=run) as loader:
        batch = next(iter(loader))
    counts = batch["num_boxes"].numpy()
    checked = 0
    for i in np.flatnonzero(counts):
        x1, y1, x2, y2 = batch["boxes"][i, 0].numpy()
        if x2 - x1 < 8 or y2 - y1 < 8:
            continue  # too small to find its edge apart from its corners
        colour = np.asarray(box_color(int(batch["labels"][i, 0])))
        left, top = int(np.ceil(x1)) + i * 128, int(np.ceil(y1)) + CAPTION
        mid_y = top + int((y2 - y1) / 2)
        edge = grid[mid_y, max(0, left - 1) : left + BOX_WIDTH + 1]  # around the left edge, half-way down
        assert (np.abs(edge.astype(int) - colour).sum(axis=1) == 0).any(), (i, edge, colour)
        checked += 1
    assert checked, "no sample of the batch has a box large enough to check"


def test_soft_targets_are_captioned_with_their_two_largest_classes(tmp_path):
    from dali_pipes.cli.show import _caption

    assert _caption(np.array([0.1, 0.6, 0.3], dtype=np.float32), ["a", "b", "c"]) == "b 0.60 + c 0.30"
    assert _caption(np.array(2), ["a", "b", "c"]) == "2: c"
    images = np.zeros((2, 3, 8, 8), dtype=np.float32)
    path = write_grid(images, np.array([[0.7, 0.3], [0.2, 0.8]]), tmp_path / "soft.png", classes=["a", "b"])
    assert np.asarray(Image.open(path)).shape[:2] == (8 + CAPTION, 16)


def test_write_grid_draws_only_the_real_box_rows(tmp_path):
    images = np.full((1, 40, 40, 3), 128, np.uint8)
    boxes = np.array([[[5, 5, 30, 30], [0, 0, 39, 39]]], np.float32)
    labels = np.array([[1, 2]])
    path = write_grid(images, labels, tmp_path / "g.png", boxes=boxes, num_boxes=np.array([1]))
    grid = np.asarray(Image.open(path).convert("RGB"))
    assert tuple(grid[CAPTION + 15, 5]) == box_color(1)
    # The second row is padding (num_boxes=1): the tile's border stays grey.
    assert tuple(grid[CAPTION + 20, 0]) == (128, 128, 128)


def test_show_rejects_an_unknown_pipeline(classification, tmp_path):
    from dali_pipes.cli.show import show

    with pytest.raises(ValueError, match="unknown pipeline"):
        show(classification, tmp_path / "x.png", pipeline="segmentation")


def test_show_says_in_one_line_when_the_pipeline_does_not_fit_the_dataset(coco, tmp_path):
    out = tmp_path / "x.png"
    proc = run_cli("show", coco, "--pipeline", "train", "--out", out, "--device", "cpu", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "dali-pipes: error:" in proc.stderr and "'label'" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
