"""TFRecord framing and a small ``tf.train.Example`` codec, without a protobuf dependency.

**Framing.** A TFRecord file is a sequence of records::

    uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes
    length bytes of data          | uint32 masked CRC32C of the data

where ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2**32)``.
DALI's index file (``.idx``, as ``tfrecord2idx`` writes it) has one text line
per record: ``"{offset} {size}\\n"``, the record's byte offset and its full size
(``16 + length``).

**Example.** The data of each record is a serialized ``tf.train.Example``::

    Example  { Features features = 1; }
    Features { map<string, Feature> feature = 1; }
    Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }

with ``repeated bytes``/``float``/``int64 value = 1`` in the lists (numbers packed).
Encoding writes the features in the order given, so the output is deterministic;
decoding accepts any order, skips unknown fields and reads packed and unpacked
numbers, as any protobuf parser would.

**Fields.** How a manifest field maps to a feature (:func:`feature_kind`):

==========================================  =================================================
field                                       feature
==========================================  =================================================
``bytes`` (images, text)                    ``bytes_list`` of one element, the bytes
``float32`` and ``float16`` arrays          ``float_list``, flattened in C order
integer arrays (not uint64) and bool        ``int64_list``, flattened; cast back on read
anything else (float64, uint64, complex:    ``bytes_list`` of one element: the raw
no TensorFlow list holds them exactly)      little-endian bytes, flattened in C order
==========================================  =================================================

So ``tf.io.parse_single_example`` reads every field whose manifest dtype is
float32, int64 or bytes with ``FixedLenFeature``/``VarLenFeature`` of that dtype,
and narrower numbers as float32 or int64 (then cast). Shards written before this
layout (every array but float32 and integers wider than a byte in a ``bytes_list``
of raw bytes) are still read.

A variable-length field (shape ``(-1, ...)``) gets its first dimension back from
the number of values.
"""

from __future__ import annotations

import struct
from typing import Mapping, Union

import google_crc32c
import numpy as np

from dali_pipes.dataset.manifest import Field
from dali_pipes.stores.base import SampleDict, StoreError
from dali_pipes.stores.codec import array_from_bytes, array_to_bytes, reshape

#: Bytes before a record's data (length + its CRC) and after it (data CRC).
HEADER_SIZE = 12
FOOTER_SIZE = 4
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
#: Below this many values, varints are coded in plain Python (numpy's per-call cost dominates).
_SMALL = 32

BYTES_LIST, FLOAT_LIST, INT64_LIST = "bytes_list", "float_list", "int64_list"
_KIND_NUMBERS = {BYTES_LIST: 1, FLOAT_LIST: 2, INT64_LIST: 3}
_NUMBER_KINDS = {v: k for k, v in _KIND_NUMBERS.items()}

#: A decoded feature value: a list of byte strings, or a float32 / int64 array.
FeatureValue = Union[list, np.ndarray]


# --------------------------------------------------------------------------- framing


def masked_crc32c(data: bytes | np.ndarray) -> int:
    """TFRecord's masked CRC32C of ``data`` (bytes, or a contiguous uint8 array)."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32


def frame_header(length: int) -> bytes:
    """The 12 bytes before a record's data: its length and the length's masked CRC."""
    head = struct.pack("<Q", length)
    return head + struct.pack("<I", masked_crc32c(head))


def frame_footer(data: bytes) -> bytes:
    """The 4 bytes after a record's data: the data's masked CRC."""
    return struct.pack("<I", masked_crc32c(data))


def unframe(record: bytes, where: str) -> memoryview:
    """The data of one whole record (header, data, footer), with both CRCs checked.

    Returns a view of ``record``'s data bytes, not a copy (the decoder copies each
    value once, into what it returns). Raises :class:`StoreError` naming ``where``
    when the record is short, its length field disagrees with its size, or a CRC
    does not match.
    """
    if len(record) < HEADER_SIZE + FOOTER_SIZE:
        raise StoreError(f"{where}: record is {len(record)} bytes, shorter than a TFRecord frame (truncated file?)")
    (length,) = struct.unpack_from("<Q", record, 0)
    (length_crc,) = struct.unpack_from("<I", record, 8)
    if masked_crc32c(record[:8]) != length_crc:
        raise StoreError(f"{where}: length CRC mismatch (the record header is damaged)")
    if length != len(record) - HEADER_SIZE - FOOTER_SIZE:
        raise StoreError(
            f"{where}: record length is {length} bytes but its index entry gives "
            f"{len(record) - HEADER_SIZE - FOOTER_SIZE} (truncated file or stale .idx)"
        )
    (data_crc,) = struct.unpack_from("<I", record, HEADER_SIZE + length)
    # google_crc32c takes a numpy view but not a memoryview: either way, no copy of the data.
    if masked_crc32c(np.frombuffer(record, np.uint8, count=length, offset=HEADER_SIZE)) != data_crc:
        raise StoreError(f"{where}: data CRC mismatch (the record is damaged)")
    return memoryview(record)[HEADER_SIZE : HEADER_SIZE + length]


def index_line(offset: int, size: int) -> str:
    """One line of DALI's ``.idx`` file: ``"{offset} {size}\\n"``."""
    return f"{offset} {size}\n"


def parse_index(text: str, where: str) -> np.ndarray:
    """DALI ``.idx`` text -> an ``(n, 2)`` int64 array of ``(offset, size)``; StoreError if malformed."""
    try:
        values = np.array(text.split(), dtype=np.int64)
    except ValueError as exc:
        raise StoreError(f"{where}: not a TFRecord index ({exc})") from exc
    if values.size % 2:
        raise StoreError(f"{where}: not a TFRecord index (an odd number of values; truncated?)")
    return values.reshape(-1, 2)


# --------------------------------------------------------------------------- protobuf wire format


def _varint(value: int) -> bytes:
    value &= _U64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes, pos: int, end: int, where: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise StoreError(f"{where}: Example ends inside a varint (damaged record)")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _U64, pos
        shift += 7
        if shift >= 70:
            raise StoreError(f"{where}: varint longer than 10 bytes (damaged record)")


def encode_varints(values: np.ndarray) -> bytes:
    """Packed protobuf varints of integers (two's complement for negatives, as int64)."""
    flat = np.asarray(values).astype(np.int64, copy=False).ravel()
    if flat.size < _SMALL:
        return b"".join(_varint(int(v)) for v in flat)
    u = flat.view(np.uint64)
    nbytes = np.ones(u.shape, np.int64)
    for k in range(1, 10):
        nbytes += (u >> np.uint64(7 * k)) != 0
    groups = ((u[:, None] >> (np.arange(10, dtype=np.uint64) * np.uint64(7))) & np.uint64(0x7F)).astype(np.uint8)
    k = np.arange(10)[None, :]
    groups[k < nbytes[:, None] - 1] |= 0x80
    return groups[k < nbytes[:, None]].tobytes()


def decode_varints(buf: bytes | memoryview, where: str) -> np.ndarray:
    """Packed protobuf varints -> int64 array (inverse of :func:`encode_varints`).

    Vectorised by byte position within a varint (at most 10 passes over the values),
    so the temporaries are the size of the values, not eight bytes per input byte.
    """
    if len(buf) < _SMALL:
        out, pos = [], 0
        while pos < len(buf):
            value, pos = _read_varint(buf, pos, len(buf), where)
            out.append(value)
        return np.array(out, dtype=np.uint64).view(np.int64)
    b = np.frombuffer(buf, np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if ends.size == 0 or ends[-1] != b.size - 1:
        raise StoreError(f"{where}: packed int64 list ends inside a varint (damaged record)")
    if ends.size == b.size:  # every value below 128 (labels, small counts): one byte each
        return b.astype(np.int64)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    longest = int(lengths.max())
    if longest > 10:
        raise StoreError(f"{where}: varint longer than 10 bytes (damaged record)")
    values = (b[starts] & 0x7F).astype(np.uint64)
    for k in range(1, longest):
        longer = np.flatnonzero(lengths > k)
        values[longer] |= (b[starts[longer] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return values.view(np.int64)


def _len_field(number: int, parts: list[bytes], size: int) -> tuple[list[bytes], int]:
    """A length-delimited field around already-encoded ``parts`` of total ``size``."""
    head = _varint(number << 3 | 2) + _varint(size)
    return [head, *parts], len(head) + size


def encode_example(features: Mapping[str, tuple[str, object]]) -> bytes:
    """Serialize ``{name: (kind, value)}`` as a ``tf.train.Example``.

    ``kind`` is ``"bytes_list"`` (value: a list of bytes), ``"float_list"``
    (float32 array) or ``"int64_list"`` (integer array).
    """
    entries: list[bytes] = []
    total = 0
    for name, (kind, value) in features.items():
        if kind == BYTES_LIST:
            body: list[bytes] = []
            size = 0
            for item in value:  # type: ignore[union-attr]
                p, s = _len_field(1, [item], len(item))
                body += p
                size += s
        elif kind == FLOAT_LIST:
            packed = np.ascontiguousarray(value, dtype="<f4").tobytes()
            body, size = _len_field(1, [packed], len(packed)) if packed else ([], 0)
        elif kind == INT64_LIST:
            packed = encode_varints(value)  # type: ignore[arg-type]
            body, size = _len_field(1, [packed], len(packed)) if packed else ([], 0)
        else:
            raise ValueError(f"feature {name!r}: unknown kind {kind!r}")
        feature, fsize = _len_field(_KIND_NUMBERS[kind], body, size)
        key = name.encode("utf-8")
        key_part, ksize = _len_field(1, [key], len(key))
        value_part, vsize = _len_field(2, feature, fsize)
        entry, esize = _len_field(1, key_part + value_part, ksize + vsize)
        entries += entry
        total += esize
    example, _ = _len_field(1, entries, total)
    return b"".join(example)


def _fields(buf: bytes, start: int, end: int, where: str):
    """Yield ``(number, wire_type, value)`` for each field of a message in ``buf[start:end]``.

    Length-delimited values are ``(begin, stop)`` positions; varints are ints;
    fixed32/64 values are their positions too.
    """
    pos = start
    while pos < end:
        tag, pos = _read_varint(buf, pos, end, where)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos, end, where)
            yield number, wire, value
        elif wire == 2:
            size, pos = _read_varint(buf, pos, end, where)
            if pos + size > end:
                raise StoreError(f"{where}: Example field runs past its message (damaged record)")
            yield number, wire, (pos, pos + size)
            pos += size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > end:
                raise StoreError(f"{where}: Example field runs past its message (damaged record)")
            yield number, wire, (pos, pos + size)
            pos += size
        else:
            raise StoreError(f"{where}: unsupported protobuf wire type {wire} (not a tf.train.Example?)")


def decode_example(buf: bytes | memoryview, where: str) -> dict[str, tuple[str, FeatureValue]]:
    """Parse a serialized ``tf.train.Example`` into ``{name: (kind, value)}``.

    ``bytes_list`` values are lists of ``bytes``; ``float_list`` values float32
    arrays; ``int64_list`` values int64 arrays, all independent of ``buf``. Raises
    :class:`StoreError` naming ``where`` for anything that is not a well-formed Example.
    """
    out: dict[str, tuple[str, FeatureValue]] = {}
    for name, (kind, value) in _decode_example(memoryview(buf), where).items():
        if kind == BYTES_LIST:
            out[name] = (kind, [bytes(item) for item in value])
        else:
            # A float list may be a little-endian view of buf: a native copy of its own.
            out[name] = (kind, np.array(value, dtype=np.float32 if kind == FLOAT_LIST else np.int64))
    return out


def _decode_example(buf: memoryview, where: str) -> dict[str, tuple[str, FeatureValue]]:
    """:func:`decode_example` without its copies: values may be views of ``buf``.

    ``bytes_list`` items are memoryviews and a packed ``float_list`` is a read-only
    little-endian view (see :func:`_decode_feature`); :func:`decode_example` copies them.
    """
    return {
        name: _decode_feature(buf, span, f"{where}, feature {name!r}")
        for name, span in _feature_spans(buf, where).items()
    }


def _feature_spans(buf: memoryview, where: str) -> dict[str, tuple[int, int] | None]:
    """Each feature's name -> the span of its undecoded ``Feature`` message in ``buf`` (``None``: no value).

    Walks only the Example's map entries, a few varints and the name each: the
    lists inside are not parsed, so a caller decodes only the features it wants
    (:func:`_decode_feature`). A name given twice keeps its last entry, as a
    protobuf map does.
    """
    spans: dict[str, tuple[int, int] | None] = {}
    for number, wire, features in _fields(buf, 0, len(buf), where):
        if number != 1 or wire != 2:
            continue
        for enumber, ewire, entry in _fields(buf, *features, where):
            if enumber != 1 or ewire != 2:
                continue
            name, feature = None, None
            for knumber, kwire, span in _fields(buf, *entry, where):
                if knumber == 1 and kwire == 2:
                    try:
                        name = str(buf[span[0] : span[1]], "utf-8")
                    except UnicodeDecodeError as exc:
                        raise StoreError(f"{where}: a feature name is not UTF-8 (damaged record)") from exc
                elif knumber == 2 and kwire == 2:
                    feature = span
            if name is None:
                raise StoreError(f"{where}: an Example feature has no name (damaged record)")
            spans[name] = feature
    return spans


def _decode_feature(buf: memoryview, span: tuple[int, int] | None, where: str) -> tuple[str, FeatureValue]:
    # Values stay views of buf (a float list, bytes items), so that decode_sample
    # copies each value exactly once, into the array (or bytes) it returns.
    kind = None
    items: list = []
    if span is not None:
        for number, wire, lst in _fields(buf, *span, where):
            if number in _NUMBER_KINDS and wire == 2:
                kind, items = _NUMBER_KINDS[number], []  # the last member of a oneof wins
                for vnumber, vwire, value in _fields(buf, *lst, where):
                    if vnumber == 1:
                        items.append((vwire, value))
    if kind is None:
        raise StoreError(f"{where}: the feature holds no list")
    if kind == BYTES_LIST:
        return kind, [buf[v[0] : v[1]] for w, v in items if w == 2]
    if kind == FLOAT_LIST:
        if any(w == 2 and (v[1] - v[0]) % 4 for w, v in items):
            raise StoreError(f"{where}: packed float list is not a whole number of floats (damaged record)")
        # Views of buf, no copy; a writer packs the list into one item, which is then returned as it is.
        chunks = [
            np.frombuffer(buf, dtype="<f4", count=(v[1] - v[0]) // 4, offset=v[0]) for w, v in items if w in (2, 5)
        ]
        if len(chunks) == 1:
            return kind, chunks[0]
        return kind, np.concatenate(chunks) if chunks else np.zeros(0, "<f4")
    chunks = []
    for w, v in items:
        if w == 2:
            chunks.append(decode_varints(buf[v[0] : v[1]], where))
        elif w == 0:
            chunks.append(np.array([v], dtype=np.uint64).view(np.int64))
    if len(chunks) == 1:
        return kind, chunks[0]
    return kind, np.concatenate(chunks) if chunks else np.zeros(0, np.int64)


# --------------------------------------------------------------------------- samples <-> Examples


def feature_kind(field: Field) -> str:
    """The Example list a field is stored in (see the table in the module docstring)."""
    if field.kind == "bytes":
        return BYTES_LIST
    dtype = np.dtype(field.dtype)
    if dtype in (np.float32, np.float16):
        return FLOAT_LIST
    if dtype.kind == "b" or (dtype.kind in "iu" and dtype != np.uint64):
        return INT64_LIST
    return BYTES_LIST


def _cast_ints(values: np.ndarray, name: str, field: Field, where: str) -> np.ndarray:
    """An int64 list as the field's integer (or bool) dtype; StoreError for a value the dtype cannot hold."""
    dtype = np.dtype(field.dtype)
    if dtype == np.int64:
        return values
    low, high = (0, 1) if dtype.kind == "b" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
    if values.size and (values.min() < low or values.max() > high):
        raise StoreError(f"{where}: feature {name!r} holds values outside {dtype.name}'s range {low}..{high}")
    return values.astype(dtype)


def encode_sample(fields: Mapping[str, Field], sample: Mapping[str, object]) -> bytes:
    """A checked sample (bytes and arrays of the declared dtypes) as a serialized Example."""
    features: dict[str, tuple[str, object]] = {}
    for name, field in fields.items():
        value = sample[name]
        kind = feature_kind(field)
        if field.kind == "bytes":
            features[name] = (kind, [value])
        elif kind == BYTES_LIST:
            features[name] = (kind, [array_to_bytes(value)])  # type: ignore[arg-type]
        else:
            features[name] = (kind, value)
    return encode_example(features)


def decode_sample(fields: Mapping[str, Field], data: bytes | memoryview, where: str) -> SampleDict:
    """A serialized Example -> the ``fields`` of the sample (bytes, or arrays of the declared dtype and shape).

    Only the features named in ``fields`` are decoded: the others are skipped
    over, neither parsed, varint-decoded, checked nor copied (so a subset of the
    fields costs the walk over the Example's entries plus the decoding of that
    subset). Each value is copied once, from ``data`` into what is returned
    (writable, native byte order, independent of ``data``); integer lists,
    decoded into a new array anyway, are cast only when the field's dtype is not int64.
    """
    buf = memoryview(data)
    spans = _feature_spans(buf, where)
    sample: SampleDict = {}
    for name, field in fields.items():
        if name not in spans:
            raise StoreError(f"{where}: the Example has no feature {name!r} (features: {sorted(spans)})")
        kind, value = _decode_feature(buf, spans[name], f"{where}, feature {name!r}")
        expected = feature_kind(field)
        # A bytes_list of raw bytes is also the layout of arrays in shards written before int64/float lists.
        if kind != expected and not (kind == BYTES_LIST and field.kind == "array"):
            raise StoreError(f"{where}: feature {name!r} is a {kind}, expected a {expected}")
        if kind == BYTES_LIST:
            if len(value) != 1:
                raise StoreError(f"{where}: feature {name!r} holds {len(value)} byte strings, expected 1")
            sample[name] = bytes(value[0]) if field.kind == "bytes" else array_from_bytes(value[0], name, field, where)
        elif kind == FLOAT_LIST:
            sample[name] = reshape(value.astype(field.dtype), name, field, where)  # the one copy out of data
        else:
            sample[name] = reshape(_cast_ints(value, name, field, where), name, field, where)
    return sample
