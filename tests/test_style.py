"""The code keeps the lint and format rules of ``[tool.ruff]`` in pyproject.toml.

Run ``ruff format . && ruff check --fix .`` to fix what this reports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["dali_pipes", "converters", "tests", "notebooks"]

pytest.importorskip("ruff", reason="ruff is in the 'test' extra")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_the_code_keeps_the_ruff_rules(command):
    run = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *CHECKED], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
