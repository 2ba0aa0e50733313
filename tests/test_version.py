"""One version, written in pyproject.toml: the package and the command report the installed one."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import dali_pipes


def test_version_comes_from_the_installed_metadata():
    assert dali_pipes.__version__ == version("dali-pipes")


def test_the_package_writes_no_version_of_its_own():
    # One place for the version: dali_pipes/__init__.py reads it, it must not spell one out.
    text = Path(dali_pipes.__file__).read_text()
    assert f'"{version("dali-pipes")}"' not in text and f"'{version('dali-pipes')}'" not in text
    assert not re.search(
        r"""__version__\s*(?::[^=]*)?=\s*['"]\d+\.\d""", text
    )  # "0+unknown" (not installed) is no version


def test_the_metadata_is_pyproject_s_version():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert version("dali-pipes") == pyproject["project"]["version"]


def test_cli_version_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "dali_pipes.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"dali-pipes {version('dali-pipes')}"
