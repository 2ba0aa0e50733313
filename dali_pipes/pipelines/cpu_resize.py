"""A faster bilinear resize for the CPU pipelines: a Numba kernel inside the DALI graph.

DALI's CPU ``fn.resize`` is the costliest step of the CPU training graph, and
slower than PyTorch's or PIL's resize of the same crops (the figures, with their
commands, are in ``dali_pipes/bench/README.md``). This module resizes with the
same filter as PIL's and torchvision's bilinear resize (a triangle filter
widened by the scale when shrinking with ``antialias``, plain bilinear
interpolation otherwise; pixel centres at half-integers), compiled by Numba and
run by DALI's ``NumbaFunction`` operator on the pipeline's threads, within one
level of PIL's pixels.

Used by :func:`~dali_pipes.pipelines.ops.resize_to` on the CPU for a fixed
square size and the bilinear filter, when Numba imports (``pip install
"dali-pipes[cpu]"``) and ``DALI_PIPES_CPU_RESIZE`` is not ``dali``; otherwise
DALI's resize runs. The kernels are
compiled once per process (a few seconds, cached on disk by Numba), and one
operator per size is kept for every pipeline the process builds. The kernels
themselves are in :mod:`~dali_pipes.pipelines.cpu_resize_kernels`, which imports Numba.

It is a speed-up and never takes a job down: if Numba is installed but fails to
import (torchvision's DDP scripts replace ``builtins.print``, which Numba's import
checks: see :func:`_python_print`) or to compile, one warning names the cause and
``DALI_PIPES_CPU_RESIZE``, and DALI's resize runs for the rest of the process.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.util
import logging
import os
import threading
from types import BuiltinFunctionType
from typing import Any, Iterator, Optional

log = logging.getLogger(__name__)

_disabled = 0  # > 0 inside dali_resize_only()
_failure: Optional[str] = None  # why Numba failed in this process (said once); DALI's resize runs from then on
_lock = threading.Lock()  # one import, one compile per size and one warning, whichever thread builds a pipeline


#: ``DALI_PIPES_CPU_RESIZE=dali`` keeps DALI's resize (no compile: for short jobs, where the first CPU loader's
#: seconds of compiling outweigh what it saves); ``numba`` (the default) uses this one where Numba imports.
ENV = "DALI_PIPES_CPU_RESIZE"
CHOICES = ("numba", "dali")


def available() -> bool:
    """True when the Numba resize runs: Numba imports (the ``cpu`` extra), :data:`ENV` allows it, it has not
    failed in this process, and not inside :func:`dali_resize_only`."""
    choice = os.environ.get(ENV, "numba")
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice == "numba" and _disabled == 0 and _failure is None and _imports()


@contextlib.contextmanager
def dali_resize_only() -> Iterator[None]:
    """Pipelines defined inside use DALI's own ``fn.resize`` (the plain-DALI rows of the benchmarks)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def resize(images: Any, size: int, *, antialias: bool) -> Any:
    """``images`` (uint8 HWC, 3 channels, on the CPU) resized to ``size`` x ``size`` by the Numba kernel.

    None when the kernel fails to compile: said once (:func:`_fall_back`), and the caller
    then runs DALI's resize, as every later pipeline of the process does.
    """
    import nvidia.dali.fn as fn

    with _lock:
        if _failure is not None:
            return None
        try:
            operator = _operator(size, antialias)
        except Exception as exc:  # noqa: BLE001 - a speed-up must never take the job down
            _fall_back(f"compile (to {size}x{size})", exc)
            return None
    # NumbaFunction's output has no layout; the operators after it (AutoAugment's merges, reductions) need "HWC".
    return fn.reshape(operator(images), layout="HWC")


@functools.lru_cache(maxsize=None)
def _imports() -> bool:
    """True when Numba, DALI's Numba operator and the kernels import (tried once per process).

    False, silently, where Numba is not installed (no ``cpu`` extra: DALI's resize, as
    documented); False with one warning (:func:`_fall_back`) for any other failure.
    """
    with _lock:
        if _failure is not None:  # another thread's try failed (and said so)
            return False
        try:
            if importlib.util.find_spec("numba") is None:
                return False
            with _python_print():
                import numba  # noqa: F401
                from nvidia.dali.plugin.numba.experimental import NumbaFunction  # noqa: F401

                from dali_pipes.pipelines import cpu_resize_kernels  # noqa: F401  (Numba sets up its disk cache here)
        except Exception as exc:  # noqa: BLE001 - a speed-up must never take the job down
            _fall_back("import", exc)
            return False
    return True


def _fall_back(step: str, exc: BaseException) -> None:
    """Turn the Numba resize off for the rest of the process, saying once why and what runs instead."""
    global _failure
    _failure = f"{type(exc).__name__}: {exc}"
    log.warning(
        "the Numba CPU resize failed to %s (%s); DALI's CPU resize runs instead (the same filter, slower). "
        "Set %s=dali to choose DALI's resize and skip this warning.",
        step,
        _failure,
        ENV,
    )


@contextlib.contextmanager
def _python_print() -> Iterator[None]:
    """Python's own ``print`` in ``builtins`` while Numba imports; the current one back afterwards.

    Numba's first import registers ``builtins.print`` and insists that it is reachable as
    ``module.name`` (``register_global`` in ``numba/core/typing/templates.py``). torchvision's
    reference ``utils.setup_for_distributed``, run by its DDP scripts before the first loader
    is built, replaces it with a function nested in its ``utils`` module, which is not:
    ``import numba`` raised ``AttributeError: module 'utils' has no attribute 'print'``.
    Where no original can be found (a replacement that keeps none) nothing changes, and the
    import fails and falls back as any other failure does. While Numba imports (about a second,
    once per process) another thread's ``print`` is Python's own, unsilenced.
    """
    current = builtins.print
    original = _original_print(current)
    if original is None or original is current:
        yield
        return
    builtins.print = original
    try:
        yield
    finally:
        builtins.print = current


def _original_print(current: Any) -> Any:
    """Python's built-in ``print``: ``current`` itself, or the one a replacement holds in its closure (as
    torchvision's does) or as ``__wrapped__``, through a few layers of replacements; None if there is none."""
    pending, seen = [current], set()
    while pending and len(seen) < 32:  # a bound: replacements may refer to each other
        candidate = pending.pop()
        if id(candidate) in seen:
            continue
        seen.add(id(candidate))
        if isinstance(candidate, BuiltinFunctionType):
            if candidate.__self__ is builtins and candidate.__name__ == "print":
                return candidate
            continue
        for cell in getattr(candidate, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                pending.append(cell.cell_contents)
        wrapped = getattr(candidate, "__wrapped__", None)
        if wrapped is not None:
            pending.append(wrapped)
    return None


@functools.lru_cache(maxsize=None)
def _operator(size: int, antialias: bool) -> Any:
    # One operator object serves every pipeline of the process: DALI compiles its
    # Numba wrappers (seconds) when the operator is made, not when it is called.
    import nvidia.dali.types as types
    from nvidia.dali.plugin.numba.experimental import NumbaFunction

    from dali_pipes.pipelines.cpu_resize_kernels import resize_uint8_hwc3 as kernel

    def setup(outs, ins):  # the output shape of every sample of the batch
        out = outs[0]
        for i in range(len(out)):
            out[i][0] = size
            out[i][1] = size
            out[i][2] = 3

    def run(out, inp):
        kernel(inp, out, antialias)

    log.debug("compiling the Numba resize to %dx%d (antialias=%s)", size, size, antialias)
    return NumbaFunction(
        run_fn=run,
        setup_fn=setup,
        out_types=[types.UINT8],
        in_types=[types.UINT8],
        outs_ndim=[3],
        ins_ndim=[3],
        batch_processing=False,  # per sample, on the pipeline's threads
        device="cpu",
    )
