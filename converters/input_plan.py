"""The shards of one conversion, planned from its source: streamed for a :class:`StreamingSource`.

A streaming source is walked once (or twice, when the shard size is the automatic one and needs the input's
total first), and the parent keeps per shard its range, its first item's anchor and a fingerprint of its
items: memory O(shards), not O(samples). Each shard task reads its own items from the input again
(:func:`shard_items`), and refuses them when they are not the planned ones (the input changed meanwhile).
Any other source's items are listed once and held, and each task is sent its slice, as before streaming.
In a shuffled order (:mod:`converters.order`) shards are cut by count, and each task reads the items the parent
spilled for it into the job folder (:meth:`InputPlan.spilled`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from converters.base import ConversionError, Item, Source, StreamingSource
from converters.order import Permutation, SpilledItems, fresh_folder, spill_items, spill_path
from converters.planner import Fingerprint, ShardPlan, auto_shard_size, check_shard_options, cut_shards
from dali_pipes.dataset.sample_order import SOURCE_ORDER, SampleOrder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputPlan:
    """The shards of an input and how many items it holds; ``held``: the items of a source that is not streamed.

    ``order``: the order the samples are written in; ``identity``: what else makes the job (for a shuffled order,
    the order and a fingerprint of the whole input), added to its digest; ``spill``: the folder of each shard's
    items once :meth:`spilled`.
    """

    plans: list[ShardPlan]
    count: int
    held: Sequence[Item] | None = None
    order: SampleOrder = SOURCE_ORDER
    identity: dict[str, Any] = field(default_factory=dict)
    spill: Path | None = None

    def items_for(self, plan: ShardPlan) -> Iterable[Item] | None:
        """What a task for ``plan`` carries: its items when they are held here, the file of its spilled items in a
        shuffled order, else ``None`` (read by the task)."""
        if self.spill is not None:
            return SpilledItems(str(spill_path(self.spill, plan.number)), plan.count)
        return None if self.held is None else self.held[plan.start : plan.stop]

    def spilled(self, source: Source, job_dir: Path, todo: Sequence[ShardPlan]) -> "InputPlan":
        """In a shuffled order, this plan once the items of the shards in ``todo`` are written to their files in
        ``job_dir`` (one more pass over the input, refused when it is not the input planned); else itself."""
        if not self.order.shuffled:
            return self
        folder = fresh_folder((job_dir / "order").absolute())  # absolute: a Dask worker may run elsewhere
        seen = Fingerprint()
        permutation = Permutation(self.count, self.order.seed or 0)
        walk = _fingerprinted(_walk(source, self.held), seen)
        spill_items(walk, permutation, self.plans[0].count, [plan.number for plan in todo], folder)
        if seen.count != self.count or seen.hexdigest() != self.identity["input"]:
            raise ConversionError(
                f"the input changed while it was planned ({seen.count} inputs read where {self.count} were "
                "planned, or other ones); nothing was converted. Restore the input, or delete the output folder and "
                "convert again"
            )
        return dataclasses.replace(self, spill=folder)

    def stream(self, source: Source) -> Iterator[Item]:
        """Every item again, in order (to hash them the way an older version did)."""
        return _walk(source, self.held)


def plan_input(
    source: Source,
    *,
    samples_per_shard: int | None = None,
    shard_size: int | None = None,
    order: SampleOrder = SOURCE_ORDER,
) -> InputPlan:
    """Cut ``source`` into shards by count or bytes (the automatic size when neither is given), its samples in
    ``order``."""
    check_shard_options(samples_per_shard, shard_size)
    held = None if source.streams() else source.items()
    if order.shuffled:
        return _plan_shuffled(source, held, order, samples_per_shard, shard_size)
    if samples_per_shard is None and shard_size is None:
        total = sum(item.size for item in _walk(source, held))  # a first pass: the automatic size needs the total
        shard_size = auto_shard_size(total)
    plans = list(
        cut_shards(
            _walk(source, held),
            samples_per_shard=samples_per_shard,
            shard_size=shard_size,
        )
    )
    if not plans:
        raise ConversionError("nothing to convert: the input holds no samples")
    count = plans[-1].stop
    log.debug("%d items in %d shards (%s)", count, len(plans), "held" if held is not None else "streamed")
    return InputPlan(plans, count, held)


def _plan_shuffled(
    source: Source, held: Sequence[Item] | None, order: SampleOrder, samples_per_shard: int | None, size: int | None
) -> InputPlan:
    """Shards of a shuffled order: by count, ``size`` (or the automatic size) turned into the count of samples of
    an average size, since a shard's samples come from anywhere in the input."""
    seen = Fingerprint()
    total = 0
    for item in _walk(source, held):
        seen.add(item)
        total += item.size
    count = seen.count
    if not count:
        raise ConversionError("nothing to convert: the input holds no samples")
    if samples_per_shard is None:
        size = size or auto_shard_size(total)
        samples_per_shard = max(1, min(count, round(count * size / total))) if total > 0 else count
    plans = [
        ShardPlan(number, start, min(start + samples_per_shard, count))
        for number, start in enumerate(range(0, count, samples_per_shard))
    ]
    log.debug("%d items in %d shards, shuffled (seed %s)", count, len(plans), order.seed)
    return InputPlan(plans, count, held, order, {"order": order.to_json(), "input": seen.hexdigest()})


def _fingerprinted(items: Iterable[Item], seen: Fingerprint) -> Iterator[Item]:
    """``items``, each added to ``seen`` as it passes."""
    for item in items:
        seen.add(item)
        yield item


def _walk(source: Source, held: Sequence[Item] | None) -> Iterator[Item]:
    """The input's items in order: the held list, or a new pass over a streaming source."""
    if held is not None:
        return iter(held)
    assert isinstance(source, StreamingSource)
    return source.iter_items()


def shard_items(source: Source, plan: ShardPlan, items: Sequence[Item] | None) -> Iterable[Item]:
    """The items of shard ``plan``: ``items`` when the task carries them, else read from the input by the task."""
    if items is not None:
        return items
    if not isinstance(source, StreamingSource) or not source.streams():
        raise TypeError(f"a task without items for a {type(source).__name__}, which cannot read them itself")
    return _checked(source, plan)


def _checked(source: StreamingSource, plan: ShardPlan) -> Iterator[Item]:
    """The shard's items read from its anchor on, refused at the end when they are not those planned."""
    seen = Fingerprint()
    first = None
    for item in itertools.islice(source.items_from(plan.anchor), plan.count):
        first = first or item.name
        seen.add(item)
        yield item
    if seen.count != plan.count or seen.hexdigest() != plan.fingerprint:
        raise ConversionError(
            f"shard {plan.number}: the input changed while it was converted (the {seen.count} inputs read from "
            f"{first or 'its first one'} on are not the {plan.count} planned); nothing of this shard was kept. "
            "Restore the input, or delete the output folder and convert again"
        )
