"""One :class:`~converters.base.ShardWriter` per shard format, keyed by the manifest's ``format``.

Each writer lives next to its reader's layout: :mod:`dali_pipes.stores.lmdb`,
:mod:`dali_pipes.stores.hdf5`, :mod:`dali_pipes.stores.tfexample`.
"""

from __future__ import annotations

from converters.base import ConversionError, ShardWriter
from converters.writers.hdf5 import Hdf5ShardWriter
from converters.writers.lmdb import LmdbShardWriter
from converters.writers.tfrecord import TFRecordShardWriter

#: Manifest ``format`` -> writer class.
WRITERS: dict[str, type[ShardWriter]] = {
    cls.format: cls for cls in (LmdbShardWriter, Hdf5ShardWriter, TFRecordShardWriter)
}


def writer_class(fmt: str) -> type[ShardWriter]:
    """The writer class of a shard format; :class:`ConversionError` for an unknown one."""
    try:
        return WRITERS[fmt]
    except KeyError:
        raise ConversionError(f"unknown format {fmt!r}; expected one of {', '.join(WRITERS)}") from None


__all__ = ["WRITERS", "writer_class", "LmdbShardWriter", "Hdf5ShardWriter", "TFRecordShardWriter"]
