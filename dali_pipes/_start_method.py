"""How DALI's Python workers start: ``fork`` while CUDA is untouched, ``spawn`` after.

DALI refuses to fork once the CUDA driver is initialised in the process
(``nvidia/dali/_multiproc/pool.py``: "Cannot fork a process when the CUDA has
been initialized"), and its test is ``nvidia.dali.backend.IsDriverInitialized()``.
``torch.cuda.is_available()`` already initialises the driver, so on a CUDA
machine nearly every process has; :func:`choose_start_method` asks DALI's own
test, not torch's ``is_initialized()`` (which only says whether torch made a
context).

Spawn re-imports the main script in every worker. A script that builds its
loader at import time (no ``if __name__ == "__main__":`` guard) would build it
again in each worker, which then starts workers of its own while it is still
starting: :func:`check_spawn_safe` refuses that up front with an error that
says what to change.
"""

from __future__ import annotations

import ast
import multiprocessing
import sys
from pathlib import Path
from types import FrameType

__all__ = ["MISSING_GUARD", "check_spawn_safe", "choose_start_method", "driver_initialized"]

MISSING_GUARD = (
    "DALI's Python workers start with 'spawn' here (the CUDA driver is initialised, and DALI cannot fork "
    "then), and spawn re-imports the main script in every worker. {where} builds a DALILoader while that "
    "script is imported, so each worker would build one again. Put the script's top-level code under "
    "'if __name__ == \"__main__\":' (or in a main() called from there)."
)


def driver_initialized() -> bool:
    """True when the CUDA driver is initialised in this process: DALI's own test before it forks."""
    from nvidia.dali import backend

    test = getattr(backend, "IsDriverInitialized", None)
    if test is None:  # a DALI without the test: torch's (weaker) one is all there is
        import torch

        return torch.cuda.is_initialized()
    return bool(test())


def choose_start_method(requested: str | None) -> str:
    """``requested``, or by default ``"spawn"`` when the CUDA driver is initialised and ``"fork"`` otherwise."""
    if requested not in (None, "fork", "spawn"):
        raise ValueError(f"py_start_method must be 'fork', 'spawn' or None, got {requested!r}")
    if requested is not None:
        return requested
    # Fork is cheaper to start, and needs no guard in the user's script; DALI refuses it after cuInit.
    return "spawn" if driver_initialized() else "fork"


def check_spawn_safe() -> None:
    """Raise a clear ``RuntimeError`` when spawned workers would build this loader again.

    Two cases: this process is itself a spawned worker importing the main script
    (so the script has no guard), or the main script's top-level code, outside an
    ``if __name__ == "__main__":`` block, is what is building the loader now.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(MISSING_GUARD.format(where="The main script (imported again in a spawned worker)"))
    frame = _main_script_frame()
    if frame is None:
        return
    path = Path(frame.f_code.co_filename)
    if not _under_main_guard(path, frame.f_lineno):
        raise RuntimeError(MISSING_GUARD.format(where=f"{path}, line {frame.f_lineno},"))


def _main_script_frame() -> FrameType | None:
    """The top-level frame of the main script on this call stack, if spawn would re-run that script."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__file__", None) is None:
        return None  # interactive, `python -c` or a notebook: spawn re-imports nothing
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None  # `python -m package`: spawn does not re-run a package's __main__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            return frame
        frame = frame.f_back
    return None


def _under_main_guard(path: Path, line: int) -> bool:
    """Whether ``line`` of ``path`` lies inside an ``if __name__ == "__main__":`` block (True if unreadable)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return True  # cannot tell: leave it to multiprocessing's own check
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    values = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]
