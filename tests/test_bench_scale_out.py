"""The scale-out suite (``dali-pipes bench --suite scale-out``): its figures from rank results, and one real run.

The cheap tests feed :func:`~dali_pipes.bench.scale_out_table.row_figures` rank results of the shape the rank
processes write (:mod:`dali_pipes.bench.scale_out_rank`); the slow one runs the suite's quick plan end to end
(real rank processes, a gloo group, moto behind per-node latency proxies) without the MosaicML peer unless
``DALI_PIPES_BENCH_MDS_PYTHON`` names a Python that has it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dali_pipes.bench.scale_out_table import format_table, global_classes, goal_lines, once, row_figures


def rank(node: int, indices: list[list[int]], classes: list[list[int]], nbytes: list[int | None], **extra):
    """One rank's result: per epoch its indices, the classes of its full batches and its node's bytes."""
    epochs = [
        {"indices": i, "classes": c, "images": len(i), "seconds": 0.5, "bytes": b, "answers": 1, "shards": None}
        for i, c, b in zip(indices, classes, nbytes)
    ]
    return {"rank": 0, "node": node, "epochs": epochs, **extra}


def test_once_finds_missing_and_repeated_samples():
    assert once([[0, 2], [1, 3]], 4) == {"ok": True, "missing": 0, "repeated": 0}
    assert once([[0, 2], [2, 3]], 4) == {"ok": False, "missing": 1, "repeated": 1}
    assert not once([[0, 1], [2, 3, 4]], 4)["ok"]  # a sample the dataset does not have


def test_global_classes_of_a_permutation():
    assert global_classes(list(range(64)), 8) == 8  # every label differs
    assert global_classes([3] * 64, 8) == 1
    two = global_classes([0, 1] * 512, 16, epochs=2)
    assert 1.9 < two <= 2.0  # a batch of 16 from two equal classes almost always holds both


def test_row_figures_add_each_nodes_bytes_and_check_every_epoch():
    # Two nodes of two ranks; only a node's first rank reads the node's proxy (the other reports None).
    ranks = [
        rank(0, [[0, 1], [4, 5]], [[2], [1]], [600, 300], peak=90, limit=100, window=3),
        rank(0, [[2, 3], [6, 7]], [[1], [2]], [None, None], peak=95, limit=100),
        rank(1, [[4, 5], [0, 1]], [[2], [2]], [500, 100], peak=80, limit=100),
        rank(1, [[6, 7], [2, 2]], [[2], [1]], [None, None], peak=80, limit=100),
    ]
    f = row_figures(ranks, dataset_bytes=1000, num_samples=8, global_mean=2.0)
    one, two = f["epochs"]
    assert (one["bytes_per_node"], one["bytes_total"]) == ([600, 500], 1100)
    assert one["per_node_x"] == pytest.approx(0.6) and one["total_x"] == pytest.approx(1.1)
    assert two["total_x"] == pytest.approx(0.4)
    assert one["exactly_once"]["ok"]
    assert two["exactly_once"] == {"ok": False, "missing": 1, "repeated": 1}  # 3 never read, 2 twice
    assert one["images_per_s"] == pytest.approx(8 / 0.5)
    assert f["classes_per_batch"] == pytest.approx(13 / 8) and f["classes_x"] == pytest.approx(13 / 16)
    assert f["cache_peak_x"] == pytest.approx(0.95)
    assert (f["nodes"], f["ranks"], f["window"]) == (2, 4, 3)
    table = format_table(
        [{"name": "ours", "figures": f}, {"name": "peer", "layout": "2x2", "skipped": "no peer"}], 2.0, 2
    )
    lines = table.splitlines()
    assert lines[2].startswith("| ours | 2x2 | 0.60 / 0.30 | 1.10 / 0.40 | 1.6 (0.81x) | 16 / 16 |")
    assert lines[2].endswith("| 0.95 | no (1 missing, 1 repeated) |")
    assert "not run: no peer" in lines[3] and lines[3].count("|") == lines[0].count("|")
    one_node = {**f, "nodes": 1, "epochs": [{**one, "total_x": 1.02, "exactly_once": {"ok": True}}], "classes_x": 0.95}
    rows = [{"name": "ours", "layout": "1x2", "figures": one_node}, {"name": "ours", "layout": "2x2", "figures": f}]
    widest, mixing = goal_lines(rows, "ours")
    assert widest.startswith("goal: 2x2,") and "1.10 / 0.40x (0.75x on average), NOT exactly once" in widest
    assert widest.endswith("not met")  # within 1.05x on average, but a sample missed in epoch 2
    assert "0.81x at the least -> not met" in mixing
    rows[1]["figures"] = {**f, "epochs": [{**one, "total_x": 1.12}, {**one, "total_x": 0.96}], "classes_x": 0.91}
    assert all(line.endswith("-> met") for line in goal_lines(rows, "ours"))  # 1.04x on average
    rows[1]["figures"]["epochs"][1] = {**one, "total_x": 1.02}
    assert goal_lines(rows, "ours")[0].endswith("(1.07x on average), exactly once -> not met")


@pytest.mark.slow
def test_the_quick_plan_runs_every_row_exactly_once(tmp_path, capsys):
    from dali_pipes.bench.scale_out import ScaleOutPlan
    from dali_pipes.cli import main

    plan = ScaleOutPlan.quick()
    out = tmp_path / "scale-out.json"
    assert main(["bench", "--suite", "scale-out", "--quick", "--json", str(out), str(tmp_path / "work")]) == 0
    report = json.loads(out.read_text())
    assert report["table"] in capsys.readouterr().out
    ours = [row for row in report["rows"] if row["name"].startswith("dali-pipes")]
    assert len(ours) == 4 and all("figures" in row for row in ours), report["table"]
    for row in ours:
        (epoch,) = row["figures"]["epochs"]
        assert epoch["exactly_once"]["ok"] and epoch["images"] == plan.images
        # Every node downloads what its ranks read at least once: on one node, every shard.
        assert all(b is not None and b > 0 for b in epoch["bytes_per_node"])
        if row["figures"]["nodes"] == 1:
            assert epoch["total_x"] >= 1.0
        assert epoch["shards_downloaded"] >= 1
        assert 0 < row["figures"]["cache_peak_x"] <= 1.0  # downloads reserve their bytes first
    source = np.mean([r["figures"]["classes_per_batch"] for r in ours if "source" in r["name"]])
    shuffled = np.mean([r["figures"]["classes_per_batch"] for r in ours if "default" in r["name"]])
    assert shuffled > source  # the default conversion's order mixes a class-ordered folder
