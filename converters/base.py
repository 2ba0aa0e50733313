"""The two protocols of a conversion: where samples come from and how a shard is written.

A :class:`Source` enumerates the input as small, picklable :class:`Item` records
(cheap: no file is opened), and turns one item into a sample in a worker process
(:meth:`Source.load`). A :class:`ShardWriter` appends samples to one shard file.
The runner in :mod:`converters.runner` joins the two; neither side knows the other.
"""

from __future__ import annotations

import errno
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping, Union

import numpy as np

from dali_pipes.dataset.manifest import Field
from dali_pipes.remote.urls import redact_values

#: One sample: field name -> bytes (``bytes`` fields) or a numpy array (``array`` fields).
Sample = dict[str, Union[bytes, np.ndarray]]


class ConversionError(Exception):
    """A problem with the job as a whole (bad arguments, missing input, occupied output).

    The CLI prints its message as one line and exits non-zero.
    """


class NothingConverted(ConversionError):
    """Every input of a conversion was left out: the message gives each distinct reason, with a count and an example.

    Nothing of the job is kept (no ``errors.jsonl`` either), so the message is the only account: every reason is
    in it, most frequent first. Reasons that differ only in their numbers (how many bytes a truncated file lacks,
    an image's size) are one reason, shown as its first input gave it, so that a folder of files broken the same
    way reads as one line, not one per file. Past :data:`SHOWN_REASONS` distinct reasons the rest are counted,
    with their first example, to keep the message readable.
    """

    #: Distinct reasons shown; inputs failing for the same few reasons (the usual case) are all accounted for.
    SHOWN_REASONS = 20

    def __init__(self, errors: list[dict[str, str]]) -> None:
        by_reason: dict[str, list[dict[str, str]]] = {}
        for error in errors:
            by_reason.setdefault(re.sub(r"\d+", "#", error["reason"]), []).append(error)
        # Most frequent first; a stable sort keeps equally frequent reasons in input order.
        common = sorted(by_reason.values(), key=lambda group: -len(group))
        shown, rest = common[: self.SHOWN_REASONS], common[self.SHOWN_REASONS :]
        reasons = "; ".join(f"{len(group)} x {group[0]['reason']} (e.g. {group[0]['input']})" for group in shown)
        if rest:
            reasons += (
                f"; and {sum(len(group) for group in rest)} input(s) for {len(rest)} other reasons "
                f"(e.g. {rest[0][0]['input']}: {rest[0][0]['reason']})"
            )
        super().__init__(
            f"no input could be converted: all {len(errors)} inputs failed: {reasons}; nothing was written: "
            "fix or replace these inputs and convert again"
        )


class SampleError(Exception):
    """One input sample cannot be converted; ``name`` says which input, ``reason`` why."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason

    def __reduce__(self):
        # Rebuilt from (name, reason) when it crosses from a worker process to the runner.
        return (SampleError, (self.name, self.reason))


#: errno values that say the process (or the machine) is out of a resource, not that an input is bad.
PROCESS_WIDE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def process_wide_error(exc: BaseException, path: str) -> ConversionError | None:
    """A :class:`ConversionError` for ``exc`` when it is a process-wide ``OSError`` (too many open files, no
    memory), which must stop the job instead of being counted against one sample; ``None`` for anything else.
    """
    if not isinstance(exc, OSError) or exc.errno not in PROCESS_WIDE_ERRNOS:
        return None
    todo = "raise the limit ('ulimit -n')" if exc.errno != errno.ENOMEM else "free memory or use fewer --workers"
    return ConversionError(
        f"{path}: cannot read it ({exc.strerror or exc}); this is the process's limit, not a bad input: "
        f"{todo} and run the same command again to continue"
    )


@dataclass(frozen=True, slots=True)
class Item:
    """One planned input sample: a display ``name`` (a path or key), the ``size`` in
    bytes used to plan shard sizes, and whatever the source needs to load it (``data``).

    ``anchor``: for a :class:`StreamingSource`, where the item lies in the input (a byte offset into a list
    file, a row number), from which :meth:`StreamingSource.items_from` reads it and those after it again.
    Slotted: a source that is not streamed holds one per input sample in the parent process.
    """

    name: str
    size: int
    data: Any = None
    anchor: Any = None


@dataclass(frozen=True)
class ImageOptions:
    """How images are stored: as their original bytes (the default) or re-encoded.

    ``max_size`` limits the longest side in pixels; an image larger than that is
    resized and re-encoded as JPEG at ``quality``. Smaller images keep their bytes.
    """

    max_size: int | None = None
    quality: int = 90

    def to_json(self) -> dict[str, Any]:
        return {"max_size": self.max_size, "quality": self.quality}


def absolute_path(path: str | os.PathLike) -> str:
    """``path`` made absolute against the current folder (links kept), as sources record their inputs.

    A manifest names its source's paths this way, so that the dataset's own commands (``bench``, ``verify``) find
    them from any folder; a relative one would mean the folder the conversion happened to run in.
    """
    text = os.fspath(path)
    return text if "://" in str(text) else os.path.abspath(text)  # a URL (s3://...) is kept as it is


def optional_absolute_path(path: str | os.PathLike | None) -> str | None:
    """:func:`absolute_path`, or ``None`` for ``None``."""
    return None if path is None else absolute_path(path)


class Source(ABC):
    """Where samples come from. Subclasses set :attr:`kind` and fill the abstract methods.

    A source must be picklable: it is sent to the worker processes that call :meth:`load`.
    """

    kind: ClassVar[str]
    #: Whether the source's own order groups samples by class (an image folder: class after class), so that a
    #: conversion shuffles it by default (:func:`converters.order.choose_order`).
    class_ordered: ClassVar[bool] = False

    @abstractmethod
    def items(self) -> list[Item]:
        """Every input sample, in a deterministic order. Raises :class:`ConversionError` for an empty or missing input."""

    @abstractmethod
    def fields(self) -> dict[str, Field]:
        """The fields every sample has, in the order they are stored."""

    @abstractmethod
    def load(self, item: Item) -> Sample:
        """Read (and validate) one sample. Raises :class:`SampleError` for bad input."""

    def classes(self) -> list[str] | None:
        """Class names, index = label, or ``None`` when the source has no classes."""
        return None

    def streams(self) -> bool:
        """Whether the runner streams this source's items (a :class:`StreamingSource`) instead of holding them."""
        return False

    def extra(self) -> dict[str, Any]:
        """Anything else the manifest should keep (for example COCO's category names)."""
        return {}

    def input_folders(self) -> list[Path]:
        """Folders this source reads everything below: a conversion refuses to write its output inside one."""
        return []

    def check_result(self, left_out: Mapping[str, str]) -> None:
        """Refuse a finished conversion that this source cannot stand by; called before the manifest is written.

        ``left_out`` maps the :attr:`Item.name` of each input left out as bad (the items were enumerated in this
        process before) to why it was. Raises :class:`ConversionError`; the runner then removes everything the job
        wrote, since the same command could only be refused again.
        """

    def left_out_parts(self, item: Item) -> list[tuple[str, str]]:
        """Parts of ``item`` that its sample, written, does not hold (a COCO polygon too short to draw): ``(part,
        reason)`` each, listed in ``errors.jsonl`` with the input's name and ``part``. Asked once the item's sample
        is written, so only for kept inputs; it must depend on ``item`` alone, so that a resumed run lists the same.
        None by default."""
        return []

    def shard_done(self) -> None:
        """Called in the process that wrote a shard once it is written (or given up): let go of what was opened to
        read it, so that a worker's memory does not grow with the shards it wrote. Nothing by default."""

    def release(self) -> None:
        """Remove the local copies of inputs this source made for a conversion (an LMDB downloaded from a URL);
        called once the conversion completed. Nothing by default."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The manifest's ``source`` entry: the kind, the input paths and the options that shape the output."""

    def recorded(self) -> dict[str, Any]:
        """:meth:`describe` as it is written to files and hashed into the job's identity: secrets inside input
        URLs (``user:password@``, a URL's query) replaced by ``***``, so that no manifest or job record holds
        them."""
        return redact_values(self.describe())


class StreamingSource(Source):
    """A source whose items are enumerated as a stream and re-read per shard: memory O(1) in the input.

    The runner walks :meth:`iter_items` (twice when the shard size depends on the input's total) to plan the
    shards, keeping of each only its first item's :attr:`Item.anchor`; a shard task then reads its items with
    :meth:`items_from`, in the worker. So neither the parent nor a task holds a list of the whole input.
    """

    def streams(self) -> bool:
        return True

    @abstractmethod
    def iter_items(self) -> Iterator[Item]:
        """Every input sample with its :attr:`Item.anchor`, in a deterministic order, read as it goes.

        Raises :class:`ConversionError` for an empty or missing input (at the latest once the stream ends).
        """

    @abstractmethod
    def items_from(self, anchor: Any) -> Iterator[Item]:
        """The items from the one whose :attr:`Item.anchor` is ``anchor`` on, as :meth:`iter_items` gives them.

        Called in a worker, which takes as many as its shard holds; the source's state after the planning
        passes (:meth:`fields`, a list file's columns) travels with it.
        """

    def items(self) -> list[Item]:
        """Every input sample as a list (for small inputs and tests; the runner streams :meth:`iter_items`)."""
        return list(self.iter_items())


class ShardWriter(ABC):
    """Appends samples to one shard file.

    The runner opens a writer on a temporary path, writes the shard's samples in
    order, calls :meth:`close`, and renames :meth:`files` into place. Output must be
    deterministic: the same samples give the same bytes.
    """

    format: ClassVar[str]
    suffix: ClassVar[str]

    def __init__(self, path: str | os.PathLike, fields: Mapping[str, Field]) -> None:
        self.path = Path(path)
        self.fields = dict(fields)
        self.num_samples = 0

    @abstractmethod
    def write(self, sample: Sample) -> None:
        """Append one sample (fields as declared in :attr:`fields`)."""

    @abstractmethod
    def close(self) -> None:
        """Flush everything to disk (fsync) and release the file."""

    def index_path(self) -> Path | None:
        """A sidecar index written next to the shard (TFRecord's ``.idx``), or ``None``."""
        return None

    def abort(self) -> None:
        """Release the file after a failure, without flushing; the runner removes the files."""
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the original error matters, not this one
            pass

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
