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
    boundaries: Sequence[int] | None = None,
) -> list[ShardPlan]:
    """Cut ``items`` into consecutive shards by count or by bytes.

    With ``samples_per_shard``, every shard but the last holds exactly that many
    items. Otherwise shards are filled up to ``shard_size`` bytes of input (an
    item larger than that gets a shard of its own); without either, the size is
    :func:`auto_shard_size` of the input's total.

    ``boundaries`` (from :meth:`Source.input_boundaries`) are the item indices where
    a new input file begins: no shard spans one, so each shard task reads one input
    file. Shards are cut within each file by the same rule (the automatic size
    being that of the whole input), so a large file is still spread over workers.
    """
    if not items:
        raise ConversionError("nothing to convert: the input holds no samples")
    if samples_per_shard is not None and shard_size is not None:
        raise ConversionError("give either --samples-per-shard or --shard-size, not both")
    if samples_per_shard is not None and samples_per_shard < 1:
        raise ConversionError(f"--samples-per-shard must be at least 1, got {samples_per_shard}")
    if shard_size is not None and shard_size < 1:
        raise ConversionError(f"--shard-size must be positive, got {shard_size}")
    if samples_per_shard is None and shard_size is None:
        shard_size = auto_shard_size(sum(item.size for item in items))
    edges = sorted({0, len(items), *(b for b in boundaries or () if 0 < b < len(items))})
    spans = []
    for a, b in zip(edges[:-1], edges[1:]):
        spans += _cut(items, a, b, samples_per_shard, shard_size)
    return [ShardPlan(k, a, b) for k, (a, b) in enumerate(spans)]


def _cut(
    items: Sequence[Item], begin: int, end: int, samples_per_shard: int | None, shard_size: int | None
) -> list[tuple[int, int]]:
    """``(start, stop)`` spans of ``items[begin:end]``: by count when given, else filled up to ``shard_size`` bytes."""
    if samples_per_shard is not None:
        bounds = list(range(begin, end, samples_per_shard)) + [end]
        return list(zip(bounds[:-1], bounds[1:]))
    assert shard_size is not None
    spans: list[tuple[int, int]] = []
    start, filled = begin, 0
    for i in range(begin, end):
        size = items[i].size
        if filled and filled + size > shard_size:
            spans.append((start, i))
            start, filled = i, 0
        filled += size
    spans.append((start, end))
    return spans
