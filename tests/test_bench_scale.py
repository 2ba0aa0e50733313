"""``dali-pipes bench --suite scale``: every step at every N up to --max-n, with time, rate, memory and growth."""

from __future__ import annotations

import json
import os

from dali_pipes.bench.procfs import in_child
from dali_pipes.bench.scale import _convert, make_inputs
from dali_pipes.cli import main


def test_scale_suite_measures_every_step_at_every_size(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["bench", "--suite", "scale", "--max-n", "400", "--json", str(out), str(tmp_path / "work")]) == 0
    table = capsys.readouterr().out
    figures = json.loads(out.read_text())
    rows = figures["rows"]
    # 400 is below the first size of the ladder (10k): it is the only N, so there is no goal to check.
    assert [(r["step"], r["n"]) for r in rows] == [
        ("convert list -> lmdb", 400),
        ("convert arrays -> hdf5", 400),
        ("loader Features b1024", 400),
        ("loader Features b1024, epochs 2+", 400),
    ]
    assert figures["goal"] == []
    for row in rows:
        assert row["seconds"] > 0 and row["per_second"] == row["n"] / row["seconds"]
        assert row["rss_mb"] > 10 and row["growth"] == 1.0 and row["rss_growth"] == 1.0
        assert f"| {row['step']} | 400 |" in table
    for row in rows[2:]:
        # The loader's construction and first batch are figures of their own; the epoch includes the first batch.
        assert 0 < row["construct_s"] and 0 < row["first_batch_s"]
    assert rows[2]["first_batch_s"] <= rows[2]["seconds"]
    for row in rows[:2]:
        assert row["construct_s"] is None and row["first_batch_s"] is None
    # The converted datasets are real: the loader row read every row of the HDF5 conversion.
    from dali_pipes import open_store

    assert len(open_store(tmp_path / "work" / "rows-400.hdf5")) == 400
    assert len(open_store(tmp_path / "work" / "list-400.lmdb")) == 400


def test_every_worker_of_a_conversion_has_its_own_peak(tmp_path):
    # Several shards, so that both workers of the pool run; each one's peak is its own
    # (a fresh interpreter, tens of MB), not the conversion parent's, and the parent's is not the bench's.
    list_file, _ = make_inputs(tmp_path, 2_000)
    got = in_child(_convert, "list", str(list_file), "lmdb", str(tmp_path / "out.lmdb"), 2, 250)
    assert got.figures["seconds"] > 0
    assert len(got.worker_peaks_mb) == 2, got.worker_peaks_mb
    assert got.worker_peaks_mb == sorted(got.worker_peaks_mb, reverse=True)
    assert all(20 < mb < 1000 for mb in got.worker_peaks_mb)
    assert 20 < got.peak_mb < 1000
    # Converting again into the same folder converts (an earlier dataset is removed), it does not resume.
    again = in_child(_convert, "list", str(list_file), "lmdb", str(tmp_path / "out.lmdb"), 2, 250)
    assert len(again.worker_peaks_mb) == 2
    assert os.path.isdir(tmp_path / "out.lmdb")


def test_the_goal_sets_the_largest_n_against_the_one_before(capsys, tmp_path):
    from dali_pipes.bench.scale import ScaleRow, _set_growths, format_scale, goal_check

    rows = [
        ScaleRow("convert", 1_000, 1.0, 1_000.0, 100.0, [50.0, 40.0]),
        ScaleRow("convert", 10_000, 10.0, 1_000.0, 110.0, [60.0, 41.0]),
    ]
    _set_growths(rows)
    assert rows[1].rss_growth == 1.1 and rows[1].worker_rss_growth == 1.2
    (check,) = goal_check(rows)
    assert (check["from_n"], check["to_n"]) == (1_000, 10_000)
    assert check["peak_growth"] == {"process": 1.1, "largest worker": 1.2, "smallest worker": 41.0 / 40.0}
    assert check["met"] is False  # the largest worker grew by 20%
    assert check["in_goal"] and "convert: peak" in format_scale(rows) and ": NOT met" in format_scale(rows)
    loader = [ScaleRow("loader Features", n, 1.0, 1_000.0, peak) for n, peak in ((1_000, 100.0), (10_000, 300.0))]
    _set_growths(loader)
    (check,) = goal_check(loader)
    assert not check["met"] and not check["in_goal"]  # checked alike, but the goal is the conversion's
    assert "reported, outside the goal (would be NOT met)" in format_scale(loader)
