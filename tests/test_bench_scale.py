"""``dali-pipes bench --suite scale``: every step at every N up to --max-n, with time, rate, memory and growth."""

from __future__ import annotations

import json

from dali_pipes.cli import main


def test_scale_suite_measures_every_step_at_every_size(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["bench", "--suite", "scale", "--max-n", "400", "--json", str(out), str(tmp_path / "work")]) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    # 400 is below the first size of the ladder (10k): it is the only N.
    assert [(r["step"], r["n"]) for r in rows] == [
        ("convert list -> lmdb", 400),
        ("convert arrays -> hdf5", 400),
        ("loader Features b1024", 400),
        ("loader Features b1024, epochs 2+", 400),
    ]
    for row in rows:
        assert row["seconds"] > 0 and row["per_second"] == row["n"] / row["seconds"]
        assert row["rss_mb"] > 10 and row["growth"] == 1.0
        assert f"| {row['step']} | 400 |" in table
    # The converted datasets are real: the loader row read every row of the HDF5 conversion.
    from dali_pipes import open_store

    assert len(open_store(tmp_path / "work" / "rows-400.hdf5")) == 400
    assert len(open_store(tmp_path / "work" / "list-400.lmdb")) == 400


def test_scale_suite_needs_a_dataset_for_other_suites(capsys):
    import pytest

    with pytest.raises(SystemExit, match="give the dataset folder"):
        main(["bench", "--suite", "main"])
