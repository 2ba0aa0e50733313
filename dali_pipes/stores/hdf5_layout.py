"""The HDF5 shard layout: the datasets and attributes that the writer and the merge write and the reader reads.

Layout of a shard (and of a merged file, which is one big shard)::

    /                      attrs: layout = "dali-pipes-hdf5", layout_version = 2,
                                  num_samples = n, fields = JSON of the manifest fields
    /<fixed array field>   dataset (n, *shape) of the field's dtype, chunked
    /<ragged field>/data   dataset: every sample's values, concatenated along axis 0
    /<ragged field>/offsets  int64 (n + 1,): sample i is data[offsets[i]:offsets[i + 1]]
    /__crc32c__            uint32 (n, number of fields): the CRC32C of each field of each sample,
                           fields in byte order of their names (since shard layout 3, when the
                           manifest's ``checksums`` lists ``crc32c``; checked on every read)

A *ragged* field is a ``bytes`` field (``data`` is uint8: the encoded images or
text back to back) or an array field with a variable first dimension (``data``
is ``(total_rows, *shape[1:])``, offsets count rows). Ragged ``data`` is one
contiguous dataset, so reading a sample reads exactly its bytes. Fixed arrays
are chunked with about 64 KiB per chunk (:func:`chunk_rows`): one sample per
chunk for big samples, many for small ones such as labels.

Reading a shard with plain h5py::

    with h5py.File("shard-00000.h5", "r") as f:
        o = f["image/offsets"]
        jpeg = f["image/data"][o[7]:o[8]].tobytes()
        label = f["label"][7]
"""

from __future__ import annotations

import json
import math
from typing import Mapping

import numpy as np

from dali_pipes.dataset.manifest import Field
from dali_pipes.stores.checksum import CRC_DATASET, CRC_DTYPE, check_record, check_rows, sample_crcs

__all__ = [
    "CHUNK_BYTES",
    "CRC_DATASET",
    "CRC_DTYPE",
    "LAYOUT",
    "LAYOUT_VERSION",
    "LIBVER",
    "MANIFEST_ATTR",
    "check_record",
    "check_rows",
    "chunk_rows",
    "data_dtype",
    "data_path",
    "is_ragged",
    "layout_attrs",
    "offsets_path",
    "row_shape",
    "sample_crcs",
]

LAYOUT = "dali-pipes-hdf5"
#: 2: with the record CRCs (:data:`CRC_DATASET`); 1: without.
LAYOUT_VERSION = 2
#: Fixed file-format bounds, so the same data gives the same bytes whatever h5py defaults to.
LIBVER = ("v110", "v110")
#: Target size of one chunk of a fixed array dataset.
CHUNK_BYTES = 64 << 10
#: The attribute of a merged file that holds the dataset's manifest JSON.
MANIFEST_ATTR = "manifest"


def is_ragged(field: Field) -> bool:
    """True for fields stored as concatenated ``data`` plus ``offsets``."""
    return field.kind == "bytes" or field.variable_length


def data_path(name: str, field: Field) -> str:
    """The dataset holding a field's values."""
    return f"{name}/data" if is_ragged(field) else name


def offsets_path(name: str) -> str:
    """The offsets dataset of a ragged field."""
    return f"{name}/offsets"


def data_dtype(field: Field) -> np.dtype:
    """The dtype of a field's ``data`` (uint8 for bytes fields)."""
    return np.dtype(np.uint8) if field.kind == "bytes" else np.dtype(field.dtype)


def row_shape(field: Field) -> tuple[int, ...]:
    """The shape of one row of a field's dataset: the sample shape, or a ragged field's trailing dims."""
    if field.kind == "bytes":
        return ()
    shape = tuple(field.shape or ())
    return shape[1:] if field.variable_length else shape


def chunk_rows(field: Field) -> int:
    """Samples per chunk of a fixed array field: about :data:`CHUNK_BYTES` a chunk, at least one sample."""
    row_bytes = data_dtype(field).itemsize * math.prod(row_shape(field))
    return max(1, CHUNK_BYTES // max(row_bytes, 1))


def layout_attrs(fields: Mapping[str, Field], num_samples: int) -> dict[str, object]:
    """The root attributes every shard and merged file carries."""
    return {
        "layout": LAYOUT,
        "layout_version": LAYOUT_VERSION,
        "num_samples": num_samples,
        "fields": json.dumps({name: f.to_json() for name, f in fields.items()}, sort_keys=True),
    }
