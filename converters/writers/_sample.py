"""Checks every writer applies to a sample before it is stored.

A shard must read back byte for byte what was written, so nothing is converted
silently: a field's value must be bytes (``bytes`` fields) or an array whose
dtype casts *safely* to the declared one and whose shape matches.
"""

from __future__ import annotations

from typing import Mapping, Union

import numpy as np

from dali_pipes.dataset.manifest import Field, ManifestError, check_field_name
from dali_pipes.stores.checksum import CRC_DATASET
from dali_pipes.stores.codec import check_field

Value = Union[bytes, np.ndarray]


def check_fields(fields: Mapping[str, Field], where: str) -> None:
    """Refuse a field list that the formats cannot store (``ValueError`` naming the field)."""
    if not fields:
        raise ValueError(f"{where}: a shard needs at least one field")
    for name, field in fields.items():
        check_field_name(name, where)  # a ManifestError, which is a ValueError
        if name == CRC_DATASET:
            raise ValueError(f"{where}: field name {name!r} is reserved for the record checksums")
        check_field(name, field, where)
        try:
            # What the manifest parser would refuse at the end of the job is refused before it starts.
            Field.from_json(name, field.to_json(), where)
        except ManifestError as exc:
            raise ValueError(str(exc)) from None


def normalize_sample(fields: Mapping[str, Field], sample: Mapping[str, object], where: str) -> dict[str, Value]:
    """The sample's fields in declaration order: ``bytes`` or C-contiguous arrays of the declared dtype.

    Raises ``ValueError`` (``TypeError`` for a wrong Python type) naming ``where``
    and the field when a field is missing or extra, or a value does not fit.
    """
    extra = set(sample) - set(fields)
    if extra:
        raise ValueError(f"{where}: fields {sorted(extra)} are not declared (declared: {list(fields)})")
    out: dict[str, Value] = {}
    for name, field in fields.items():
        if name not in sample:
            raise ValueError(f"{where}: field {name!r} is missing")
        value = sample[name]
        if field.kind == "bytes":
            out[name] = _to_bytes(name, field, value, where)
        else:
            out[name] = _to_array(name, field, value, where)
    return out


def _to_bytes(name: str, field: Field, value: object, where: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
        return value.tobytes()
    if isinstance(value, str) and field.encoding == "utf-8":
        return value.encode("utf-8")
    raise TypeError(f"{where}: field {name!r} ({field.encoding}) needs bytes, got {type(value).__name__}")


def _to_array(name: str, field: Field, value: object, where: str) -> np.ndarray:
    dtype = np.dtype(field.dtype)
    array = np.asarray(value)
    if array.dtype != dtype and not np.can_cast(array.dtype, dtype, casting="safe"):
        raise ValueError(
            f"{where}: field {name!r} is {array.dtype.name} but declared {dtype.name}; "
            "convert it before writing (only safe casts are made here, nothing is rounded or wrapped)"
        )
    shape = tuple(field.shape or ())
    if field.variable_length:
        if array.size == 0 and array.shape[1:] != shape[1:]:
            array = array.reshape((0, *shape[1:]))  # an empty list of boxes, whatever its shape
        ok = array.ndim == len(shape) and array.shape[1:] == shape[1:]
    else:
        ok = array.shape == shape
    if not ok:
        raise ValueError(f"{where}: field {name!r} has shape {array.shape}; declared {shape} (-1: any length)")
    return np.asarray(array, dtype=dtype, order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d
