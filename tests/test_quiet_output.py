"""What users read is theirs: no warnings about DALI's own code, no progress bars in logs, each line once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from converters.synth import make_imagefolder
from dali_pipes.bench.report import BenchReport, format_table

from test_convert import CLI

TESTS = Path(__file__).resolve().parent


def test_auto_augment_prints_none_of_dalis_notes_about_its_own_deprecated_aliases(tmp_path):
    # DALI's auto_aug calls fn.experimental.equalize/filter, whose deprecation DALI forces on: 12 lines a script.
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from loader_helpers import write_dataset
        from dali_pipes import ClassificationTrain, DALILoader, RunOptions
        path = write_dataset({str(tmp_path / "ds")!r}, 8, samples_per_shard=4, image_shape=(40, 48))
        for policy in ("rand_augment", "trivial_augment"):
            spec = ClassificationTrain(size=32, auto_augment=policy)
            with DALILoader(path, spec, batch_size=4, run=RunOptions(device="cpu", py_num_workers=0)) as loader:
                print(policy, sum(1 for _ in loader))
        import warnings
        warnings.warn("a user's own DeprecationWarning", DeprecationWarning)  # still shown: only DALI's are dropped
        """
    )
    proc = subprocess.run([sys.executable, "-W", "default", "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["rand_augment", "2", "trivial_augment", "2"]
    assert "moved out from the experimental phase" not in proc.stderr, proc.stderr
    assert "a user's own DeprecationWarning" in proc.stderr


def test_convert_into_a_log_has_no_progress_bar_and_lists_each_left_out_input_once(tmp_path):
    images = make_imagefolder(tmp_path / "images", 6, size=(32, 24), classes=1)
    (next(images.iterdir()) / "notes.txt").write_text("not an image\n")
    # stderr and stdout are pipes here, as in a batch job's log: tqdm's own terminal check turns the bar off.
    proc = subprocess.run(
        [*CLI, "convert", "imagefolder", str(images), str(tmp_path / "out"), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    both = proc.stdout + proc.stderr
    assert "convert lmdb:" not in both and "img/s]" not in both, both
    assert both.count("notes.txt") == 1, both
    assert "left out 1 input(s)" in proc.stdout


def test_bench_tables_show_figures_without_the_projects_own_goals():
    report = BenchReport(
        "main",
        "a title",
        [],
        {},
        {},
        summary={"dali-pipes gpu": {"value": 7115.0, "unit": " images/s", "target": "at least 12,000"}},
    )
    table = format_table(report)
    assert "dali-pipes gpu: 7,115.00 images/s" in table
    assert "12,000" not in table and "target" not in table
