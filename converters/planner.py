"""Split the input into shards, deterministically: the same input gives the same plan.

The plan depends on the input alone (item sizes and counts), never on the number
of workers, so that any worker count writes the same bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from converters.base import ConversionError, Item

GB = 1000**3
MB = 1000**2
#: Upper bound of an automatically sized shard: few large files, but not unwieldy ones.
AUTO_SHARD_MAX = 1 * GB
#: Lower bound, so that a small dataset is not cut into many tiny files.
AUTO_SHARD_MIN = 32 * MB
#: An automatically sized dataset of moderate size is cut into about this many shards,
#: so that a process pool has work to share.
AUTO_SHARD_TARGET_COUNT = 16

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "m": MB,
    "g": GB,
    "t": 1000 * GB,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}


@dataclass(frozen=True)
class ShardPlan:
    """Shard ``number`` holds items ``start`` (inclusive) to ``stop`` (exclusive)."""

    number: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


def parse_size(text: str) -> int:
    """``"1GB"`` -> ``1_000_000_000``; ``"512MiB"``, ``"1.5G"``, ``"4096"`` work too."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ConversionError(f"cannot read the size {text!r}; write it like 512MB, 1GB or 1.5GiB")
    number, unit = match.groups()
    unit = (unit or "").lower().rstrip("b")
    if unit not in _UNITS:
        raise ConversionError(f"unknown size unit in {text!r}; use B, KB, MB, GB or TB")
    value = int(float(number) * _UNITS[unit])
    if value <= 0:
        raise ConversionError(f"the size {text!r} must be positive")
    return value


def auto_shard_size(total_bytes: int) -> int:
    """The shard size used when none is given: 1 GB for large sets, smaller for moderate ones."""
    return int(min(AUTO_SHARD_MAX, max(AUTO_SHARD_MIN, math.ceil(total_bytes / AUTO_SHARD_TARGET_COUNT))))


def plan_shards(
    items: Sequence[Item],
    *,
    samples_per_shard: int | None = None,
    shard_size: int | None = None,
) -> list[ShardPlan]:
    """Cut ``items`` into consecutive shards by count or by bytes.

    With ``samples_per_shard``, every shard but the last holds exactly that many
    items. Otherwise shards are filled up to ``shard_size`` bytes of input (an
    item larger than that gets a shard of its own); without either, the size is
    :func:`auto_shard_size` of the input's total.
    """
    if not items:
        raise ConversionError("nothing to convert: the input holds no samples")
    if samples_per_shard is not None and shard_size is not None:
        raise ConversionError("give either --samples-per-shard or --shard-size, not both")
    if samples_per_shard is not None:
        if samples_per_shard < 1:
            raise ConversionError(f"--samples-per-shard must be at least 1, got {samples_per_shard}")
        bounds = list(range(0, len(items), samples_per_shard)) + [len(items)]
        return [ShardPlan(k, a, b) for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]

    if shard_size is None:
        shard_size = auto_shard_size(sum(item.size for item in items))
    if shard_size < 1:
        raise ConversionError(f"--shard-size must be positive, got {shard_size}")
    plans: list[ShardPlan] = []
    start, filled = 0, 0
    for i, item in enumerate(items):
        if filled and filled + item.size > shard_size:
            plans.append(ShardPlan(len(plans), start, i))
            start, filled = i, 0
        filled += item.size
    plans.append(ShardPlan(len(plans), start, len(items)))
    return plans
