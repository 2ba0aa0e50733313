"""The shape of the code, read from its source with ``ast`` (nothing here imports the modules it checks).

What counts as an import: every ``import`` and ``from ... import`` statement in a
module, at module level and inside functions alike (a function-level import still
ties the two modules together; it only defers the cost), including those under
``if TYPE_CHECKING:``. ``from package import name`` counts as importing the
submodule ``package.name`` when there is one, else the package itself. The
implicit import of a parent package's ``__init__`` that Python performs for
``import a.b`` is not counted: it is not written in the source.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dali_pipes", "converters")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60

#: The layers, top to bottom. A module may import its own package and anything in a lower layer, never a
#: layer above nor another package of its own layer; only the tools (the first layer) may use one another.
#: The data's way reads upwards: the on-disk contract, object storage it may lie in, the stores that read it and the sampling rules, the
#: staging and the DALI graphs, the loader (and, beside it, the converters, which must not touch it), the public
#: API, the tools. Every package must be in one (a new one is placed here on purpose).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dali_pipes.cli", "dali_pipes.bench", "dali_pipes.selftest", "dali_pipes.examples", "dali_pipes.__main__",
     "converters.__main__"),
    ("dali_pipes", "dali_pipes.convert", "dali_pipes.dropin"),
    ("dali_pipes.loading", "converters"),
    ("dali_pipes.staging", "dali_pipes.pipelines"),
    ("dali_pipes.stores", "dali_pipes.sampling"),
    ("dali_pipes.remote",),
    ("dali_pipes.dataset",),
    ("dali_pipes.settings", "dali_pipes._version", "dali_pipes.sample_data"),
)  # fmt: skip

#: Within the tools' layer, packages that must never import the second of the pair: the command line calls the
#: benchmarks, and what the benchmarks need lives in them or below, never in the command line.
ONE_WAY: tuple[tuple[str, str], ...] = (("dali_pipes.bench", "dali_pipes.cli"),)

#: The only modules at the package root besides the subpackages: everything else belongs in one.
ROOT_MODULES = {"__init__", "__main__", "_version", "settings", "convert"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that ``name`` names: itself, or the nearest enclosing module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(filter(None, (_known(alias.name, modules) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                target = f"{origin}.{alias.name}"
                found.add(target if target in modules else _known(origin, modules))
    found.discard(None)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _sources()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package(name: str) -> str:
    """The unit a layer lists: ``converters.__main__`` and ``dali_pipes`` themselves, else the top package."""
    if name in ("converters.__main__", "dali_pipes"):
        return name
    if name.startswith("converters"):
        return "converters"
    return ".".join(name.split(".")[:2])


def _layer(name: str) -> int | None:
    package = _package(name)
    return next((depth for depth, layer in enumerate(LAYERS) if package in layer), None)


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that climbs a layer or crosses to another package of the same layer (tools excepted, but for
    the pairs of ONE_WAY)."""
    wrong = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = _layer(name), _layer(target)
            if here is None or there is None or _package(name) == _package(target):
                continue
            if there < here or (there == here and (here != 0 or (_package(name), _package(target)) in ONE_WAY)):
                wrong.append(f"{name} imports {target}")
    return wrong


def _loose_root_modules(modules: dict[str, Path]) -> list[str]:
    return sorted(
        name
        for name, path in modules.items()
        if name.startswith("dali_pipes.") and path.parent.name == "dali_pipes" and path.stem not in ROOT_MODULES
    )


def test_the_checker_sees_a_cycle_and_a_submodule_import():
    # The rules below are only as good as the graph: a planted loop must be found.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    assert "dali_pipes.settings" in graph["dali_pipes.loading.options"]  # a function-level import counts
    assert "dali_pipes.loading.lifetime" in graph["dali_pipes.loading.loader"]  # `from dali_pipes.loading import x`
    assert "dali_pipes.sampling" in graph["dali_pipes.staging.ramcache"]  # a package's __init__ counts


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "modules that import each other (directly or round a loop):\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_every_module_is_in_a_layer():
    assert _layer("dali_pipes.newthing.reader") is None and _layer("dali_pipes.loading.loader") == 2  # planted
    unplaced = sorted(name for name in _graph() if _layer(name) is None)
    assert not unplaced, f"modules whose package is in no layer of LAYERS (place it there): {unplaced}"


def test_the_layer_rule_finds_planted_violations():
    planted = {
        "dali_pipes.pipelines.ops": {"dali_pipes.loading.sources", "dali_pipes.dataset.outputs"},  # climbs
        "dali_pipes.staging.stage": {"dali_pipes.pipelines.base", "dali_pipes.staging.tmpfs"},  # same layer
        "converters.runner": {"dali_pipes", "dali_pipes.loading.loader", "dali_pipes.stores.base"},  # the loader
        "dali_pipes.cli.demo": {"dali_pipes.bench.baselines", "converters.runner"},  # tools may use tools
        "dali_pipes.bench.suites": {"dali_pipes.cli.show", "dali_pipes.selftest"},  # but never bench -> cli
    }
    assert _layer_violations(planted) == [
        "converters.runner imports dali_pipes",
        "converters.runner imports dali_pipes.loading.loader",
        "dali_pipes.bench.suites imports dali_pipes.cli.show",
        "dali_pipes.pipelines.ops imports dali_pipes.loading.sources",
        "dali_pipes.staging.stage imports dali_pipes.pipelines.base",
    ]


def test_no_import_climbs_a_layer():
    wrong = _layer_violations(_graph())
    assert not wrong, "imports against the layers of LAYERS (move the shared code down):\n" + "\n".join(wrong)


def test_the_root_holds_only_the_subpackages_and_its_few_modules():
    planted = {"dali_pipes.stage": ROOT / "dali_pipes" / "stage.py", "dali_pipes.staging.stage": ROOT / "x" / "y.py"}
    assert _loose_root_modules(planted) == ["dali_pipes.stage"]
    loose = _loose_root_modules(_sources())
    assert not loose, f"modules at the package root that belong in a subpackage: {loose}"


def test_importing_the_converters_does_not_load_the_loader():
    # What the source says (above) and what Python does: `import dali_pipes.dataset.manifest` runs the package's
    # __init__, which must not pull in the loader for a conversion.
    code = "import sys, converters.runner, converters.merge; print('dali_pipes.loading.loader' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "False"


def _long_file(where: str, text: str) -> dict[str, int]:
    n = len(text.splitlines())
    return {where: n} if n > MAX_FILE_LINES else {}


def _long_functions(where: str, text: str) -> dict[str, int]:
    """``"where::qualified name"`` -> length of each function over MAX_FUNCTION_LINES, methods and nested ones too."""
    found: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualified = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    # From the def line (decorators excluded) to the last line, docstring included.
                    length = child.end_lineno - child.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found[f"{where}::{qualified}"] = length
                walk(child, qualified + ".")

    walk(ast.parse(text, where), "")
    return found


def _texts() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in _sources().values()}


def test_the_length_rules_find_planted_violations():
    body = "".join(f"        x = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    planted = f"class A:\n    def ok(self):\n        pass\n\n    def long(self):\n{body}        return x\n"
    assert _long_functions("p.py", planted) == {"p.py::A.long": MAX_FUNCTION_LINES + 1}
    assert _long_file("p.py", "\n" * MAX_FILE_LINES) == {}
    assert _long_file("p.py", "\n" * (MAX_FILE_LINES + 1)) == {"p.py": MAX_FILE_LINES + 1}


def test_no_source_file_is_too_long():
    long = {k: v for where, text in _texts().items() for k, v in _long_file(where, text).items()}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by job): {long}"


def test_no_function_is_too_long():
    long = {k: v for where, text in _texts().items() for k, v in _long_functions(where, text).items()}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (cut them into steps): {long}"


#: The loader's core stays small enough to change safely: its constructor's parameters (a DataLoader's
#: own, then the option groups of loading/config.py) and the length of loader.py.
MAX_LOADER_PARAMETERS = 10
MAX_LOADER_LINES = 350


def _parameters(text: str, class_name: str, method: str) -> list[str]:
    """The parameter names of ``class_name.method`` in ``text``, ``self`` left out."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for child in node.body:
                if isinstance(child, ast.FunctionDef) and child.name == method:
                    a = child.args
                    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
                    return names[1:]
    raise AssertionError(f"{class_name}.{method} not found")


def test_the_parameter_rule_counts_every_kind_of_parameter():
    planted = "class A:\n    def __init__(self, a, /, b, *args, c, **kw):\n        pass\n"
    assert _parameters(planted, "A", "__init__") == ["a", "b", "c", "args", "kw"]


def test_the_loader_core_stays_small():
    text = (ROOT / "dali_pipes" / "loading" / "loader.py").read_text(encoding="utf-8")
    names = _parameters(text, "DALILoader", "__init__")
    assert len(names) <= MAX_LOADER_PARAMETERS, f"DALILoader takes {len(names)} parameters: group options ({names})"
    assert len(text.splitlines()) < MAX_LOADER_LINES, "loading/loader.py grew: move a job into its own module"
