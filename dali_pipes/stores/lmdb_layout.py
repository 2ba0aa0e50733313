"""The LMDB record layout: the keys and bytes that the writer writes and the reader reads.

Layout: one LMDB environment per shard, a single file (``subdir=False``), the
main (unnamed) database only. Every field of every sample is one record::

    b"0000000042.crc32c" -> the CRC32C of each field's value: little-endian uint32s, fields by name
    b"0000000042/image"  -> the image's original bytes
    b"0000000042/label"  -> the raw little-endian bytes of the label array
    b"__len__"           -> the shard's sample count, ASCII decimal

The key is the sample's index in the shard, zero-padded to 10 digits, ``/``,
and the field name in UTF-8, so keys sort in write order (the writer appends
with ``MDB_APPEND``). Bytes fields hold their bytes; array fields the raw
array bytes of :mod:`dali_pipes.stores.codec` (dtype and shape come from the
manifest). The ``.crc32c`` record (sorting before the sample's fields: ``.`` < ``/``)
is written since shard layout 3 (then the manifest's ``checksums`` lists ``crc32c``) and checked on every read (:mod:`dali_pipes.stores.checksum`).
Nothing is pickled. A user can read a shard with plain ``lmdb``
(in a process with no store open on it: py-lmdb opens a file once per process)::

    env = lmdb.open("shard-00000.lmdb", subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        jpeg = txn.get(b"0000000000/image")
"""

from __future__ import annotations

from dali_pipes.stores.checksum import CRC_DTYPE, check_record, check_records, check_rows, sample_crcs
from dali_pipes.stores.codec import array_from_bytes, array_to_bytes, little_endian

__all__ = [
    "CRC_DTYPE",
    "LEN_KEY",
    "array_from_bytes",
    "array_to_bytes",
    "check_record",
    "check_records",
    "check_rows",
    "crc_key",
    "little_endian",
    "sample_crcs",
    "sample_key",
]

#: Key of the sample-count record (sorts after every sample key).
LEN_KEY = b"__len__"


def sample_key(index: int, name: str) -> bytes:
    """The LMDB key of field ``name`` of local sample ``index``."""
    return b"%010d/%s" % (index, name.encode("utf-8"))


def crc_key(index: int) -> bytes:
    """The LMDB key of the field CRCs of local sample ``index``."""
    return b"%010d.crc32c" % index
