"""Last month's scripts (issue 54 item 18): a keyword ``DALILoader`` took before 0.2.0 is answered with its new
home, in one ``TypeError`` naming each moved keyword given; the version and the changelog say it changed."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dali_pipes import BatchFormat, DALILoader, DataOptions, RunOptions
from dali_pipes.loading.options import FORMER_KEYWORDS

from loader_helpers import TinySpec

ROOT = Path(__file__).resolve().parents[1]
HOMES = {"run=RunOptions": RunOptions, "data=DataOptions": DataOptions, "batch_format=BatchFormat": BatchFormat}
#: Values as last month's scripts passed them (never read: the refusal comes first).
FORMER_VALUES = {"storage_options": {"secret": "CANARY-not-a-real-key"}, "with_index": True, "cache": "ram"}


@pytest.mark.parametrize("name", sorted(FORMER_KEYWORDS))
def test_a_former_keyword_names_its_new_home(tmp_path, name):
    with pytest.raises(TypeError) as moved:
        DALILoader(tmp_path / "missing", TinySpec(), batch_size=8, **{name: FORMER_VALUES.get(name, 1)})
    message = str(moved.value)
    home = FORMER_KEYWORDS[name]
    assert f"{home}({name}=...)" in message and "CHANGELOG.md" in message and "\n" not in message
    assert "CANARY" not in message  # values are not shown: storage options hold credentials
    # The home really takes it: the table cannot send anyone to a field that does not exist.
    assert name in {field.name for field in dataclasses.fields(HOMES[home])}


def test_the_issue_s_script_and_several_keywords_at_once(tmp_path):
    with pytest.raises(TypeError) as moved:
        DALILoader(tmp_path, TinySpec(), batch_size=8, device="cpu", num_threads=2, stage_to="/x", with_index=True)
    message = str(moved.value)
    assert "device=, num_threads=, stage_to=, with_index=" in message
    assert "run=RunOptions(device=..., num_threads=...), data=DataOptions(stage_to=...)" in message
    assert "batch_format=BatchFormat(with_index=...)" in message


def test_an_unknown_keyword_is_python_s_own_error(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'devise'"):
        DALILoader(tmp_path, TinySpec(), batch_size=8, devise="cpu")


def test_the_version_says_the_api_changed_and_the_changelog_says_how_to_move():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    written = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    major, minor = (int(part) for part in written.split(".")[:2])
    assert (major, minor) >= (0, 2)  # a minor bump at least: 0.1.0 took the keywords
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"\n## {written}\n" in changelog  # every version has its section
    section = changelog.split("\n## 0.2.0\n", 1)[1].split("\n## ", 1)[0]  # the version that moved the keywords
    for name in FORMER_KEYWORDS:  # each former keyword, with its new home, in how to move
        assert re.search(rf"\b{name}\b", section), name
    assert "StreamOptions" in section and "RunOptions(" in section and "DataOptions(" in section
