"""``arrays``: named feature arrays from ``.npy``, ``.npz`` and HDF5 files, one sample per row.

Field names: a ``.npy`` file gives one field named by its stem; a ``.npz`` one
field per member; an HDF5 file one field per dataset, with the path inside the
file and ``/`` replaced by ``.`` (``feats/mel`` -> ``feats.mel``). The first axis
is the sample axis. A name found in several files is one field whose parts are
concatenated along axis 0 in the order the files are given.

Files may be URLs of object storage (``s3://``, ``gs://``, ...; a pattern such
as ``s3://b/feats-*.npy`` is expanded in the bucket): they are read by ranged
requests, never copied whole (:mod:`converters.sources.remote_arrays`).

Nothing is read while planning: :meth:`ArraysSource.iter_items` reads headers and
metadata only. In the workers, ``.npy`` files and members of uncompressed
``.npz`` archives (``np.savez``) are memory-mapped and HDF5 datasets are read a
row at a time. Members of compressed archives (``np.savez_compressed``) cannot
be read in part: each worker process decompresses such a member once, on first
use, and keeps it in memory, so each worker holds a full copy of it.
"""

from __future__ import annotations

import bisect
import logging
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Iterator, Sequence

import numpy as np

from converters.base import ConversionError, Item, Sample, SampleError, StreamingSource, absolute_path
from converters.remote_inputs import expand_url, is_url
from converters.sources import remote_arrays
from dali_pipes.dataset.manifest import Field

log = logging.getLogger(__name__)

NPY_SUFFIXES = (".npy",)
NPZ_SUFFIXES = (".npz",)
HDF5_SUFFIXES = (".h5", ".hdf5")
#: numpy dtype kinds that can be stored: bool, signed, unsigned, float, complex.
_STORABLE_KINDS = "biufc"


@dataclass(frozen=True)
class _Part:
    """One array in one file: where it is and what it holds (read from headers only)."""

    file: str
    member: str  # "" for .npy, the member name for .npz, the dataset path for HDF5
    kind: str  # "npy", "npz" or "hdf5"
    count: int
    dtype: np.dtype
    sample_shape: tuple[int, ...]

    @property
    def where(self) -> str:
        return f"{self.file}:{self.member}" if self.member else self.file


class ArraysSource(StreamingSource):
    """Rows of named arrays; see the module docstring for how files map to fields.

    ``fields`` selects (and orders) the fields to keep; by default every field is
    kept in the order first seen. Every kept field must end up with the same
    number of rows, and parts of one field must agree on dtype and per-sample
    shape. Arrays keep their dtype (in native byte order); object, string and
    structured dtypes are refused. ``Item.size`` is the bytes of one sample.
    """

    kind: ClassVar[str] = "arrays"

    def __init__(self, files: Sequence[str | os.PathLike], fields: Sequence[str] | None = None) -> None:
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        self.files = [absolute_path(f) for f in files]
        self.selected = list(fields) if fields is not None else None
        self._plan: dict[str, list[_Part]] | None = None
        self._starts: dict[str, list[int]] = {}  # per field: the first row of each part, then the total
        self._handles: dict[tuple[str, str], Any] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # Open files and memory maps stay in the process that opened them.
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    # -- planning (parent process, headers only) ---------------------------------------------

    def _fields_plan(self) -> dict[str, list[_Part]]:
        if self._plan is None:
            self._plan = _plan(self.files, self.selected)
            self._starts = {name: _offsets(parts) for name, parts in self._plan.items()}
        return self._plan

    def fields(self) -> dict[str, Field]:
        return {name: Field.array(parts[0].dtype, parts[0].sample_shape) for name, parts in self._fields_plan().items()}

    def __len__(self) -> int:
        plan = self._fields_plan()
        return sum(p.count for p in next(iter(plan.values())))

    def iter_items(self) -> Iterator[Item]:
        """One item per row; ``Item.data`` and ``Item.anchor`` are the row index."""
        return self.items_from(0)

    def items_from(self, anchor: int) -> Iterator[Item]:
        plan = self._fields_plan()
        size = sum(
            p.dtype.itemsize * int(np.prod(p.sample_shape, dtype=np.int64)) for p in (v[0] for v in plan.values())
        )
        return (Item(name=f"sample {i}", size=size, data=i, anchor=i) for i in range(anchor, len(self)))

    # -- loading (workers) ------------------------------------------------------------------------

    def load(self, item: Item) -> Sample:
        if self._pid != os.getpid():  # forked with a warm cache: never share HDF5 handles or maps
            self._handles = {}
            self._pid = os.getpid()
        index = item.data
        sample: Sample = {}
        for name, parts in self._fields_plan().items():
            offsets = self._starts[name]
            k = bisect.bisect_right(offsets, index) - 1
            part = parts[k]
            try:
                row = self._array(part)[index - offsets[k]]
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
                raise SampleError(
                    item.name, f"field {name!r}: cannot read row {index - offsets[k]} of {part.where} ({exc})"
                ) from None
            # A copy in native byte order: the manifest's dtype names carry no byte order.
            sample[name] = np.array(row, dtype=part.dtype.newbyteorder("="), copy=True)
        return sample

    def shard_done(self) -> None:
        """Unmap local ``.npy`` maps and close local HDF5 files: a map kept for the worker's life holds every page it
        read, so the worker's memory would grow with the input. Decompressed members stay (reading them again
        costs), and so do readers of files in object storage (a bounded block each; opening one again costs
        requests)."""
        if self._pid != os.getpid():
            return
        for key, handle in list(self._handles.items()):
            if is_url(key[0]) or (isinstance(handle, np.ndarray) and not isinstance(handle, np.memmap)):
                continue
            del self._handles[key]
            if key[1] == "" and hasattr(handle, "close") and not isinstance(handle, np.memmap):
                handle.close()  # an HDF5 file, after its datasets' entries (same file) went

    def _array(self, part: _Part) -> Any:
        key = (part.file, part.member)
        array = self._handles.get(key)
        if array is None:
            array = self._handles[key] = _open_array(part, self._handles)
        return array

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "files": list(self.files), "fields": self.selected}


def _offsets(parts: list[_Part]) -> list[int]:
    """The global index of each part's first row, then the total (empty parts share their neighbour's start)."""
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + p.count)
    return offsets


def _plan(files: list[str], selected: list[str] | None) -> dict[str, list[_Part]]:
    if not files:
        raise ConversionError("arrays: no input files; give one or more .npy, .npz or .h5 files")
    found: dict[str, list[_Part]] = {}
    for file in _expand(files):
        for name, part in _scan(file):
            found.setdefault(name, []).append(part)
    if selected is not None:
        unknown = [n for n in selected if n not in found]
        if unknown:
            raise ConversionError(
                f"arrays: no field named {', '.join(map(repr, unknown))} in {', '.join(files)}; "
                f"the files hold {', '.join(map(repr, found))}"
            )
        found = {n: found[n] for n in selected}
    if not found:
        raise ConversionError(f"arrays: {', '.join(files)} hold no arrays")

    for name, parts in found.items():
        first = parts[0]
        for part in parts[1:]:
            if part.dtype != first.dtype or part.sample_shape != first.sample_shape:
                raise ConversionError(
                    f"arrays: field {name!r} is {first.dtype} {first.sample_shape} per sample in {first.where} but "
                    f"{part.dtype} {part.sample_shape} in {part.where}; parts of a field must match"
                )
    counts = {name: sum(p.count for p in parts) for name, parts in found.items()}
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"{n!r}: {c}" for n, c in counts.items())
        raise ConversionError(
            f"arrays: fields have different sample counts ({listing}); every field needs one row per sample"
        )
    if not next(iter(counts.values())):
        raise ConversionError(f"arrays: {', '.join(files)} hold 0 samples; there is nothing to convert")
    return found


def _expand(files: list[str]) -> list[str]:
    """The input files, a URL pattern (``s3://b/feats-*.npy``) expanded in the bucket (a shell does it locally)."""
    out = []
    for file in files:
        if is_url(file) and any(c in file for c in "*?["):
            matches = expand_url(file)
            if not matches:
                raise ConversionError(f"{file}: no object matches; give .npy, .npz or .h5 files")
            out += matches
        else:
            out.append(file)
    return out


def _scan(file: str) -> list[tuple[str, _Part]]:
    """The ``(field name, part)`` pairs of one file (a local path or a URL), reading headers only."""
    path = PurePosixPath(file) if is_url(file) else Path(file)
    if not is_url(file) and not path.is_file():
        raise ConversionError(f"{file}: no such file; give .npy, .npz or .h5 files")
    suffix = path.suffix.lower()
    if suffix not in NPY_SUFFIXES + NPZ_SUFFIXES + HDF5_SUFFIXES:
        raise ConversionError(f"{file}: unknown array file type {suffix!r}; expected .npy, .npz, .h5 or .hdf5")
    # A URL is read by ranged requests (a missing object is named here), never copied whole.
    with remote_arrays.open_url(file) if is_url(file) else open(file, "rb") as opened:
        if suffix in NPY_SUFFIXES:
            _, dtype, shape, _ = _npy_header(opened, file)
            return [(path.stem, _part(file, "", "npy", dtype, shape))]
        if suffix in NPZ_SUFFIXES:
            return _scan_npz(file, opened)
        return _scan_hdf5(file, opened)


def _part(file: str, member: str, kind: str, dtype: np.dtype, shape: tuple[int, ...]) -> _Part:
    where = f"{file}:{member}" if member else file
    if dtype.kind not in _STORABLE_KINDS or dtype.fields is not None:
        raise ConversionError(
            f"{where}: dtype {dtype} cannot be stored; use numeric or boolean arrays (object, string and "
            "structured dtypes are refused)"
        )
    if len(shape) == 0:
        raise ConversionError(f"{where}: a scalar has no sample axis; arrays need the samples along axis 0")
    return _Part(file=file, member=member, kind=kind, count=int(shape[0]), dtype=dtype, sample_shape=tuple(shape[1:]))


def _npy_header(f: Any, where: str) -> tuple[int, np.dtype, tuple[int, ...], bool]:
    """Read a ``.npy`` header from ``f`` (left at the start of the data): ``(data offset, dtype, shape, fortran)``."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:  # 3.0 (utf-8 field names) has no public reader
            shape, fortran, dtype = np.lib.format._read_array_header(f, version)  # noqa: SLF001
    except (ValueError, OSError, struct.error) as exc:
        raise ConversionError(f"{where}: not a .npy array ({exc})") from None
    return f.tell(), dtype, tuple(shape), bool(fortran)


def _scan_npz(path: str, opened: Any) -> list[tuple[str, _Part]]:
    try:
        archive = zipfile.ZipFile(opened)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ConversionError(f"{path}: not a .npz archive ({exc})") from None
    parts = []
    with archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            member = info.filename[: -len(".npy")]
            with archive.open(info) as f:
                _, dtype, shape, _ = _npy_header(f, f"{path}:{member}")
            parts.append((member.replace("/", "."), _part(path, member, "npz", dtype, shape)))
    return parts


def _scan_hdf5(path: str, opened: Any) -> list[tuple[str, _Part]]:
    import h5py

    try:
        handle = h5py.File(opened, "r")
    except OSError as exc:
        raise ConversionError(f"{path}: not a readable HDF5 file ({exc})") from None
    parts: list[tuple[str, _Part]] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            dtype = obj.dtype
            if h5py.check_string_dtype(dtype) or h5py.check_vlen_dtype(dtype):
                dtype = np.dtype(object)
            parts.append((name.replace("/", "."), _part(path, name, "hdf5", dtype, tuple(obj.shape or ()))))

    with handle:
        handle.visititems(visit)
    names = [n for n, _ in parts]
    if len(set(names)) != len(names):
        raise ConversionError(f"{path}: two datasets map to the same field name after '/' -> '.' ({names})")
    return parts


def _open_array(part: _Part, handles: dict[tuple[str, str], Any]) -> Any:
    """An object indexable by row: a memory map, an in-memory array, an HDF5 dataset, or rows read by range."""
    remote = is_url(part.file)
    if part.kind == "npy":
        return remote_arrays.open_remote_npy(part.file, _npy_header) if remote else np.load(part.file, mmap_mode="r")
    if part.kind == "hdf5":
        import h5py

        file_key = (part.file, "")
        handle = handles.get(file_key)
        if handle is None:
            opened = remote_arrays.open_remote_hdf5(part.file) if remote else h5py.File(part.file, "r")
            handle = handles[file_key] = opened
        return handle[part.member]
    if remote:
        return remote_arrays.open_remote_npz_member(part.file, part.member, _npy_header)
    return _open_npz_member(part)


def _open_npz_member(part: _Part) -> np.ndarray:
    with zipfile.ZipFile(part.file) as archive:
        info = archive.getinfo(part.member + ".npy")
        if info.compress_type == zipfile.ZIP_STORED:
            # Stored members are plain .npy bytes inside the zip: map them in place.
            with open(part.file, "rb") as raw:
                raw.seek(remote_arrays.member_data_offset(raw, info))
                offset, dtype, shape, fortran = _npy_header(raw, part.where)
            if not shape[0]:
                return np.empty(shape, dtype)  # np.memmap refuses a zero-length map
            return np.memmap(
                part.file, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C"
            )
        log.info(
            "%s: member %r is compressed; each worker decompresses it once into memory (%.1f MB)",
            part.file,
            part.member,
            info.file_size / 1e6,
        )
        with archive.open(info) as f:
            return np.lib.format.read_array(f, allow_pickle=False)
