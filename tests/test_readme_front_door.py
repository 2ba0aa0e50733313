"""The README is a front door (issue 39): short, the first hour first, CI's commands word for word, no dead links.

The long material it once held lives in the package's own README.md files; these tests keep the README
pointing at them, and its layout section naming only modules that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The Markdown pages the README sends readers to (their links are checked too).
DOCS = (
    README,
    ROOT / "converters" / "README.md",
    ROOT / "dali_pipes" / "bench" / "README.md",
    ROOT / "dali_pipes" / "pipelines" / "README.md",
    ROOT / "dali_pipes" / "remote" / "README.md",
    ROOT / "dali_pipes" / "selftest" / "README.md",
    ROOT / "dali_pipes" / "staging" / "README.md",
    ROOT / "tests" / "README.md",
)
MAX_LINES = 600
FIRST_HOUR_LINES = 120
#: What a new user runs in the first hour, in the order the README shows it.
FIRST_HOUR = (
    "pip install",
    "dali-pipes demo",
    "demo --data",
    "dali-pipes convert",
    "dali-pipes inspect",
    "dali-pipes verify",
    "dali-pipes show",
    "<!-- readme-quickstart -->",
    "torchrun",
)


def first_hour_problems(text: str) -> list[str]:
    """What is wrong with a README's length and first lines (empty when nothing is)."""
    lines = text.splitlines()
    problems = [f"{len(lines)} lines, more than {MAX_LINES}"] if len(lines) > MAX_LINES else []
    head = "\n".join(lines[:FIRST_HOUR_LINES])
    where = {needle: head.find(needle) for needle in FIRST_HOUR}
    problems += [f"{needle!r} is not in the first {FIRST_HOUR_LINES} lines" for needle, at in where.items() if at < 0]
    found = [needle for needle in FIRST_HOUR if where[needle] >= 0]
    if found != sorted(found, key=where.get):
        problems.append(f"the first-hour steps are out of order: {sorted(found, key=where.get)}")
    script = re.search(r"<!-- readme-quickstart -->\n```python\n.*?```", head, re.S)
    if script is None:
        problems.append(f"the 20-line training script does not end within the first {FIRST_HOUR_LINES} lines")
    return problems


def test_the_readme_is_short_and_opens_with_the_first_hour():
    assert first_hour_problems(README.read_text()) == []


def test_the_check_finds_a_long_readme_and_a_late_first_hour():
    script = "<!-- readme-quickstart -->\n```python\nprint()\n```\n"
    good = "pip install x\ndali-pipes demo --data d\ndali-pipes convert\ndali-pipes inspect\n"
    good += f"dali-pipes verify\ndali-pipes show\n{script}torchrun\n"
    assert first_hour_problems(good) == []
    too_long = len(good.splitlines()) + MAX_LINES
    assert first_hour_problems(good + "more\n" * MAX_LINES) == [f"{too_long} lines, more than {MAX_LINES}"]
    late = "filler\n" * FIRST_HOUR_LINES + good
    assert len(first_hour_problems(late)) == len(FIRST_HOUR) + 1
    swapped = good.replace("torchrun", "TORCH").replace("pip install x", "torchrun\npip install x")
    assert any("out of order" in p for p in first_hour_problems(swapped))


def test_the_readme_holds_ci_commands_word_for_word():
    """``.ci/run`` runs the README's "Set up and run" commands: each of its command lines is a line of the README."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = ci[next(i for i, line in enumerate(ci) if line.startswith('cd "$work/dali-pipes"')) + 1 :]
    commands = [line for line in commands if line.strip() and not line.startswith("#")]
    assert len(commands) == 4, commands
    readme = README.read_text().splitlines()
    start = readme.index("## Set up and run")
    section = readme[start : next(i for i in range(start + 1, len(readme)) if readme[i].startswith("## "))]
    block = section[section.index("```bash") + 1 :]
    assert block[: len(commands)] == commands and block[len(commands)] == "```"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' comment in a code block is no heading
    return {_slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_anchors_are_made_as_github_makes_them():
    assert _slug("Options every `convert` takes") == "options-every-convert-takes"
    assert _slug("The recipe: resolution schedules, MixUp/CutMix, RandomErasing") == (
        "the-recipe-resolution-schedules-mixupcutmix-randomerasing"
    )
    assert _slug("What is tested, and speed") == "what-is-tested-and-speed"


def test_every_relative_link_of_the_readme_and_its_pages_leads_somewhere():
    broken = []
    for page in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https://...
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken


def test_the_layout_names_only_modules_that_exist_and_every_subpackage():
    text = README.read_text()
    layout = re.search(r"## Layout of the code\n.*?```\n(.*?)```", text, re.S)
    assert layout, "README.md lost its layout section"
    named = set()
    for line in layout[1].splitlines():
        entry = re.match(r"[\s│├└─]*(\S+)", line)
        if entry and entry[1] not in ("dali_pipes/",):
            top = entry[1]
            base = ROOT / ("dali_pipes" if line.startswith(("│", "├", "└")) else "") / top
            assert base.exists(), f"the layout names {top}, which is not in the tree"
            named.add(top.rstrip("/"))
            if top == "__init__.py":  # 'beside it convert.py (...), __main__.py, ...'
                for module in re.findall(r"\b(\w+\.py)\b", line):
                    assert (ROOT / "dali_pipes" / module).exists(), module
            if top == "converters/":  # '(sources/)', '(writers/)'
                for folder in re.findall(r"\((\w+)/\)", line):
                    assert (ROOT / "converters" / folder).is_dir(), folder
    packages = {p.parent.name for p in (ROOT / "dali_pipes").glob("*/__init__.py")}
    assert packages <= named, f"subpackages the layout leaves out: {sorted(packages - named)}"
