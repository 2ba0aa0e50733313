"""The on-disk contract between converters and readers: ``index.json``.

This module is the only code that knows the manifest's layout. Writers build a
:class:`Manifest` and call :func:`write_manifest`; readers call
:func:`load_manifest`, which validates everything before any shard is touched:
the kind and version, the format, the fields, the counts, and that every shard
path stays inside the dataset folder.

A dataset folder looks like::

    OUT/
      index.json              # written last, atomically
      errors.jsonl            # inputs left out, one JSON object per line (may be empty)
      shard-00000.lmdb        # or .h5, or .tfrecord (+ .tfrecord.idx)
      ...

Global sample ``i`` lives in the shard found by a cumulative count over the
shards' ``num_samples`` (:meth:`Manifest.locate`).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from dali_pipes.dataset.fileio import atomic_write_bytes
from dali_pipes.dataset.folder import JOB_DIR as JOB_DIR
from dali_pipes.dataset.folder import MANIFEST_NAME as MANIFEST_NAME
from dali_pipes.dataset.folder import no_manifest_message
from dali_pipes.dataset.sample_order import SampleOrder, parse_order

ERRORS_NAME = "errors.jsonl"
KIND = "dali-pipes"
VERSION = 1
FORMATS = ("lmdb", "hdf5", "tfrecord")

#: Field kinds. ``bytes`` fields hold opaque byte strings (encoded images, UTF-8
#: keys); ``array`` fields hold numpy arrays of a fixed dtype and shape, where the
#: first dimension may be ``-1`` (a per-sample count, such as the boxes of an image).
FIELD_KINDS = ("bytes", "array")
#: Encodings a ``bytes`` field may declare. ``image``: an encoded image file
#: (JPEG, PNG, ...) kept as its original bytes; ``utf-8``: text; ``raw``: anything else.
BYTES_ENCODINGS = ("image", "utf-8", "raw")
#: numpy dtype kinds an ``array`` field may have, as the stores read them back: bool,
#: signed and unsigned integers, floats, complex. No structured, object, string or time types.
ARRAY_DTYPE_KINDS = "biufc"
#: Counts, sizes and dimensions must fit a signed 64-bit integer (numpy, HDF5 and the readers use one).
MAX_COUNT = 2**63 - 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Checksums a dataset can have (the manifest's ``checksums``): ``sha256`` of every shard file
#: (checked by ``dali-pipes verify``) and ``crc32c`` of every record (checked on every read;
#: TFRecord's own, and since shard layout 3 one per field of each sample in LMDB and HDF5).
CHECKSUMS = ("sha256", "crc32c")


def legacy_checksums(fmt: str) -> tuple[str, ...]:
    """The checksums of a dataset whose manifest predates the ``checksums`` entry: no LMDB or HDF5 record CRCs."""
    return ("sha256", "crc32c") if fmt == "tfrecord" else ("sha256",)


class ManifestError(ValueError):
    """A manifest that is missing, malformed, of an unknown version, or unsafe."""


@dataclass(frozen=True)
class Field:
    """One named field of every sample.

    ``kind`` is ``"bytes"`` (with an ``encoding``) or ``"array"`` (with ``dtype``
    and ``shape``; a leading ``-1`` marks a per-sample length).
    """

    kind: str
    encoding: str | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @staticmethod
    def image() -> "Field":
        """An encoded image stored as its original file bytes."""
        return Field(kind="bytes", encoding="image")

    @staticmethod
    def text() -> "Field":
        """A UTF-8 string stored as bytes."""
        return Field(kind="bytes", encoding="utf-8")

    @staticmethod
    def array(dtype: Any, shape: tuple[int, ...] | list[int]) -> "Field":
        """A numpy array of ``dtype`` and per-sample ``shape`` (``-1`` first for a variable length)."""
        return Field(kind="array", dtype=np.dtype(dtype).name, shape=tuple(int(s) for s in shape))

    @property
    def is_image(self) -> bool:
        return self.kind == "bytes" and self.encoding == "image"

    @property
    def variable_length(self) -> bool:
        """True when the first dimension differs between samples."""
        return bool(self.shape) and self.shape[0] == -1

    def to_json(self) -> dict[str, Any]:
        if self.kind == "bytes":
            return {"kind": "bytes", "encoding": self.encoding}
        return {"kind": "array", "dtype": self.dtype, "shape": list(self.shape or ())}

    @staticmethod
    def from_json(name: str, data: Any, where: str) -> "Field":
        """Validate one entry of the manifest's ``fields``; :class:`ManifestError` naming it otherwise."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: field {name!r} must be an object, got {type(data).__name__}")
        kind = data.get("kind")
        if kind == "bytes":
            encoding = data.get("encoding", "raw")
            if not isinstance(encoding, str) or encoding not in BYTES_ENCODINGS:
                raise ManifestError(
                    f"{where}: field {name!r} has unknown encoding {encoding!r}; expected one of {BYTES_ENCODINGS}"
                )
            return Field(kind="bytes", encoding=encoding)
        if kind == "array":
            dtype = _parse_dtype(name, data.get("dtype"), where)
            shape = _parse_shape(name, data.get("shape"), dtype, where)
            return Field(kind="array", dtype=dtype.name, shape=shape)
        raise ManifestError(f"{where}: field {name!r} has unknown kind {kind!r}; expected one of {FIELD_KINDS}")


def _parse_dtype(name: str, value: Any, where: str) -> np.dtype:
    """A plain numeric or bool dtype from its name; structured, object, string and time dtypes are refused."""
    if not isinstance(value, str):
        raise ManifestError(f"{where}: field {name!r} needs a dtype name such as 'uint8' or 'float32', got {value!r}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy deprecates some aliases; the name is checked below anyway
            dtype = np.dtype(value)
    except Exception as exc:  # numpy's dtype parser raises TypeError, ValueError, SyntaxError...
        raise ManifestError(f"{where}: field {name!r} has unknown dtype {value!r}") from exc
    if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in ARRAY_DTYPE_KINDS:
        raise ManifestError(
            f"{where}: field {name!r} has dtype {value!r} ({dtype.name}); only bool, integer, float and complex "
            "dtypes are stored (no structured, object, string or time dtypes)"
        )
    return dtype


def _parse_shape(name: str, value: Any, dtype: np.dtype, where: str) -> tuple[int, ...]:
    """A per-sample shape: non-negative dims that hold values, the first of which may be -1 (variable)."""
    if not isinstance(value, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        raise ManifestError(f"{where}: field {name!r} needs a list of integers as its shape, got {value!r}")
    if len(value) > 32:  # numpy's limit on dimensions is 64; a sample of more than 32 is surely damage
        raise ManifestError(f"{where}: field {name!r} has {len(value)} dimensions; at most 32 are allowed")
    if any(s < 0 for s in value[1:]) or (value and value[0] < -1):
        raise ManifestError(f"{where}: field {name!r} has shape {value}; only the first dimension may be -1 (variable)")
    if any(s == 0 for s in value):
        raise ManifestError(f"{where}: field {name!r} has shape {value}, which holds no values")
    if math.prod(abs(s) for s in value) * dtype.itemsize > MAX_COUNT:
        raise ManifestError(f"{where}: field {name!r} has shape {value}, too large for one sample")
    return tuple(value)


@dataclass(frozen=True)
class Shard:
    """One shard file: its path relative to the dataset folder, its count, size and hash.

    ``index_path`` names a sidecar index (DALI's ``.idx`` for TFRecord shards),
    with its own hash in ``index_sha256``.
    """

    path: str
    num_samples: int
    bytes: int
    sha256: str
    index_path: str | None = None
    index_sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "num_samples": self.num_samples,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "index_path": self.index_path,
            "index_sha256": self.index_sha256,
        }


@dataclass(frozen=True)
class Manifest:
    """A validated ``index.json``. Build it with keyword arguments; load it with :func:`load_manifest`."""

    format: str
    fields: Mapping[str, Field]
    shards: tuple[Shard, ...]
    source: Mapping[str, Any]
    classes: tuple[str, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    created_by: str = ""
    version: int = VERSION
    #: What the shards carry (see :data:`CHECKSUMS`); the default is what this version's writers write.
    checksums: tuple[str, ...] = CHECKSUMS
    #: The order the samples were written in; ``None``: not recorded (older versions wrote the source's order).
    order: SampleOrder | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "checksums", tuple(self.checksums))
        if self.classes is not None:
            object.__setattr__(self, "classes", tuple(self.classes))
        # Python integers: numpy's cumsum would wrap around silently past 2**63.
        offsets = list(itertools.accumulate((s.num_samples for s in self.shards), initial=0))
        object.__setattr__(self, "_offsets", offsets)

    @property
    def num_samples(self) -> int:
        """The total number of samples over all shards."""
        return self._offsets[-1]  # type: ignore[attr-defined]

    @property
    def shard_offsets(self) -> list[int]:
        """Global index of the first sample of each shard, then the total."""
        return list(self._offsets)  # type: ignore[attr-defined]

    def locate(self, index: int) -> tuple[int, int]:
        """Return ``(shard_number, index_within_shard)`` of global sample ``index``."""
        n = self.num_samples
        if not 0 <= index < n:
            raise IndexError(f"sample index {index} is out of range for a dataset of {n} samples")
        offsets = self._offsets  # type: ignore[attr-defined]
        shard = bisect.bisect_right(offsets, index) - 1
        return shard, index - offsets[shard]

    def iter_shards(self) -> Iterator[tuple[int, Shard]]:
        """Each shard with the global index of its first sample."""
        for start, shard in zip(self._offsets, self.shards):  # type: ignore[attr-defined]
            yield start, shard

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "version": self.version,
            "format": self.format,
            "fields": {name: f.to_json() for name, f in self.fields.items()},
            "classes": list(self.classes) if self.classes is not None else None,
            "num_samples": self.num_samples,
            "shards": [s.to_json() for s in self.shards],
            "source": dict(self.source),
            "extra": dict(self.extra),
            "created_by": self.created_by,
            "checksums": list(self.checksums),
            "order": self.order.to_json() if self.order is not None else None,
        }


def manifest_path(dataset: str | os.PathLike) -> Path:
    """The ``index.json`` of a dataset folder (or the path itself if it names the file)."""
    path = Path(dataset)
    return path if path.name == MANIFEST_NAME else path / MANIFEST_NAME


def write_manifest(dataset: str | os.PathLike, manifest: Manifest) -> Path:
    """Write ``index.json`` atomically; the dataset is complete once this returns."""
    target = manifest_path(dataset)
    # Round-trip through the parser: never write what we would refuse to read.
    parse_manifest(manifest.to_json(), where=str(target))
    text = json.dumps(manifest.to_json(), indent=1, sort_keys=False) + "\n"
    atomic_write_bytes(target, text.encode("utf-8"))
    return target


def load_manifest(dataset: str | os.PathLike, *, check_paths: bool = True) -> Manifest:
    """Read and validate a dataset's ``index.json``.

    Raises :class:`ManifestError` naming the file when it is missing, is not
    JSON, is of another kind or version, has inconsistent counts, or names shard
    paths that leave the dataset folder (``..``, absolute paths, symlinks out).
    """
    path = manifest_path(dataset)
    if not path.is_file():
        raise ManifestError(no_manifest_message(path.parent))
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ManifestError(
            f"{path}: not valid JSON ({exc}); the manifest is damaged, convert the dataset again"
        ) from exc
    manifest = parse_manifest(data, where=str(path))
    if check_paths:
        check_shard_paths(manifest, path.parent)
    return manifest


def _refuse_constant(name: str) -> None:
    # Python's json reads NaN and Infinity, which are not JSON and never written here.
    raise ValueError(f"{name} is not a JSON value")


def _is_count(value: Any) -> bool:
    """A JSON integer in ``0 .. 2**63 - 1`` (``true`` is not a count, though Python's bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def check_field_name(name: object, where: str) -> None:
    """Refuse a field name no format can store (it names files, keys and HDF5 paths): ManifestError naming it."""
    if not isinstance(name, str) or not name or "/" in name or _has_nul(name) or name in (".", ".."):
        raise ManifestError(f"{where}: field name {name!r} is not allowed (empty, '.', '..', or contains '/' or NUL)")


def _has_nul(value: str) -> bool:
    return "\0" in value


def parse_manifest(data: Any, *, where: str = MANIFEST_NAME) -> Manifest:
    """Validate the JSON object of a manifest and build a :class:`Manifest`."""
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("kind") != KIND:
        raise ManifestError(f"{where}: not a dali-pipes manifest (kind is {data.get('kind')!r})")
    version = _parse_version(data, where)
    fmt = data.get("format")
    if fmt not in FORMATS:
        raise ManifestError(f"{where}: unknown format {fmt!r}; expected one of {FORMATS}")

    raw_fields = data.get("fields")
    if not isinstance(raw_fields, dict) or not raw_fields:
        raise ManifestError(f"{where}: 'fields' must be a non-empty object")
    fields = {}
    for name, spec in raw_fields.items():
        check_field_name(name, where)
        fields[name] = Field.from_json(name, spec, where)

    classes = data.get("classes")
    if classes is not None:
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise ManifestError(f"{where}: 'classes' must be a list of strings or null")
        classes = tuple(classes)

    shards = _parse_shards(data, where)

    source = _optional_object(data, "source", where)
    extra = _optional_object(data, "extra", where)
    created_by = data.get("created_by")
    if created_by is None:
        created_by = ""
    if not isinstance(created_by, str):
        raise ManifestError(f"{where}: 'created_by' must be a string, got {created_by!r}")
    return Manifest(
        format=fmt,
        fields=fields,
        shards=shards,
        source=source,
        classes=classes,
        extra=extra,
        created_by=created_by,
        version=version,
        checksums=_parse_checksums(data, fmt, where),
        order=parse_order(data.get("order"), where, ManifestError),
    )


def _parse_version(data: dict[str, Any], where: str) -> int:
    """The manifest's integer ``version``: one this dali-pipes reads (1 to :data:`VERSION`), else an error saying why."""
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestError(f"{where}: version must be an integer, got {version!r}")
    if version > VERSION:
        raise ManifestError(
            f"{where}: manifest version {version} is newer than this dali-pipes reads ({VERSION}); upgrade dali-pipes"
        )
    if version < 1:
        raise ManifestError(f"{where}: unknown manifest version {version}")
    return version


def _parse_shards(data: dict[str, Any], where: str) -> tuple[Shard, ...]:
    """The ``shards`` list, checked against ``num_samples`` (their total) and for two files named alike."""
    raw_shards = data.get("shards")
    if not isinstance(raw_shards, list) or not raw_shards:
        raise ManifestError(f"{where}: 'shards' must be a non-empty list")
    shards = tuple(_parse_shard(i, s, where) for i, s in enumerate(raw_shards))
    total = sum(s.num_samples for s in shards)
    declared = data.get("num_samples")
    if not _is_count(declared):
        raise ManifestError(f"{where}: num_samples is {declared!r}; expected a non-negative integer below 2**63")
    if declared != total:
        raise ManifestError(
            f"{where}: num_samples is {declared!r} but the shards hold {total} samples; the manifest is inconsistent"
        )
    files = [s.path for s in shards] + [s.index_path for s in shards if s.index_path is not None]
    if len(set(files)) != len(files):
        raise ManifestError(f"{where}: two shards (or a shard and an index) name the same path")
    return shards


def _parse_checksums(data: dict[str, Any], fmt: str, where: str) -> tuple[str, ...]:
    value = data.get("checksums")
    if value is None:  # written before the entry existed
        return legacy_checksums(fmt)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{where}: 'checksums' must be a list of strings, got {value!r}")
    unknown = [v for v in value if v not in CHECKSUMS]
    if unknown:
        raise ManifestError(
            f"{where}: unknown checksum {unknown[0]!r} (known: {', '.join(CHECKSUMS)}); upgrade dali-pipes"
        )
    return tuple(value)


def _optional_object(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: {key!r} must be an object or null, got {type(value).__name__}")
    return value


def _parse_shard(i: int, data: Any, where: str) -> Shard:
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: shard {i} must be an object")
    path = data.get("path")
    if not isinstance(path, str) or not path or _has_nul(path):
        raise ManifestError(f"{where}: shard {i} has no valid path (a non-empty string without NUL), got {path!r}")
    for name in ("num_samples", "bytes"):
        value = data.get(name)
        if not _is_count(value):
            raise ManifestError(
                f"{where}: shard {i} ({path}) has {name} {value!r}; expected a non-negative integer below 2**63"
            )
    digest = data.get("sha256")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise ManifestError(f"{where}: shard {i} ({path}) has no valid sha256 (64 lowercase hex digits)")
    index_path = data.get("index_path")
    index_sha = data.get("index_sha256")
    if index_path is not None and (not isinstance(index_path, str) or not index_path or _has_nul(index_path)):
        raise ManifestError(f"{where}: shard {i} ({path}) has index_path {index_path!r}; expected a file name or null")
    if (index_path is None) != (index_sha is None):
        raise ManifestError(f"{where}: shard {i} ({path}) needs both index_path and index_sha256, or neither")
    if index_sha is not None and (not isinstance(index_sha, str) or not _SHA256.fullmatch(index_sha)):
        raise ManifestError(f"{where}: shard {i} ({path}) has no valid index_sha256 (64 lowercase hex digits)")
    return Shard(
        path=path,
        num_samples=data["num_samples"],
        bytes=data["bytes"],
        sha256=digest,
        index_path=index_path,
        index_sha256=index_sha,
    )


def check_shard_paths(manifest: Manifest, root: str | os.PathLike) -> None:
    """Refuse shard paths that are absolute, climb out with ``..``, or resolve outside ``root``."""
    root = Path(root).resolve()
    for shard in manifest.shards:
        for rel in (shard.path, shard.index_path):
            if rel is None:
                continue
            resolve_inside(root, rel)


def resolve_inside(root: str | os.PathLike, rel: str) -> Path:
    """``root / rel``, refusing anything that would leave ``root`` (the manifest must stay self-contained)."""
    root = Path(root).resolve()
    pure = Path(rel)
    if pure.is_absolute() or ".." in pure.parts:
        raise ManifestError(
            f"{root / MANIFEST_NAME}: shard path {rel!r} leaves the dataset folder; shard paths must be relative "
            "and stay inside it"
        )
    try:
        resolved = (root / pure).resolve()
    except (OSError, ValueError) as exc:  # a symlink loop, a name too long, a NUL byte
        raise ManifestError(f"{root / MANIFEST_NAME}: shard path {rel!r} cannot be resolved ({exc})") from exc
    if resolved == root:
        raise ManifestError(
            f"{root / MANIFEST_NAME}: shard path {rel!r} names the dataset folder itself, not a file in it"
        )
    if root not in resolved.parents:
        raise ManifestError(
            f"{root / MANIFEST_NAME}: shard path {rel!r} resolves to {resolved}, outside the dataset folder "
            "(a symlink out?); copy the shard into the dataset folder"
        )
    return resolved


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KB'`` (decimal units, as disks are sold)."""
    if n < 1000:
        return f"{int(n)} B"
    exp = min(int(math.log(n, 1000)), 4)
    return f"{n / 1000**exp:.1f} {'KMGT'[exp - 1]}B"
