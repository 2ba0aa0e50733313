"""The README's "Your own pipeline" example, run as written on a real converted dataset."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

from loader_helpers import write_dataset

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    found = re.search(r"<!-- readme-spec -->\n```python\n(.*?)```", text, re.S)
    assert found, "README.md lost its <!-- readme-spec --> example"
    return found[1]


def test_the_readme_custom_spec_runs_as_written_and_yields_what_it_says(tmp_path):
    dataset = write_dataset(tmp_path / "ds", 20, samples_per_shard=8)
    # A module of its own, as a user's script is (dataclasses look their class's module up).
    module = types.ModuleType("readme_example")
    module.dataset = str(dataset)
    sys.modules[module.__name__] = module
    try:
        exec(compile(readme_example(), str(README), "exec"), module.__dict__)  # its asserts check the shapes
    finally:
        del sys.modules[module.__name__]
    namespace = module.__dict__
    loader = namespace["loader"]
    assert len(loader) == 3  # 20 samples in batches of 8, the last padded
    spec = namespace["GreyThumbnails"]()
    assert spec.required_fields == ("image", "label") and loader.shuffle is True
