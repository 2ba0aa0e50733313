"""Feature-array pipeline spec: named fixed-shape arrays to the device in batches.

For datasets written by ``convert arrays`` (or any dataset with array fields),
such as an audio mixture ``(4, 64000)`` and its target ``(64000,)``. Each named
field comes out under its own name, batched to ``(N, *shape)``, on the loader's
device, with optional per-field normalisation and dtype cast.

Host copies: this spec adds none. A field with neither normalisation nor cast
is returned as the external-source node itself (no DALI operator); on the GPU
the stored dtype crosses to the device first, and normalisation and cast run
there, so a ``float16`` field moves half the bytes of a ``float32`` one. What
a batch of ``B`` samples of ``S`` bytes costs on the host (CPU device, LMDB or
HDF5): the store's batch read into one ``(B, *shape)`` array (``B*S``; HDF5
gathers the rows straight from the mapped file), in the
training process by default (:attr:`Features.py_num_workers_by_default`); DALI's
copy of the fed batch (``B*S``); the iterator's copy into the torch tensor
(``B*S``). With ``py_num_workers > 0`` the read runs in a worker, which adds its
write into DALI's shared memory (``B*S``) and DALI's per-sample handling of the
batch on both sides of it. TFRecord reads cost several copies instead of one
(protobuf decoding).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping, Sequence, Union

import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.types as types
from nvidia.dali.data_node import DataNode

from dali_pipes.dataset.manifest import Manifest
from dali_pipes.dataset.outputs import DALI_TYPE_NAMES, RESERVED_OUTPUTS
from dali_pipes.pipelines.base import check_build_call

#: Output dtypes a field may be cast to, by numpy name.
FEATURE_DTYPES: dict[str, Any] = {name: getattr(types, dali) for name, dali in DALI_TYPE_NAMES.items()}

Stat = Union[float, tuple[float, ...]]


@dataclass(frozen=True, kw_only=True)
class Features:
    """Move the array ``fields`` of each sample to the device, batched, optionally normalised and cast.

    ``fields``: the dataset's array fields to read, in output order; each must
    have a fixed shape (DALI's iterator needs one shape per batch).
    ``normalize``: ``{field: (mean, std)}``, output ``(x - mean) / std`` computed
    in float32; ``mean`` and ``std`` are numbers or sequences that broadcast
    against the field's trailing axis. ``dtype``: ``{field: "float16", ...}``,
    the output dtype of a field (by default its stored dtype, or float32 when
    normalised). Mappings are kept as tuples of ``(field, value)`` pairs so the
    spec stays hashable.
    """

    fields: tuple[str, ...]
    normalize: tuple[tuple[str, tuple[Stat, Stat]], ...] = ()
    dtype: tuple[tuple[str, str], ...] = ()

    #: ``DALILoader``'s ``py_num_workers`` when the caller (and a ``settings`` file) leave it unset:
    #: read in the training process. A batch of feature rows is one gather from the mapped shard
    #: and a vectorised CRC check, while DALI's parallel source moves a batch between processes
    #: sample by sample (a pickled header and a shared-memory copy per row on the worker's side,
    #: one array per row to unpack on the loader's), which costs more than the read itself
    #: (dali_pipes/bench/README.md, "Feature rows at memory speed").
    py_num_workers_by_default: ClassVar[int] = 0

    def __post_init__(self) -> None:
        fields = self.fields
        if isinstance(fields, str):
            fields = (fields,)
        if not isinstance(fields, Iterable) or not all(isinstance(f, str) and f for f in fields):
            raise ValueError(f"Features.fields must be a sequence of field names, got {self.fields!r}")
        fields = tuple(fields)
        if not fields:
            raise ValueError("Features.fields is empty: name at least one array field of the dataset")
        if len(set(fields)) != len(fields):
            raise ValueError(f"Features.fields names a field twice: {fields!r}")
        clash = [f for f in fields if f in RESERVED_OUTPUTS]
        if clash:
            raise ValueError(f"Features.fields: {clash[0]!r} is an output the loader adds itself; rename the field")
        object.__setattr__(self, "fields", fields)
        normalize = _pairs("normalize", self.normalize, fields)
        object.__setattr__(self, "normalize", tuple((f, _check_stats(f, v)) for f, v in normalize))
        dtypes = _pairs("dtype", self.dtype, fields)
        for name, value in dtypes:
            if value not in FEATURE_DTYPES:
                raise ValueError(f"Features.dtype[{name!r}] must be one of {', '.join(FEATURE_DTYPES)}; got {value!r}")
        object.__setattr__(self, "dtype", tuple(dtypes))

    @property
    def required_fields(self) -> tuple[str, ...]:
        """The dataset fields read: :attr:`fields`."""
        return self.fields

    @property
    def runs_without_dali(self) -> bool:
        """True without ``normalize`` and ``dtype``: the rows go to the device as read, with no DALI pipeline
        (:mod:`dali_pipes.loading.direct`; the loader still uses DALI when asked for reader processes)."""
        return not self.normalize and not self.dtype

    @property
    def needs_conditionals(self) -> bool:
        """Always False."""
        return False

    def bind(self, manifest: Manifest) -> "Features":
        """Check the fields against a dataset's manifest; returns this spec.

        Raises ValueError for a field that is missing, not an array, or of a
        per-sample variable shape, naming the field.
        """
        for name in self.fields:
            spec = manifest.fields.get(name)
            if spec is None:
                raise ValueError(f"Features: the dataset has no field {name!r} (fields: {', '.join(manifest.fields)})")
            if spec.kind != "array":
                raise ValueError(f"Features: field {name!r} holds bytes ({spec.encoding}), not an array")
            if spec.variable_length:
                raise ValueError(
                    f"Features: field {name!r} has a variable shape {spec.shape}; only fixed-shape arrays batch "
                    "into one tensor"
                )
        return self

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the graph; return ``{field: node}`` for every field (see :class:`PipelineSpec`)."""
        check_build_call(self, inputs, device)
        normalize, dtypes = dict(self.normalize), dict(self.dtype)
        outputs: dict[str, DataNode] = {}
        for name in self.fields:
            node = inputs[name]
            if device == "gpu":
                # Cross to the GPU in the stored dtype, the fewest bytes; compute there.
                node = node.gpu()
            if name in normalize:
                node = _normalize(fn.cast(node, dtype=types.FLOAT), *normalize[name], device=device)
            if name in dtypes:
                node = fn.cast(node, dtype=FEATURE_DTYPES[dtypes[name]], device=device)
            outputs[name] = node
        return outputs


def _normalize(node: DataNode, mean: Stat, std: Stat, *, device: str) -> DataNode:
    """``(x - mean) / std`` as one fused ``x * scale + shift`` with precomputed float32 constants."""
    scale = 1.0 / np.asarray(std, dtype=np.float64)
    shift = -np.asarray(mean, dtype=np.float64) * scale
    return node * _constant(scale, device) + _constant(shift, device)


def _constant(value: np.ndarray, device: str) -> float | DataNode:
    if value.ndim == 0:
        return float(value)
    return fn.constant(fdata=value.astype(np.float32).tolist(), shape=list(value.shape), device=device)


def _pairs(what: str, value: Any, fields: Sequence[str]) -> list[tuple[str, Any]]:
    """``value`` (a mapping or ``(field, value)`` pairs) as pairs whose fields are among ``fields``."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        try:
            pairs = [tuple(p) for p in value]
        except TypeError:
            raise ValueError(f"Features.{what} must be a mapping of field -> value, got {value!r}") from None
        if not all(len(p) == 2 for p in pairs):
            raise ValueError(f"Features.{what} must be a mapping of field -> value, got {value!r}")
    for name, _ in pairs:
        if name not in fields:
            raise ValueError(f"Features.{what} names {name!r}, which is not one of fields {tuple(fields)!r}")
    return pairs


def _check_stats(name: str, value: Any) -> tuple[Stat, Stat]:
    items = None if isinstance(value, (str, bytes)) else list(value) if isinstance(value, Iterable) else None
    if items is None or len(items) != 2:
        raise ValueError(f"Features.normalize[{name!r}] must be a (mean, std) pair, got {value!r}")
    mean, std = (_stat(f"Features.normalize[{name!r}]", v) for v in items)
    flat_std = std if isinstance(std, tuple) else (std,)
    if min(flat_std) <= 0:
        raise ValueError(f"Features.normalize[{name!r}]: std must be > 0, got {std!r}")
    return mean, std


def _stat(where: str, value: Any) -> Stat:
    """A finite number, or a non-empty 1-D sequence of them (one per element of the trailing axis)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{where}: mean and std must be finite, got {value!r}")
        return float(value)
    array = np.asarray(value)
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iuf" or not np.all(np.isfinite(array)):
        raise ValueError(f"{where}: mean and std must be numbers or 1-D sequences of finite numbers, got {value!r}")
    return tuple(float(v) for v in array)
