"""The order a dataset's samples were written in: the manifest's ``order`` entry.

``{"kind": "source"}``: as the input gave them (class after class for an image folder).
``{"kind": "shuffled", "seed": S}``: a seeded permutation of the input's samples, a pure function of ``S`` and the
input's sample list (:mod:`converters.order`), so that a shard holds samples from across the input. A manifest
written before the entry existed has none (:attr:`Manifest.order` is ``None``): those versions always wrote
the source's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The kinds of order a dataset may be written in.
ORDER_KINDS = ("source", "shuffled")


@dataclass(frozen=True)
class SampleOrder:
    """How the samples of a dataset are ordered: ``kind`` (one of :data:`ORDER_KINDS`), ``seed`` when shuffled."""

    kind: str = "source"
    seed: int | None = None

    @property
    def shuffled(self) -> bool:
        return self.kind == "shuffled"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "seed": self.seed} if self.shuffled else {"kind": self.kind}

    def describe(self) -> str:
        """``'shuffled (seed 0)'`` or ``'in source order'``, for a report line."""
        return f"shuffled (seed {self.seed})" if self.shuffled else "in source order"


SOURCE_ORDER = SampleOrder()


def parse_order(value: Any, where: str, error: type[Exception]) -> SampleOrder | None:
    """The manifest's ``order`` entry (``None`` when absent: an older manifest); ``error`` naming the fault."""
    if value is None:
        return None
    kind = value.get("kind") if isinstance(value, dict) else None
    if kind not in ORDER_KINDS:
        raise error(f"{where}: 'order' must be an object whose kind is one of {ORDER_KINDS}, got {value!r}")
    if kind == "source":
        return SOURCE_ORDER
    seed = value.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise error(f"{where}: a shuffled 'order' needs a non-negative integer seed, got {seed!r}")
    return SampleOrder("shuffled", seed)


def order_line(order: SampleOrder | None) -> str:
    """How a dataset's samples were written, for a report (``dali-pipes mixing``), from its manifest's ``order``."""
    if order is None:
        return "order not recorded (convert kept the source's order then)"
    if order.shuffled:
        return f"written in a shuffled order (convert's seed {order.seed})"
    return "written in source order (convert --order shuffled mixes a class-ordered input)"
