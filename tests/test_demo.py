"""``dali-pipes demo`` runs the main job end to end and writes a grid a person can look at."""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest
from PIL import Image

from test_convert import CLI, run_cli  # noqa: E402 - shared helpers


def test_demo_runs_end_to_end_and_writes_a_real_grid(tmp_path):
    work = tmp_path / "demo"
    proc = run_cli(
        "demo",
        "--workdir",
        work,
        "--num-images",
        "48",
        "--seconds",
        "0.2",
        "--batch-size",
        "8",
    )
    rates = {
        name: (float(value), int(spread))
        for name, value, spread in re.findall(
            r"^(DALILoader|DataLoader)\s+([\d.]+) images/s ±(\d+)%, [\d.]+ CPU s/1k images", proc.stdout, re.M
        )
    }
    assert set(rates) == {"DALILoader", "DataLoader"} and all(v > 0 for v, _ in rates.values()), proc.stdout
    assert "medians of 3 timed windows each, taken in turn after a warm-up" in proc.stdout
    assert (work / "shards-48" / "index.json").exists()
    assert f"grid       {work / 'augmented-48.png'}" in proc.stdout
    grid = np.asarray(Image.open(work / "augmented-48.png").convert("RGB"))
    # 8 tiles of 224 px in rows of 4, with a caption strip above each row.
    assert grid.shape[1] == 4 * 224 and grid.shape[0] == 2 * (224 + 14)
    tiles = [grid[14 + r * 238 : 14 + r * 238 + 224, c * 224 : (c + 1) * 224] for r in range(2) for c in range(4)]
    for tile in tiles:
        assert tile.std() > 5, "a tile of the grid is blank"
    assert not np.array_equal(tiles[0], tiles[1])


@pytest.mark.slow  # two whole demo runs (18 s); the end-to-end demo stays in the default suite
def test_the_default_workdir_is_one_cache_folder_reused_by_later_runs(tmp_path):
    # Before, every run left its 78 MB of images and shards in a new /tmp folder.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = [*CLI, "demo", "--num-images", "24", "--seconds", "0.1", "--batch-size", "8"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    work = tmp_path / "cache" / "dali-pipes" / "demo"
    made = {p.name for p in work.iterdir()}
    assert made == {"images-24", "shards-24", "augmented-24.png"}, made
    assert f"converting {work / 'images-24'} to LMDB shards in {work / 'shards-24'}" in first.stderr, first.stderr
    stamp = (work / "shards-24" / "index.json").stat().st_mtime_ns
    second = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stderr
    assert {p.name for p in work.iterdir()} == made
    assert (work / "shards-24" / "index.json").stat().st_mtime_ns == stamp  # the finished conversion was reused
    # ... and the run says so, rather than that it is converting.
    assert f"reusing the shards in {work / 'shards-24'}" in second.stderr and "converting" not in second.stderr


@pytest.mark.slow  # a whole demo run on photos (17 s)
def test_demo_on_your_photos_keeps_the_built_in_demos_grid(tmp_path):
    # Before, both wrote <workdir>/augmented.png: a run on your photos overwrote the built-in demo's grid.
    work = tmp_path / "demo"
    common = ["--workdir", work, "--seconds", "0.1", "--batch-size", "8"]
    run_cli("demo", "--num-images", "16", *common)
    built_in = (work / "augmented-16.png").read_bytes()
    photos = work / "images-16"  # the synthetic class folders serve as "your photos"
    proc = run_cli("demo", "--data", photos, *common)
    grids = sorted(p.name for p in work.glob("augmented*.png"))
    assert len(grids) == 2 and "augmented-16.png" in grids, grids
    yours = work / next(name for name in grids if name != "augmented-16.png")
    assert (work / "augmented-16.png").read_bytes() == built_in
    assert f"grid       {yours}" in proc.stdout and f"images     {photos}" in proc.stdout, proc.stdout
    # Your photos' grid is named as their shards are: the pair is easy to find.
    assert {p.name for p in work.glob("shards-*")} - {"shards-16"} == {yours.stem.replace("augmented-", "shards-")}
