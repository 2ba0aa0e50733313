"""``dali-pipes demo`` runs the main job end to end and writes a grid a person can look at."""

from __future__ import annotations

import re

import numpy as np
from PIL import Image

from test_convert import run_cli  # noqa: E402 - shared helper


def test_demo_runs_end_to_end_and_writes_a_real_grid(tmp_path):
    work = tmp_path / "demo"
    proc = run_cli(
        "demo",
        "--workdir",
        work,
        "--num-images",
        "48",
        "--batches",
        "4",
        "--baseline-batches",
        "2",
        "--batch-size",
        "8",
    )
    rates = {
        name: float(value)
        for name, value in re.findall(r"^(DALILoader|DataLoader)\s+([\d.]+) images/s", proc.stdout, re.M)
    }
    assert set(rates) == {"DALILoader", "DataLoader"} and all(v > 0 for v in rates.values()), proc.stdout
    assert (work / "shards" / "index.json").exists()
    grid = np.asarray(Image.open(work / "augmented.png").convert("RGB"))
    # 8 tiles of 224 px in rows of 4, with a caption strip above each row.
    assert grid.shape[1] == 4 * 224 and grid.shape[0] == 2 * (224 + 14)
    tiles = [grid[14 + r * 238 : 14 + r * 238 + 224, c * 224 : (c + 1) * 224] for r in range(2) for c in range(4)]
    for tile in tiles:
        assert tile.std() > 5, "a tile of the grid is blank"
    assert not np.array_equal(tiles[0], tiles[1])
