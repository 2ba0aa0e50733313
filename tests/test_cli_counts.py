"""The command says ``1 sample``, ``1 image``, never ``1 samples``: counts of one are singular."""

from __future__ import annotations

from test_convert import run_cli  # noqa: E402 - shared helpers


def test_a_count_of_one_reads_singular(tmp_path):
    images, shards = tmp_path / "one", tmp_path / "shards"
    out = run_cli("synth", images, "--num", "1", "--classes", "1", "--size", "64x48", "--workers", "1").stdout
    assert f"{images}: 1 image in 1 class folder" in out, out

    out = run_cli("convert", "imagefolder", images, shards, "--workers", "1", "--no-progress").stdout
    assert f"{shards}: 1 sample in 1 lmdb shard(s)" in out, out
    out = run_cli("convert", "imagefolder", images, shards, "--workers", "1", "--no-progress").stdout
    assert "already complete (1 sample), nothing to do" in out, out

    out = run_cli("verify", shards, "--decode", "--no-progress").stdout
    assert "1 sample read, 1 image decoded" in out, out

    grid = tmp_path / "grid.png"
    out = run_cli("show", shards, "--num", "1", "--out", grid, "--device", "cpu").stdout
    assert f"{grid}: 1 train sample of {shards}" in out, out
