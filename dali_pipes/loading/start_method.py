"""How DALI's Python workers start: ``fork`` while CUDA is untouched, ``spawn`` after.

DALI refuses to fork once the CUDA driver is initialised in the process
(``nvidia/dali/_multiproc/pool.py``: "Cannot fork a process when the CUDA has
been initialized"), and its test is ``nvidia.dali.backend.IsDriverInitialized()``.
``torch.cuda.is_available()`` already initialises the driver, so on a CUDA
machine nearly every process has; :func:`choose_start_method` asks DALI's own
test, not torch's ``is_initialized()`` (which only says whether torch made a
context).

Spawn normally re-runs the main script in every worker (as ``__mp_main__``), so
a script without an ``if __name__ == "__main__":`` guard would build a loader,
or call ``dist.init_process_group``, again in each worker. DALI's workers need
nothing from the script: what they unpickle (the loader's source, its store,
DALI's own worker arguments) is dali_pipes' and DALI's code. So while the pool
starts, :func:`main_hidden_from_spawn` hides the main module's ``__file__`` and
``__spec__``, which is how ``multiprocessing`` decides what to re-run
(``multiprocessing.spawn.get_preparation_data``): the workers run none of the
script, guarded or not.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

__all__ = ["choose_start_method", "driver_initialized", "main_hidden_from_spawn"]

_UNSET = object()


def driver_initialized() -> bool:
    """True when the CUDA driver is initialised in this process: DALI's own test before it forks."""
    from nvidia.dali import backend

    test = getattr(backend, "IsDriverInitialized", None)
    if test is None:  # a DALI without the test: torch's (weaker) one is all there is
        import torch

        return torch.cuda.is_initialized()
    return bool(test())


def choose_start_method(requested: str | None) -> str:
    """``requested`` (checked by :class:`~dali_pipes.RunOptions`), or by default ``"spawn"`` when the CUDA driver
    is initialised and ``"fork"`` otherwise."""
    if requested is not None:
        return requested
    # Fork is cheaper to start, and needs no guard in the user's script; DALI refuses it after cuInit.
    return "spawn" if driver_initialized() else "fork"


@contextlib.contextmanager
def main_hidden_from_spawn(start_method: str | None) -> Iterator[None]:
    """While DALI starts its workers with ``"spawn"``, keep them from re-running the main script.

    ``multiprocessing`` re-runs ``__main__`` in a spawned child from its
    ``__spec__.name`` (``python -m``) or else its ``__file__``; with both hidden it
    re-runs nothing. Restored on exit; a no-op for any other start method.
    """
    main = sys.modules.get("__main__")
    if start_method != "spawn" or main is None:
        yield
        return
    saved = {name: main.__dict__.get(name, _UNSET) for name in ("__file__", "__spec__")}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _UNSET:
                main.__dict__.pop(name, None)
            else:
                main.__dict__[name] = value
