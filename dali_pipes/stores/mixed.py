"""Several stores read as one: :class:`MixedStore`, whose global index puts them one after the other.

Dataset ``k``'s sample ``i`` is ``offsets[k] + i``. Fields are reconciled by
name: the joined store has the fields every dataset has, each defined the same
way in all of them (a field of one name but another definition is refused,
naming both). Labels, when the datasets have a ``label`` field, are either kept
as stored (``labels="keep"``: the datasets number the same classes the same way,
so their class lists must agree) or offset (``labels="offset"``: dataset ``k``'s
labels move past the classes of the datasets before it, and its class names are
prefixed with its name, so the datasets keep apart in one label space). Without
a choice, datasets with the same classes keep their labels and others are
refused, naming the difference: mixing different class lists under one
numbering would train on wrong labels without any error.

The store only reads: how each epoch draws from the datasets is the loader's
:class:`~dali_pipes.Mixture` (:mod:`dali_pipes.sampling.mixture`), made from
:attr:`MixedStore.sizes`.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from dali_pipes.dataset.manifest import Field, Manifest, Shard
from dali_pipes.stores import READERS, Store, reader_class
from dali_pipes.stores.base import BatchDict, SampleDict, ShardReader, gather_batch, select_fields

logger = logging.getLogger(__name__)

__all__ = ["LABEL_POLICIES", "MixedStore"]

#: How a :class:`MixedStore` numbers the datasets' labels (see the module docstring); ``None``: keep them
#: where the class lists agree, else refuse.
LABEL_POLICIES = ("keep", "offset")


class MixedStore:
    """Several datasets' stores as one :class:`~dali_pipes.stores.Store` (the same reading interface).

    ``stores``: name -> the dataset's store, in index order. ``labels``: one of
    :data:`LABEL_POLICIES` or ``None`` (see the module docstring). ``manifest`` is
    a synthesized one: the reconciled fields, every dataset's shards in order
    (their paths absolute, for messages), the joined or offset class list. Reads
    go to each dataset's own store, so a damaged shard is named by its own
    dataset's error.
    """

    def __init__(self, stores: Mapping[str, Store], labels: str | None = None) -> None:
        if labels is not None and labels not in LABEL_POLICIES:
            raise ValueError(f"MixedStore: labels must be one of {LABEL_POLICIES} (or None), got {labels!r}")
        self.stores = dict(stores)
        self.names = tuple(self.stores)
        self.root = "mixture(" + ", ".join(f"{name}={store.root}" for name, store in self.stores.items()) + ")"
        #: Each dataset's samples, in :attr:`names` order (what a mixture's epoch draw is made from).
        self.sizes = tuple(len(store) for store in self.stores.values())
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        fields = _common_fields(self.stores)
        classes, label_offsets = _labels(self.stores, fields, labels)
        self._label_offsets = label_offsets  # per dataset, added to its "label" values (all 0 when kept)
        self._widened = bool(label_offsets.any()) and fields["label"].kind == "array"
        if self._widened:  # offset labels may outgrow the stored dtype (uint8 with 200 + 200 classes): int64
            fields = {**fields, "label": Field.array("int64", fields["label"].shape or ())}
        self.manifest = Manifest(
            format=_reading_format([store.manifest.format for store in self.stores.values()]),
            fields=fields,
            shards=tuple(
                Shard(str(store.root / shard.path), shard.num_samples, shard.bytes, shard.sha256)
                for store in self.stores.values()
                for shard in store.manifest.shards
            ),
            source={"kind": "mixture", "datasets": {name: str(store.root) for name, store in self.stores.items()}},
            classes=classes,
        )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def fields(self) -> Mapping[str, Field]:
        """The fields every dataset has, defined alike."""
        return self.manifest.fields

    def dataset_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The number (in :attr:`names`) of the dataset each global index belongs to."""
        return np.searchsorted(self.offsets, np.asarray(indices, dtype=np.int64), side="right") - 1

    def read(self, index: int, fields: Iterable[str] | None = None) -> SampleDict:
        """Sample ``index`` of the mixture, as :meth:`Store.read` (labels offset when asked)."""
        index = int(index) + (len(self) if int(index) < 0 else 0)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} is out of range for a mixture of {len(self)} samples")
        k = int(self.dataset_of([index])[0])
        sample = self.stores[self.names[k]].read(index - int(self.offsets[k]), self._names(fields))
        return self._relabelled(sample, k)

    def __getitem__(self, index: int) -> SampleDict:
        return self.read(index)

    def __iter__(self) -> Iterator[SampleDict]:
        for i in range(len(self)):
            yield self[i]

    def read_batch(
        self, indices: Sequence[int] | np.ndarray, fields: Iterable[str] | None = None, *, arrays: bool = False
    ) -> BatchDict:
        """The samples ``indices`` (global, repeats allowed), as :meth:`Store.read_batch`: one call per dataset."""
        names = self._names(fields)
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            bad = indices[(indices < 0) | (indices >= len(self))][0]
            raise IndexError(f"sample index {bad} is out of range for a mixture of {len(self)} samples")
        owner = self.dataset_of(indices)
        parts = []
        for k in np.unique(owner).tolist():
            positions = np.flatnonzero(owner == k)
            store = self.stores[self.names[k]]
            values = store.read_batch(indices[positions] - self.offsets[k], names, arrays=arrays)
            parts.append((positions, self._relabelled(values, k)))
        return gather_batch(names, self.fields, len(indices), parts)

    def _names(self, fields: Iterable[str] | None) -> list[str]:
        # Only the mixture's fields: another field of one dataset is not the mixture's.
        if fields is None:
            return list(self.fields)
        return list(select_fields(self.fields, fields, self.root))

    def _relabelled(self, values: dict, k: int) -> dict:
        if self._widened and "label" in values:
            offset = int(self._label_offsets[k])
            label = values["label"]
            if isinstance(label, np.ndarray):
                values["label"] = label.astype(np.int64) + offset
            else:
                values["label"] = [np.asarray(v, dtype=np.int64) + offset for v in label]
        return values

    @property
    def shard_readers(self) -> list[ShardReader]:
        """Every dataset's shard readers, in index order."""
        return [reader for store in self.stores.values() for reader in store.shard_readers]

    def close(self) -> None:
        """Release every dataset's open shard handles."""
        for store in self.stores.values():
            store.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root}, samples={len(self)})"


def _common_fields(stores: Mapping[str, Store]) -> dict[str, Field]:
    """The fields all datasets have; one of the same name defined otherwise is refused, naming both."""
    (first_name, first), *others = stores.items()
    common: dict[str, Field] = {}
    for name, spec in first.fields.items():
        if not all(name in store.fields for _, store in others):
            continue
        for other_name, store in others:
            if store.fields[name] != spec:
                raise ValueError(
                    f"Mixture: field {name!r} is {spec.to_json()} in {first_name} ({first.root}) but "
                    f"{store.fields[name].to_json()} in {other_name} ({store.root}); convert them alike, "
                    "or mix datasets whose fields agree"
                )
        common[name] = spec
    for name, store in stores.items():
        left_out = sorted(set(store.fields) - set(common))
        if left_out:
            logger.warning(
                "Mixture: %s's field(s) %s are not in every dataset, so the mixture leaves them out", name, left_out
            )
    return common


def _labels(stores: Mapping[str, Store], fields: Mapping[str, Field], policy: str | None):
    """``(classes, label offset per dataset)`` of the mixture under ``policy`` (see the module docstring)."""
    zeros = np.zeros(len(stores), dtype=np.int64)
    lists = {name: store.manifest.classes for name, store in stores.items()}
    known = {name: tuple(c) for name, c in lists.items() if c is not None}
    unlisted = [name for name, c in lists.items() if c is None]
    if "label" not in fields:
        return None, zeros
    if policy == "offset":
        if unlisted:
            raise ValueError(
                f"Mixture(labels='offset'): {unlisted} have no class list in their manifest, so their labels cannot be "
                "moved past the others'; use labels='keep' if their label numbers mean the same classes"
            )
        sizes = [len(c) for c in known.values()]
        classes = tuple(f"{name}/{c}" for name, names in known.items() for c in names)
        return classes, np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    if policy is None and known and unlisted:
        raise ValueError(
            f"Mixture: {unlisted} have no class list in their manifest and {sorted(known)} do, so nothing says their "
            "label numbers mean the same classes: choose labels='keep' if they do, or labels='offset' (which needs "
            "class lists) to keep them apart"
        )
    distinct = set(known.values())
    if len(distinct) > 1:
        advice = (
            "labels='keep' would train on wrong labels; use labels='offset', or convert them with the same class list"
            if policy == "keep"
            else "choose labels='offset' to keep them apart in one label space (class names prefixed by dataset), "
            "or convert them with the same class list"
        )
        raise ValueError(f"Mixture: the datasets number different classes ({_first_difference(known)}): {advice}")
    return (next(iter(distinct)) if distinct else None), zeros


def _first_difference(known: Mapping[str, tuple[str, ...]]) -> str:
    """Where two class lists first differ, in words."""
    (a, ca), *rest = known.items()
    for b, cb in rest:
        if cb != ca:
            for i, (x, y) in enumerate(zip(ca, cb)):
                if x != y:
                    return f"class {i} is {x!r} in {a} but {y!r} in {b}"
            return f"{a} has {len(ca)} classes, {b} has {len(cb)}"
    return "none"


def _reading_format(formats: list[str]) -> str:
    """The format the loader plans its reader processes by: one that needs them, if any dataset's does."""
    for fmt in formats:
        if fmt in READERS and not reader_class(fmt).cheap_batch_reads:
            return fmt
    return formats[0]
