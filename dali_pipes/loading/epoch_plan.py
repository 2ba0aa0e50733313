"""This rank's epoch order, computed once by the loader and shared with DALI's workers through a file.

:func:`~dali_pipes.sampling.rank_indices` draws a permutation of the whole
dataset: 1.2 s at 10M samples. Computed in every DALI worker of every rank at
each epoch start, that was a stall growing with the dataset. Instead the loader
computes it once per epoch and writes it beside the epoch control block (a tmpfs
file in ``/dev/shm``), *before* it publishes the epoch; each worker maps the file
read-only, so the order is held once in memory whatever the worker count.

Layout: ``int64[2]`` header ``(dali_epoch, n)``, then ``int64[n]`` indices, then
``uint8[n]`` is_pad. A new epoch's plan replaces the file by rename, so a worker
still mapping the previous one keeps a valid (unlinked) copy until it moves on.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

__all__ = ["plan_path", "read_plan", "remove_plan", "write_plan"]

_HEADER = 2


def plan_path(control_path: str) -> str:
    """The plan file that goes with the epoch control block at ``control_path``."""
    return control_path + ".plan"


def write_plan(path: str, dali_epoch: int, indices: np.ndarray, is_pad: np.ndarray) -> None:
    """Write the plan of DALI epoch ``dali_epoch`` atomically (a temporary file renamed into place)."""
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    flags = np.ascontiguousarray(is_pad, dtype=np.uint8)
    if len(flags) != len(indices):
        raise ValueError(f"plan of {len(indices)} indices has {len(flags)} is_pad flags")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(np.array([dali_epoch, len(indices)], dtype=np.int64).tobytes())
        f.write(indices.tobytes())
        f.write(flags.tobytes())
    os.replace(tmp, path)


def read_plan(path: str, dali_epoch: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(indices, is_pad)`` of DALI epoch ``dali_epoch`` as read-only views of the mapped file.

    ``None`` when there is no plan file or it holds another epoch's plan: the
    caller then computes the order itself (a source used without a loader).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER * 8:
                return None
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        return None
    epoch, n = (int(v) for v in np.frombuffer(mapped, dtype=np.int64, count=_HEADER))
    if epoch != dali_epoch or size != _HEADER * 8 + 9 * n:
        return None
    indices = np.frombuffer(mapped, dtype=np.int64, count=n, offset=_HEADER * 8)
    is_pad = np.frombuffer(mapped, dtype=np.uint8, count=n, offset=_HEADER * 8 + 8 * n).view(bool)
    return indices, is_pad


def remove_plan(path: str) -> None:
    """Delete the plan file, if any."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
