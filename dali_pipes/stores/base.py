"""The reader side of one shard, the gathering of shards' values into one batch, and the errors readers raise."""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np

from dali_pipes.dataset.manifest import Field
from dali_pipes.stores.checksum import crc_columns
from dali_pipes.stores.errors import StoreError, error_chain

#: What ``store[i]`` returns: field name -> ``bytes`` (bytes fields) or a numpy array.
SampleDict = dict[str, Union[bytes, np.ndarray]]
#: What a batch read returns: field name -> one value per sample, or one stacked array of them.
BatchDict = dict[str, Union[list, np.ndarray]]


def out_of_descriptors(exc: BaseException) -> bool:
    """True when ``exc``, or an error that caused it, says the process ran out of file descriptors.

    Running out of descriptors is not damage: :class:`~dali_pipes.stores.Store`
    then says to raise ``ulimit -n``, not to re-convert a shard. h5py and py-lmdb
    report it in their message only, without an errno, and the readers wrap it in
    a :class:`StoreError`, hence the walk down the causes.
    """
    messages = (os.strerror(errno.EMFILE), os.strerror(errno.ENFILE))
    for error in error_chain(exc):
        if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
            return True
        if any(message in str(error) for message in messages):
            return True
    return False


def select_fields(fields: Mapping[str, Field], names: Iterable[str] | None, where: str) -> Mapping[str, Field]:
    """The fields named by ``names``, in the order named (duplicates once); ``fields`` itself for ``None``.

    Raises ``ValueError`` naming ``where``, the first unknown name and the fields
    there are: an unknown name is the caller's mistake, not a damaged shard, so it
    is not a :class:`StoreError`. A string is refused with ``TypeError``: it is
    iterable, and ``"image"`` would otherwise ask for the fields ``i``, ``m``, ...
    """
    if names is None:
        return fields
    if isinstance(names, (str, bytes)):
        raise TypeError(f"{where}: fields must be a sequence of field names, not the string {names!r}")
    selected: dict[str, Field] = {}
    for name in names:
        field = fields.get(name)
        if field is None:
            raise ValueError(f"{where}: the dataset has no field {name!r} (fields: {sorted(fields)})")
        selected[name] = field
    return selected


def packed(values: list) -> list[np.ndarray]:
    """``values`` (buffers of bytes) copied into one new ``uint8`` array, handed back as its slices.

    One allocation and one pass over memory for a shard's share of a batch,
    instead of a ``bytes`` object per sample (see ``read_batch(arrays=True)``).
    """
    if not values:
        return []
    data = np.concatenate([v if isinstance(v, np.ndarray) else np.frombuffer(v, dtype=np.uint8) for v in values])
    ends = np.cumsum([len(v) for v in values]).tolist()
    return [data[start:end] for start, end in zip([0, *ends], ends)]


def as_arrays(batch: BatchDict, fields: Mapping[str, Field]) -> BatchDict:
    """``batch`` with each bytes field's values as ``uint8`` arrays over the same bytes (no copy)."""
    return {
        name: [np.frombuffer(v, dtype=np.uint8) for v in values] if fields[name].kind == "bytes" else values
        for name, values in batch.items()
    }


def fixed_as_array(field: Field, values: Any) -> Any:
    """A fixed-shape array field's values as one stacked array (a reader may hand back a list of rows)."""
    if field.kind == "array" and not field.variable_length and not isinstance(values, np.ndarray):
        return np.stack(values) if len(values) else np.empty((0, *(field.shape or ())), dtype=field.dtype)
    return values


def gather_batch(
    names: Sequence[str], fields: Mapping[str, Field], count: int, parts: list[tuple[np.ndarray, BatchDict]]
) -> BatchDict:
    """Put each shard's values back at their positions in the batch: one array per fixed field, else a list."""
    out: BatchDict = {}
    for name in names:
        field = fields[name]
        if field.kind == "array" and not field.variable_length:
            stacked = np.empty((count, *(field.shape or ())), dtype=field.dtype)
            for positions, values in parts:
                stacked[positions] = fixed_as_array(field, values[name])
            out[name] = stacked
        else:
            gathered: list = [None] * count
            for positions, values in parts:
                for position, value in zip(positions.tolist(), values[name]):
                    gathered[position] = value
            out[name] = gathered
    return out


class ShardReader(ABC):
    """Random access to the samples of one shard file.

    File handles are opened on first use and dropped when pickled, so a reader
    made in the main process works in forked and spawned worker processes.
    Shards are always opened read-only.

    Opening checks what is cheap to check: the file exists, the record count
    matches the manifest (each format), and, with ``expected_bytes``, the file
    size matches too, which catches a truncated shard and most shards swapped
    for another file after conversion. Content hashes are ``dali-pipes verify``'s job.

    With ``record_crc`` (the manifest lists per-record checksums, see
    :mod:`dali_pipes.stores.checksum`) every field read is checked against its
    stored CRC32C; a format without them ignores it.
    """

    format: str
    #: Whether ``read_batch(arrays=True)`` costs a few microseconds a record, reading from a memory map
    #: (then the loader reads in its own process: :func:`~dali_pipes.loading.options.default_py_num_workers`).
    cheap_batch_reads: bool = False

    def __init__(
        self,
        path: str | os.PathLike,
        fields: Mapping[str, Field],
        num_samples: int,
        index_path: str | os.PathLike | None = None,
        expected_bytes: int | None = None,
        *,
        record_crc: bool = False,
    ) -> None:
        self.path = Path(path)
        self.fields = dict(fields)
        self.num_samples = int(num_samples)
        self.index_path = Path(index_path) if index_path is not None else None
        self.expected_bytes = None if expected_bytes is None else int(expected_bytes)
        self.record_crc = bool(record_crc)
        #: A field's column in a sample's stored CRCs.
        self.crc_column = crc_columns(self.fields)
        self._pid: int | None = None

    def __len__(self) -> int:
        return self.num_samples

    @abstractmethod
    def read(self, index: int, fields: Iterable[str] | None = None) -> SampleDict:
        """The fields of local sample ``index`` (``0 <= index < len(self)``).

        ``fields``: the names to read (default: every field). Only those are read
        and decoded, and only they are checked, so a damaged field that is not
        asked for goes unnoticed (``dali-pipes verify`` reads every field; a
        TFRecord read still checks the whole record's CRC). An unknown name
        raises ``ValueError`` (see :func:`select_fields`).
        """

    def read_batch(
        self, indices: np.ndarray, fields: Iterable[str] | None = None, *, arrays: bool = False
    ) -> BatchDict:
        """The fields of the local samples ``indices`` (in that order, repeats allowed), in one call.

        Returns ``{field: values}``, each ``values`` either a list with one value
        per index (as :meth:`read` gives it) or, for a fixed-shape array field, one
        array ``(len(indices), *shape)``. The values are those of :meth:`read`,
        sample for sample; formats override this with sorted, coalesced reads.
        This default reads one sample at a time.

        ``arrays``: a bytes field's values come as ``uint8`` arrays instead of
        ``bytes``; formats that read from a memory map (LMDB, HDF5) copy each
        distinct record once, into one buffer for the shard (:func:`packed`), which
        the loader hands to DALI without copying again.
        """
        selected = tuple(self._selected(fields))
        samples = [self.read(int(i), selected) for i in indices]
        batch: BatchDict = {name: [sample[name] for sample in samples] for name in selected}
        return as_arrays(batch, self.fields) if arrays else batch

    def _selected(self, fields: Iterable[str] | None) -> Mapping[str, Field]:
        """The fields a read asks for (see :func:`select_fields`)."""
        return select_fields(self.fields, fields, str(self.path))

    def _batch_request(
        self, indices: np.ndarray, fields: Iterable[str] | None
    ) -> tuple[Mapping[str, Field], np.ndarray]:
        """What a format's batch read starts with: the fields asked for, the local ``indices`` as ``int64``
        (``IndexError`` for one out of range, before any file is touched), and the handles open."""
        selected = self._selected(fields)
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(
                f"{self.path}: a record of {indices.tolist()} is out of range ({self.num_samples} samples)"
            )
        self._ensure_open()
        return selected, indices

    @abstractmethod
    def _open(self) -> None:
        """Open the file handles (called lazily by :meth:`_ensure_open`)."""

    @abstractmethod
    def _close_handles(self) -> None:
        """Close and forget the file handles."""

    def _ensure_open(self) -> None:
        # A handle inherited through fork is shared with the parent; reopen in the child.
        if self._pid != os.getpid():
            if self._pid is not None:
                self._forget_handles()
            self._open()
            try:
                self._check_size()
            except BaseException:
                self._close_handles()
                raise
            self._pid = os.getpid()

    def _check_size(self) -> None:
        # After the format's own checks, whose messages are more specific (a wrong
        # count, a truncated page): one stat is the cheap check left for a shard of the
        # right count but other content, e.g. one copied over from another dataset.
        if self.expected_bytes is None:
            return
        size = os.stat(self.path).st_size
        if size != self.expected_bytes:
            raise StoreError(
                f"{self.path}: shard is {size} bytes but the manifest says {self.expected_bytes}: it was "
                "truncated, replaced or rewritten after conversion"
            )

    def _forget_handles(self) -> None:
        """Drop inherited handles without closing what the parent still uses."""
        self._close_handles()

    def close(self) -> None:
        """Release the file handles; the next read reopens them."""
        if self._pid == os.getpid():
            self._close_handles()
        self._pid = None

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_h_")}
        state["_pid"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
