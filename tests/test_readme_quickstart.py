"""The README's 20-line training script, run as a user would: converted with the CLI, then ``python train.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from converters.synth import make_imagefolder

from test_convert import run_cli

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_training_script_runs_as_written(tmp_path):
    found = re.search(r"<!-- readme-quickstart -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert found, "README.md lost its <!-- readme-quickstart --> script"
    assert len([line for line in found[1].splitlines() if line.strip()]) <= 20, "the quick-start script grew"
    script = tmp_path / "train.py"
    script.write_text(found[1])
    photos = make_imagefolder(tmp_path / "photos" / "train", 70, size=(96, 72), classes=3)
    run_cli("convert", "imagefolder", photos, tmp_path / "shards" / "train", "--workers", "1", "--no-progress")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "shards" / "train")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = re.findall(r"^epoch (\d): (\d+) batches, loss ([\d.]+)$", proc.stdout, re.M)
    assert [(int(e), int(b)) for e, b, _ in epochs] == [(0, 3), (1, 3)], proc.stdout  # 70 samples, batches of 32
