"""Split the input into shards, deterministically: the same input gives the same plan.

The plan depends on the input alone (item sizes and counts), never on the number
of workers, so that any worker count writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from converters.base import ConversionError, Item
from dali_pipes.dataset import sizes

GB = 1000**3
MB = 1000**2
#: Upper bound of an automatically sized shard: few large files, but not unwieldy ones.
AUTO_SHARD_MAX = 1 * GB
#: Lower bound, so that a small dataset is not cut into many tiny files.
AUTO_SHARD_MIN = 32 * MB
#: An automatically sized dataset of moderate size is cut into about this many shards,
#: so that a process pool has work to share.
AUTO_SHARD_TARGET_COUNT = 16


@dataclass(frozen=True)
class ShardPlan:
    """Shard ``number`` holds items ``start`` (inclusive) to ``stop`` (exclusive).

    ``anchor`` is where its first item lies in the input (:attr:`Item.anchor`), so that a worker can read the
    shard's items from the input itself (:meth:`~converters.base.StreamingSource.items_from`) instead of being
    sent them; ``fingerprint`` hashes their names and sizes, to notice an input that changed since planning.
    """

    number: int
    start: int
    stop: int
    anchor: Any = None
    fingerprint: str = ""

    @property
    def count(self) -> int:
        return self.stop - self.start


def parse_size(text: str) -> int:
    """``"1GB"`` -> ``1_000_000_000``; ``"512MiB"``, ``"1.5G"``, ``"4096"`` work too (:mod:`dali_pipes.dataset.sizes`)."""
    try:
        return sizes.parse_size(text)
    except sizes.SizeError as exc:
        raise ConversionError(str(exc)) from None


def auto_shard_size(total_bytes: int) -> int:
    """The shard size used when none is given: 1 GB for large sets, smaller for moderate ones."""
    return int(min(AUTO_SHARD_MAX, max(AUTO_SHARD_MIN, math.ceil(total_bytes / AUTO_SHARD_TARGET_COUNT))))


def check_shard_options(samples_per_shard: int | None, shard_size: int | None) -> None:
    """Refuse a count and a size together, or a count or size below 1."""
    if samples_per_shard is not None and shard_size is not None:
        raise ConversionError("give either --samples-per-shard or --shard-size, not both")
    if samples_per_shard is not None and samples_per_shard < 1:
        raise ConversionError(f"--samples-per-shard must be at least 1, got {samples_per_shard}")
    if shard_size is not None and shard_size < 1:
        raise ConversionError(f"--shard-size must be positive, got {shard_size}")


def plan_shards(
    items: Sequence[Item],
    *,
    samples_per_shard: int | None = None,
    shard_size: int | None = None,
) -> list[ShardPlan]:
    """Cut ``items`` into consecutive shards by count or by bytes (:func:`cut_shards` over a list).

    Without a count or a size, the size is :func:`auto_shard_size` of the input's total.
    """
    check_shard_options(samples_per_shard, shard_size)
    if samples_per_shard is None and shard_size is None:
        shard_size = auto_shard_size(sum(item.size for item in items))
    plans = list(cut_shards(items, samples_per_shard=samples_per_shard, shard_size=shard_size))
    if not plans:
        raise ConversionError("nothing to convert: the input holds no samples")
    return plans


def cut_shards(
    items: Iterable[Item], *, samples_per_shard: int | None = None, shard_size: int | None = None
) -> Iterator[ShardPlan]:
    """The shards of a stream of items, each yielded once its last item has passed: memory O(1) in the input.

    With ``samples_per_shard``, every shard but the last holds exactly that many items. With ``shard_size``,
    shards are filled up to that many bytes of input (an item larger than that gets a shard of its own).
    Input files play no part: many small files (one-sample tars, small Parquet files) fill shards of the
    target size, and a large one is spread over several; a task reads its files one after another.
    """
    assert (samples_per_shard is None) != (shard_size is None), "exactly one of a count and a size"
    shard = _OpenShard(0, 0)
    index = -1
    for index, item in enumerate(items):
        if index > shard.start and (
            (samples_per_shard is not None and index - shard.start >= samples_per_shard)
            or (shard_size is not None and shard.filled + item.size > shard_size)
        ):
            yield shard.plan(index)
            shard = _OpenShard(shard.number + 1, index)
        shard.add(item)
    if index >= shard.start:
        yield shard.plan(index + 1)


class _OpenShard:
    """The shard being filled while :func:`cut_shards` walks the items: its bytes, anchor and fingerprint."""

    def __init__(self, number: int, start: int) -> None:
        self.number, self.start, self.filled = number, start, 0
        self.anchor: Any = None
        self._fingerprint = Fingerprint()

    def add(self, item: Item) -> None:
        if not self._fingerprint.count:
            self.anchor = item.anchor
        self.filled += item.size
        self._fingerprint.add(item)

    def plan(self, stop: int) -> ShardPlan:
        return ShardPlan(self.number, self.start, stop, self.anchor, self._fingerprint.hexdigest())


class Fingerprint:
    """A hash of items (name, size and what the source loads them by): :attr:`ShardPlan.fingerprint` for one
    shard, and through those a job's digest: a label or key edited in a list file makes another job."""

    def __init__(self) -> None:
        self.count = 0
        self._hash = hashlib.blake2b(digest_size=16)

    def add(self, item: Item) -> None:
        self.count += 1
        self._hash.update(f"{item.name}\0{item.size}\0{_plain(item.data)}\n".encode())

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _plain(data: Any) -> str:
    """``data`` as text when it is made of plain values (the same every run); else only its type's name, since
    the ``repr`` of another object may hold its address."""
    if data is None or isinstance(data, (str, int, float, bytes)):
        return repr(data)
    if isinstance(data, (tuple, list)):
        return "(" + ",".join(_plain(value) for value in data) + ")"
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return type(data).__name__ + _plain(tuple(getattr(data, f.name) for f in dataclasses.fields(data)))
    return type(data).__name__
