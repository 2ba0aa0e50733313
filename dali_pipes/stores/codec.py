"""Raw array bytes shared by the formats that store arrays as plain bytes (LMDB, TFRecord).

An array field is stored as its elements in C order, little-endian, with no
header: the dtype and the per-sample shape come from the manifest's
:class:`~dali_pipes.dataset.manifest.Field`. A variable-length field (shape ``(-1, ...)``)
recovers its first dimension from the byte count, which is why such a field
must have a non-empty row (see :func:`check_field`).
"""

from __future__ import annotations

import math

import numpy as np

from dali_pipes.dataset.manifest import Field
from dali_pipes.stores.errors import StoreError

#: numpy dtype kinds a field may have: bool, signed and unsigned integers, floats, complex.
ARRAY_KINDS = "biufc"


def check_field(name: str, field: Field, where: str) -> None:
    """Refuse a field that no format can store and read back exactly.

    Raises ``ValueError`` naming ``where`` and the field.
    """
    if field.kind == "bytes":
        return
    dtype = np.dtype(field.dtype)
    if dtype.kind not in ARRAY_KINDS:
        raise ValueError(
            f"{where}: field {name!r} has dtype {dtype.name}; only bool, integer, float and complex arrays are stored"
        )
    if not field.variable_length and math.prod(field.shape) == 0:
        raise ValueError(f"{where}: field {name!r} has shape {field.shape}, which holds no values")
    if field.variable_length and math.prod(field.shape[1:]) == 0:
        # The first dimension is recovered from the byte count: a row of zero bytes hides it.
        raise ValueError(
            f"{where}: field {name!r} has shape {field.shape}: a variable-length field needs non-empty rows"
        )


def little_endian(dtype: np.dtype) -> np.dtype:
    """``dtype`` with little-endian byte order (the stored order, whatever the machine)."""
    return np.dtype(dtype).newbyteorder("<")


def array_to_bytes(array: np.ndarray) -> bytes:
    """The elements of ``array`` in C order, little-endian."""
    return np.asarray(array, dtype=little_endian(array.dtype)).tobytes(order="C")


def array_from_bytes(buf: bytes | memoryview, name: str, field: Field, where: str) -> np.ndarray:
    """Rebuild a field's array from its raw bytes (a writable copy in native byte order).

    Raises :class:`StoreError` naming ``where`` and the field when the byte count
    does not fit the field's dtype and shape (a damaged record).
    """
    dtype = np.dtype(field.dtype)
    count, rem = divmod(len(buf), dtype.itemsize)
    if rem:
        raise StoreError(f"{where}: field {name!r} holds {len(buf)} bytes, not a whole number of {dtype.name} items")
    flat = np.frombuffer(buf, dtype=little_endian(dtype), count=count)
    return reshape(flat.astype(dtype), name, field, where)


def reshape(flat: np.ndarray, name: str, field: Field, where: str) -> np.ndarray:
    """Give a flat array of a field's elements its per-sample shape, checking the count."""
    shape = sample_shape(flat.size, name, field, where)
    return flat.reshape(shape)


def sample_shape(count: int, name: str, field: Field, where: str) -> tuple[int, ...]:
    """The shape of one sample of ``field`` that holds ``count`` elements."""
    shape = tuple(field.shape or ())
    if field.variable_length:
        row = math.prod(shape[1:])
        rows, rem = divmod(count, row)
        if rem:
            raise StoreError(
                f"{where}: field {name!r} holds {count} elements, not a whole number of rows of {shape[1:]}"
            )
        return (rows, *shape[1:])
    if count != math.prod(shape):
        raise StoreError(f"{where}: field {name!r} holds {count} elements; its shape {shape} needs {math.prod(shape)}")
    return shape
