"""How a dataset's fields come out of the loader: the DALI type of each field dtype, and the names taken beside them.

Both the pipeline specs and the loader's external source need these, so they
live below both (no DALI import here: the names are looked up in
``nvidia.dali.types`` where a graph is built).
"""

from __future__ import annotations

__all__ = ["DALI_TYPE_NAMES", "RESERVED_OUTPUTS"]

#: Outputs the loader adds after the fields (``is_pad``, then ``index`` when asked for); no spec may return these.
RESERVED_OUTPUTS = ("is_pad", "index")

#: The DALI type (a ``nvidia.dali.types`` name) of each numpy dtype a field may have, by numpy name.
DALI_TYPE_NAMES = {
    "bool": "BOOL",
    "float16": "FLOAT16",
    "float32": "FLOAT",
    "float64": "FLOAT64",
    **{name: name.upper() for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
}
