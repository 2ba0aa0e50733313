"""This rank's epoch order, computed once by the loader and shared with DALI's workers through a file.

:func:`~dali_pipes.sampling.rank_indices` draws a permutation of the whole
dataset, which takes seconds on datasets of millions of samples. Computed in every
DALI worker of every rank at each epoch start, it would stall each epoch's start. Instead the loader
computes it once per epoch and writes it beside the epoch control block (a tmpfs
file in ``/dev/shm``), *before* it publishes the epoch; each worker maps the file
read-only, so the order is held once in memory whatever the worker count.

Layout: ``int64[5]`` header ``(dali_epoch, n, epoch, start, size)``, then
``int64[n]`` indices, then ``uint8[n]`` is_pad. A new epoch's plan replaces the
file by rename, so a worker still mapping the previous one keeps a valid
(unlinked) copy until it moves on.

One DALI epoch may read several training epochs in a row (segments,
:mod:`dali_pipes.loading.epoch_chain`): segment 0 is the plan file itself, segment
``k`` the file :func:`segment_path` names; each carries its training epoch,
start and output size in its header.
"""

from __future__ import annotations

import glob
import mmap
import os
from typing import NamedTuple

import numpy as np

__all__ = ["Plan", "plan_path", "read_plan", "remove_file", "remove_plan", "segment_path", "write_plan"]

_HEADER = 5


class Plan(NamedTuple):
    """One segment's order: ``indices`` and ``is_pad`` (read-only views of the mapped file) and where it stands."""

    indices: np.ndarray
    is_pad: np.ndarray
    epoch: int  # the training epoch
    start: int  # global samples of it consumed before this segment
    size: int  # the epoch's output size for a spec with a size schedule, else 0


def plan_path(control_path: str) -> str:
    """The plan file that goes with the epoch control block at ``control_path``."""
    return control_path + ".plan"


def segment_path(control_path: str, segment: int) -> str:
    """The plan file of segment ``segment`` of a DALI epoch (0: :func:`plan_path` itself)."""
    base = plan_path(control_path)
    return f"{base}.{segment}" if segment else base


def write_plan(
    path: str,
    dali_epoch: int,
    indices: np.ndarray,
    is_pad: np.ndarray,
    *,
    epoch: int = 0,
    start: int = 0,
    size: int = 0,
) -> None:
    """Write a plan of DALI epoch ``dali_epoch`` atomically (a temporary file renamed into place)."""
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    flags = np.ascontiguousarray(is_pad, dtype=np.uint8)
    if len(flags) != len(indices):
        raise ValueError(f"plan of {len(indices)} indices has {len(flags)} is_pad flags")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(np.array([dali_epoch, len(indices), epoch, start, size], dtype=np.int64).tobytes())
        f.write(indices.tobytes())
        f.write(flags.tobytes())
    os.replace(tmp, path)


def read_plan(path: str, dali_epoch: int) -> Plan | None:
    """The :class:`Plan` in ``path`` if it is one of DALI epoch ``dali_epoch``.

    ``None`` when there is no plan file or it holds another epoch's plan: a source used
    without a loader then computes the order itself; a copy in a reader process, which
    holds no weights or mixture, stops if its epoch is over and else says no plan was published.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER * 8:
                return None
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        return None
    written_for, n, epoch, start, out_size = (int(v) for v in np.frombuffer(mapped, dtype=np.int64, count=_HEADER))
    if written_for != dali_epoch or size != _HEADER * 8 + 9 * n:
        return None
    indices = np.frombuffer(mapped, dtype=np.int64, count=n, offset=_HEADER * 8)
    is_pad = np.frombuffer(mapped, dtype=np.uint8, count=n, offset=_HEADER * 8 + 8 * n).view(bool)
    return Plan(indices, is_pad, epoch, start, out_size)


def remove_plan(path: str) -> None:
    """Delete the plan file and its segments' files, if any."""
    for name in (path, *glob.glob(glob.escape(path) + ".*")):
        remove_file(name)


def remove_file(path: str) -> None:
    """Delete ``path`` if it is there (a worker still mapping it keeps its copy)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
