"""A faster bilinear resize for the CPU pipelines: a Numba kernel inside the DALI graph (issue 38).

On two CPU cores DALI's CPU ``fn.resize`` was the costliest step of the training
graph: about 1.1 CPU ms per photo crop to 224x224, where PyTorch's antialiased
``interpolate`` took 0.23 ms and PIL's 0.86 ms. This module resizes with the
same filter as PIL's and torchvision's bilinear resize (a triangle filter
widened by the scale when shrinking with ``antialias``, plain bilinear
interpolation otherwise; pixel centres at half-integers), compiled by Numba and
run by DALI's ``NumbaFunction`` operator on the pipeline's threads: 0.31 ms per
crop on one core, within one level of PIL's pixels.

Used by :func:`~dali_pipes.pipelines.ops.resize_to` on the CPU for a fixed
square size and the bilinear filter, when Numba imports (``pip install
"dali-pipes[cpu]"``) and ``DALI_PIPES_CPU_RESIZE`` is not ``dali``; otherwise
DALI's resize runs, as before. The kernels are
compiled once per process (a few seconds, cached on disk by Numba), and one
operator per size is kept for every pipeline the process builds. The kernels
themselves are in :mod:`~dali_pipes.pipelines.cpu_resize_kernels`, which imports Numba.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Iterator

log = logging.getLogger(__name__)

_disabled = 0  # > 0 inside dali_resize_only()


#: ``DALI_PIPES_CPU_RESIZE=dali`` keeps DALI's resize (no compile: for short jobs, where the first CPU loader's
#: seconds of compiling outweigh what it saves); ``numba`` (the default) uses this one where Numba imports.
ENV = "DALI_PIPES_CPU_RESIZE"
CHOICES = ("numba", "dali")


def available() -> bool:
    """True when the Numba resize runs: Numba imports (the ``cpu`` extra), :data:`ENV` allows it, and not
    inside :func:`dali_resize_only`."""
    choice = os.environ.get(ENV, "numba")
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice == "numba" and _disabled == 0 and _imports()


@contextlib.contextmanager
def dali_resize_only() -> Iterator[None]:
    """Pipelines defined inside use DALI's own ``fn.resize`` (the plain-DALI rows of the benchmarks)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


@functools.lru_cache(maxsize=None)
def _imports() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False  # the cpu extra is not installed: DALI's resize, as documented
    try:
        from nvidia.dali.plugin.numba.experimental import NumbaFunction  # noqa: F401

        from dali_pipes.pipelines import cpu_resize_kernels  # noqa: F401  (Numba sets up its disk cache here)
    except Exception as exc:  # noqa: BLE001 - any failure of an optional speed-up falls back, said once
        log.warning("the Numba resize is unavailable (%s: %s); DALI's CPU resize runs instead", type(exc).__name__, exc)
        return False
    return True


def resize(images: Any, size: int, *, antialias: bool) -> Any:
    """``images`` (uint8 HWC, 3 channels, on the CPU) resized to ``size`` x ``size`` by the Numba kernel."""
    import nvidia.dali.fn as fn

    # NumbaFunction's output has no layout; the operators after it (AutoAugment's merges, reductions) need "HWC".
    return fn.reshape(_operator(size, antialias)(images), layout="HWC")


@functools.lru_cache(maxsize=None)
def _operator(size: int, antialias: bool) -> Any:
    # One operator object serves every pipeline of the process: DALI compiles its
    # Numba wrappers when the operator is made (about 2 s), not when it is called.
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
