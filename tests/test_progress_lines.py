"""Long jobs writing to a pipe or a log file say how far they are: a line every DALI_PIPES_PROGRESS_INTERVAL
seconds instead of a bar (dali_pipes/dataset/progress.py), in a real conversion and in every job with a bar."""

from __future__ import annotations

import logging
import os
import re
import select
import subprocess
import time
from pathlib import Path

import pytest

from converters.synth import make_imagefolder
from dali_pipes.cli.verify import verify_dataset
from dali_pipes.dataset.progress import INTERVAL_ENV, bar_disabled, progress_line, tqdm
from dali_pipes.staging.stage import stage_dataset

from loader_helpers import write_dataset
from test_convert import CLI

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(
    r"convert lmdb: ([\d,]+)/([\d,]+) samples \((\d+)%\), [\d,]+ samples/s, (about .+|less than 1 s) left$"
)


def test_a_conversion_into_a_pipe_logs_progress_lines_while_it_runs(tmp_path):
    images = make_imagefolder(tmp_path / "images", 600, size=(160, 120), classes=2)
    env = {**os.environ, INTERVAL_ENV: "0.05"}
    # Resized (decoded and encoded again) by two worker processes: about a second of work, sent in as it is done.
    args = [*CLI, "convert", "imagefolder", str(images), str(tmp_path / "out"), "--workers", "2",
            "--samples-per-shard", "100", "--max-size", "64"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen = []  # (line, whether the conversion was still running when it arrived)
    with proc:
        for line in proc.stderr:
            seen.append((line.rstrip("\n"), proc.poll() is None))
        summary = proc.stdout.read()
    assert proc.returncode == 0, seen
    assert summary.startswith(f"{tmp_path / 'out'}: 600 samples")
    partial = [(m, running) for line, running in seen if (m := LINE.match(line)) and 0 < int(m[1]) < 600]
    assert partial, seen  # a count short of the total: written while the work went on, not after it
    assert all(m[2] == "600" for m, _ in partial) and partial[0][1], seen
    assert re.match(r"convert lmdb: 600/600 samples \(100%\), [\d,]+ samples/s; done in ", seen[-1][0]), seen
    assert not any("\r" in line or "it/s]" in line for line, _ in seen)  # no bar drawn into the pipe


def test_progress_line_says_count_share_rate_and_time_left():
    line = progress_line("convert lmdb", 3000, 6000, 412.3, "sample", False)
    assert line == "convert lmdb: 3,000/6,000 samples (50%), 412 samples/s, about 7 s left"
    assert progress_line("stage /x", 1.2e9, 4.8e9, 1.2e7, "B", True) == (
        "stage /x: 1.2 GB/4.8 GB (25%), 12.0 MB/s, about 5 min left"
    )
    assert progress_line("doctor", 3, None, 0.5, "step", False) == "doctor: 3 steps, 0 steps/s"
    assert progress_line("x", 9995, 10000, 1000, "row", False).endswith("(99%), 1,000 rows/s, less than 1 s left")


def run_bar(seconds: float, total: int = 20, **kwargs) -> None:
    with tqdm(total=total, desc="job", unit="sample", disable=bar_disabled(True), **kwargs) as bar:
        for _ in range(total):
            time.sleep(seconds / total)
            bar.update(1)


def test_lines_come_at_the_interval_and_a_short_job_logs_none(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dali_pipes.progress")
    monkeypatch.setenv(INTERVAL_ENV, "0.1")
    run_bar(0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert 3 <= len(lines) <= 6, lines  # about one each 0.1 s of 0.5 s, then the last
    assert lines[-1].startswith("job: 20/20 samples (100%)") and "done in" in lines[-1], lines
    caplog.clear()
    run_bar(0.02)  # done before the first interval: as quiet as before
    assert caplog.records == []


def test_the_last_line_of_a_bar_without_total_or_stopped_short_is_its_final_one(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dali_pipes.progress")
    monkeypatch.setenv(INTERVAL_ENV, "0.01")
    for total in (None, 100):  # no total known; a total the job did not reach
        caplog.clear()
        bar = tqdm(total=total, desc="job", unit="sample", disable=None, file=_NotATerminal())
        for _ in range(5):
            time.sleep(0.02)
            bar.update(1)
        time.sleep(0.02)  # an interval has passed again when it closes
        bar.close()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) >= 2 and ("done in" in lines[-1] or "stopped after" in lines[-1]), lines
        assert sum("done in" in line or "stopped after" in line for line in lines) == 1, lines


class _NotATerminal:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_interval_variable_turns_lines_off(monkeypatch, caplog, value):
    caplog.set_level(logging.INFO, logger="dali_pipes.progress")
    monkeypatch.setenv(INTERVAL_ENV, value)
    run_bar(0.2)
    assert caplog.records == []


def test_a_bad_interval_is_named_once_and_the_default_used(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dali_pipes.progress")
    monkeypatch.setenv(INTERVAL_ENV, "every minute")
    run_bar(0.01)
    run_bar(0.01)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"{INTERVAL_ENV}='every minute': not a number of seconds")


def test_on_a_terminal_the_bar_is_tqdms_and_no_line_is_logged(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dali_pipes.progress")
    monkeypatch.setenv(INTERVAL_ENV, "0.01")
    leader, follower = os.openpty()
    with open(follower, "w") as terminal:
        run_bar(0.1, file=terminal)
    drawn = ""
    try:
        while select.select([leader], [], [], 0.5)[0]:
            drawn += os.read(leader, 65536).decode()
    except OSError:  # EIO: the terminal's other end is closed and all it held was read
        pass
    os.close(leader)
    assert "\r" in drawn and "20/20" in drawn and caplog.records == []


def test_staging_and_verifying_log_lines_too(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dali_pipes.progress")
    monkeypatch.setenv(INTERVAL_ENV, "1e-9")  # a line at every update: these jobs take milliseconds
    source = write_dataset(tmp_path / "src", 30, fmt="tfrecord")
    stage_dataset(source, tmp_path / "dest", verify=True, workers=1, progress=True)
    assert verify_dataset(tmp_path / "dest", progress=True).ok
    jobs = {r.getMessage().split(":")[0] for r in caplog.records}
    assert {f"stage {tmp_path / 'dest'}", "verify staged", "verify"} <= jobs, jobs


def test_every_bar_of_the_package_is_made_where_the_rule_is():
    """No module makes a bar with tqdm's own class: each takes dali_pipes.dataset.progress's, so that the rule
    for logs holds for every long job, present and future."""
    own = re.compile(r"^\s*(from tqdm(\.\w+)* import|import tqdm)", re.MULTILINE)
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("dali_pipes", "converters")
        for path in (ROOT / package).rglob("*.py")
        if own.search(path.read_text(encoding="utf-8")) and path != ROOT / "dali_pipes/dataset/progress.py"
    ]
    assert not offenders, f"make bars with dali_pipes.dataset.progress.tqdm, not tqdm's own: {offenders}"
