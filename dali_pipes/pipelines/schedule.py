"""Output-size schedules of the training spec: the size of every batch of an epoch as a function of the epoch.

FFCV trains ResNet-50 fastest at a low resolution that rises during training
(progressive resizing); :class:`ResolutionSchedule` is its schedule. A spec's
``size`` may also be any callable ``epoch -> size``. The loader asks the spec
for the epoch's size when the epoch starts and feeds it to the DALI graph as a
per-batch input, so a new size needs no new pipeline. Nothing here imports DALI.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Union

__all__ = ["ResolutionSchedule", "SizeSpec", "check_size_spec", "size_at"]

#: FFCV rounds the interpolated resolution to a multiple of this.
_MULTIPLE = 32

#: What a training spec's ``size`` may be: a fixed size, an FFCV-style schedule, or ``epoch -> size``.
SizeSpec = Union[int, "ResolutionSchedule", Callable[[int], int]]


@dataclass(frozen=True)
class ResolutionSchedule:
    """FFCV's progressive resizing: ``min_res`` until ``start_ramp``, ``max_res`` from ``end_ramp``.

    In between, the size is interpolated linearly and rounded to the nearest
    multiple of 32, exactly as FFCV's ImageNet example (``get_resolution`` in
    ``examples/imagenet/train_imagenet.py``) computes it::

        int(round(interp(epoch, [start_ramp, end_ramp], [min_res, max_res]) / 32)) * 32

    FFCV's ResNet-50 recipe for 88 epochs is ``ResolutionSchedule(160, 192, 65, 76)``.
    A tuple ``(min_res, max_res, start_ramp, end_ramp)`` given as a spec's ``size``
    becomes one of these.
    """

    min_res: int
    max_res: int
    start_ramp: int
    end_ramp: int

    def __post_init__(self) -> None:
        for name in ("min_res", "max_res", "start_ramp", "end_ramp"):
            value = getattr(self, name)
            if not _is_int(value) or value < (1 if name.endswith("res") else 0):
                low = ">= 1" if name.endswith("res") else ">= 0"
                raise ValueError(f"ResolutionSchedule.{name} must be an integer {low}, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.end_ramp <= self.start_ramp:
            raise ValueError(
                f"ResolutionSchedule: end_ramp ({self.end_ramp}) must be after start_ramp ({self.start_ramp})"
            )
        if self.max_res < self.min_res:
            raise ValueError(f"ResolutionSchedule: max_res ({self.max_res}) must be >= min_res ({self.min_res})")

    def __call__(self, epoch: int) -> int:
        """The output size of ``epoch``."""
        if epoch <= self.start_ramp:
            return self.min_res
        if epoch >= self.end_ramp:
            return self.max_res
        # numpy.interp with two points, written out so that this module needs no numpy.
        frac = (epoch - self.start_ramp) / (self.end_ramp - self.start_ramp)
        interp = self.min_res + frac * (self.max_res - self.min_res)
        # Python's round() halves to even like numpy's np.round, which FFCV uses.
        return int(round(interp / _MULTIPLE)) * _MULTIPLE


def check_size_spec(name: str, value: Any) -> SizeSpec:
    """``value`` as a size, a :class:`ResolutionSchedule` (a 4-tuple becomes one) or a callable; else ValueError."""
    if _is_int(value):
        if value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        return int(value)
    if isinstance(value, ResolutionSchedule):
        return value
    if isinstance(value, (tuple, list)):
        if len(value) != 4:
            raise ValueError(
                f"{name}: a schedule is (min_res, max_res, start_ramp, end_ramp), 4 integers; got {value!r}"
            )
        return ResolutionSchedule(*value)
    if callable(value):
        return value
    raise ValueError(
        f"{name} must be an integer, a (min_res, max_res, start_ramp, end_ramp) schedule or a callable "
        f"epoch -> size; got {value!r}"
    )


def size_at(name: str, size: SizeSpec, epoch: int) -> int:
    """The size ``size`` gives for ``epoch``; ValueError naming ``name`` when a callable returns no valid size."""
    if _is_int(size):
        return int(size)
    value = size(epoch)  # type: ignore[operator]
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}: the schedule returned {value!r} for epoch {epoch}; it must return an integer >= 1")
    return int(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
