"""Helpers the sources of packed inputs share: naming input files, reading them in workers, class names.

The packed sources (WebDataset tars, TFRecord files, Parquet files, an LMDB) stream
their samples in the main process and read them back in a worker by position. A
worker keeps its input file open between samples (:class:`OpenFiles`); nothing
open travels when a source is pickled into a task. What they have in common
(image options, a classes file, the fields and manifest entry these give, input
files named by patterns) is :class:`PackedSource` and :class:`InputFilesSource`.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import IO, Any, ClassVar, Iterator, Sequence, TypeVar

from converters.base import (
    ConversionError,
    ImageOptions,
    SampleError,
    StreamingSource,
    absolute_path,
    optional_absolute_path,
    process_wide_error,
)
from converters.remote_inputs import expand_url, is_url, read_range
from dali_pipes.dataset.manifest import Field
from dali_pipes.remote.fs import RemoteError

#: An integer written as text (a label in a list file, a key list or a ``.cls`` member).
INTEGER = re.compile(r"[+-]?\d+\Z")

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_CHOICE = re.compile(r"\{([^{}]*,[^{}]*)\}")


def text_lines(f: IO[bytes], start: int, where: object) -> Iterator[tuple[int, int, list[str]]]:
    """``(line number, byte offset, columns)`` of each line of ``f`` from byte ``start`` on that is neither blank
    nor a ``#`` comment, streamed (a list file or key list is never held whole). Numbers count from ``start``;
    ``where`` names the file in the error for a line that is not UTF-8."""
    f.seek(start)
    offset = start
    for number, raw in enumerate(f, start=1):
        line_offset, offset = offset, offset + len(raw)
        try:
            parts = raw.decode("utf-8").split()
        except UnicodeDecodeError as exc:
            raise ConversionError(f"{where}:{number}: not UTF-8 text ({exc}); save the file as UTF-8") from None
        if parts and not parts[0].startswith("#"):
            yield number, line_offset, parts


def expand_braces(pattern: str) -> list[str]:
    """``train-{000..002}.tar`` -> three names (zero padding kept); ``{a,b}`` lists alternatives, as in a shell."""
    match = _RANGE.search(pattern)
    if match:
        first, last = match.group(1), match.group(2)
        width = len(first) if first.startswith("0") or len(first) == len(last) else 0
        step = 1 if int(last) >= int(first) else -1
        head, tail = pattern[: match.start()], pattern[match.end() :]
        return [
            name
            for number in range(int(first), int(last) + step, step)
            for name in expand_braces(f"{head}{number:0{width}d}{tail}")
        ]
    match = _CHOICE.search(pattern)
    if match:
        head, tail = pattern[: match.start()], pattern[match.end() :]
        return [name for choice in match.group(1).split(",") for name in expand_braces(head + choice + tail)]
    return [pattern]


def expand_inputs(patterns: Sequence[str | os.PathLike], what: str) -> list[str]:
    """The input files named by ``patterns`` (paths, globs, ``{000..146}`` ranges), in the order given.

    Each glob's matches are sorted; a brace range keeps its order. A name given
    twice is read once. Raises :class:`ConversionError` naming a pattern that
    matches nothing, or a match that is not a file.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    found: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        for name in expand_braces(str(pattern)):
            if is_url(name):  # objects in storage: listed there, read by ranges
                existing = expand_url(name)
                if not existing:
                    raise ConversionError(f"{name}: no such {what} (no object matches)")
                found += [url for url in existing if url not in seen and not seen.add(url)]
                continue
            matches = sorted(glob.glob(name)) if glob.has_magic(name) else [name]
            existing = [m for m in matches if os.path.exists(m)]
            if not existing:
                raise ConversionError(f"{name}: no such {what} (quote the pattern so that the shell leaves it alone)")
            for path in existing:
                if not os.path.isfile(path):
                    raise ConversionError(f"{path}: not a file; give {what}s (or a pattern matching them)")
                if path not in seen:
                    seen.add(path)
                    found.append(path)
    if not found:
        raise ConversionError(f"no {what} given")
    return found


def input_patterns(files: Sequence[str | os.PathLike] | str | os.PathLike) -> list[str]:
    """The input patterns a source keeps (and writes in its manifest): one or several, as strings."""
    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    return [absolute_path(f) for f in paths]  # globs too: a relative pattern means one below this folder


def inputs_and_output(positional: Sequence[str], what: str) -> tuple[list[str], str]:
    """The command line's input patterns and its output folder (the last positional argument)."""
    *inputs, out = positional
    if not inputs:
        raise ConversionError(f"give one or more {what} and then the output folder")
    return inputs, out


class PlannedInputs:
    """A source some of whose attributes stay in the process that made them (a decoded row group, the class names
    the planning read): :attr:`_not_pickled` names them (``None`` in the copy a worker gets)."""

    _not_pickled: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **dict.fromkeys(self._not_pickled)}


_Source = TypeVar("_Source", bound="InputFilesSource")


class PackedSource(StreamingSource):
    """A packed source: encoded images, an integer label where the input has one, a key; class names from an
    optional classes file. A subclass sets :attr:`image_options` and :attr:`classes_file` in its ``__init__``.
    """

    image_options: ImageOptions
    classes_file: str | None

    def classes(self) -> list[str] | None:
        return read_classes_file(self.classes_file)

    @staticmethod
    def _image_fields(labelled: bool) -> dict[str, Field]:
        """The fields every packed sample starts with: ``image``, and an int64 ``label`` when ``labelled``."""
        fields = {"image": Field.image()}
        if labelled:
            fields["label"] = Field.array("int64", ())
        return fields

    def _described(self, **options: Any) -> dict[str, Any]:
        """The manifest's ``source`` entry: the kind, ``options`` in their order (the inputs first), then the
        classes file and the image options."""
        return {
            "kind": self.kind,
            **options,
            "classes_file": self.classes_file,
            "image_options": self.image_options.to_json(),
        }


class InputFilesSource(PackedSource):
    """A packed source read from input files named by patterns (paths, globs, brace ranges, URLs), one file after
    another: the patterns are kept as given (absolute), the files they name are listed once."""

    #: What one input file is called in messages (``"TFRecord file"``).
    file_kind: ClassVar[str]

    def __init__(
        self,
        files: Sequence[str | os.PathLike] | str,
        image_options: ImageOptions,
        classes_file: str | os.PathLike | None,
    ) -> None:
        self.patterns = input_patterns(files)
        self.image_options = image_options
        self.classes_file = optional_absolute_path(classes_file)
        self._paths: list[str] | None = None  # kept when pickled: a shard task reads by file number

    def _file_paths(self) -> list[str]:
        """The input files the patterns name, listed on first use (:func:`expand_inputs`)."""
        if self._paths is None:
            self._paths = expand_inputs(self.patterns, self.file_kind)
        return self._paths

    def _files_from(self, anchor: Sequence[int]) -> Iterator[tuple[int, str, tuple[int, ...]]]:
        """``(file number, path, position)`` of each input file from the one ``anchor`` names on.

        An anchor here is a file's number and then a position in that file (all zeros: its start), so that a task
        reads its first file from the anchor's position and each later file from its start.
        """
        first, position = anchor[0], tuple(anchor[1:])
        for number, path in enumerate(self._file_paths()[first:], start=first):
            yield number, path, position if number == first else (0,) * len(position)

    def _no_samples(self, what: str) -> ConversionError:
        """The refusal of inputs in which a whole pass found ``what`` (``"no rows"``)."""
        return ConversionError(f"{self.kind}: {', '.join(self.patterns)} hold {what}")

    @classmethod
    def from_command_line(
        cls: type[_Source],
        args: Any,
        positional: Sequence[str],
        what: str,
        image_options: ImageOptions,
        *same_names: str,
        **options: Any,
    ) -> tuple[_Source, str]:
        """The source the parsed command line ``args`` describes, and the output folder.

        ``positional``: the input patterns, then the output folder (``what`` names the inputs in an error). The
        source gets ``--classes``, the arguments named in ``same_names`` under the same names, and ``options``.
        """
        files, out = inputs_and_output(positional, what)
        given = {name: getattr(args, name) for name in same_names}
        return cls(files, image_options, classes_file=args.classes, **given, **options), out


class OpenFiles:
    """The input file a worker process reads, read by offset, never seeked.

    Opened on first use in each process (a source pickled into a task, or forked,
    opens its own) and kept while samples come from it, since a task reads one
    input file sample after sample. Only the last file stays open: one source
    serves every shard of a one-worker run, and a file per input would run past
    the limit on open files.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._path: str | None = None
        self._fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def read(self, path: str, offset: int, size: int, name: str) -> bytes:
        """``size`` bytes of ``path`` at ``offset``; :class:`SampleError` for ``name`` if the file is short or unreadable.

        Out of file descriptors or memory is the process's trouble, not the sample's: a :class:`ConversionError`.
        """
        if self._pid != os.getpid():
            self.__init__()
        if is_url(path):
            return _read_remote(path, offset, size, name)
        try:
            if path != self._path:
                self.close()
                self._fd = os.open(path, os.O_RDONLY)
                self._path = path
            data = os.pread(self._fd, size, offset)
        except OSError as exc:
            fatal = process_wide_error(exc, path)
            if fatal is not None:
                raise fatal from exc
            raise SampleError(name, f"cannot read {path} ({exc.strerror or exc})") from None
        if len(data) != size:
            raise SampleError(name, f"{path} ends at byte {offset + len(data)}, inside this sample (truncated file)")
        return data

    def close(self) -> None:
        """Close the file this process opened."""
        fd, self._fd, self._path = self._fd, None, None
        if fd is not None and self._pid == os.getpid():
            os.close(fd)

    def __del__(self) -> None:
        # A long-lived worker (Dask) unpickles a copy of the source per task: each copy's file closes with it.
        try:
            self.close()
        except OSError:
            pass


def _read_remote(url: str, offset: int, size: int, name: str) -> bytes:
    """``OpenFiles.read`` of an input in object storage: one ranged request, retried; short data is the sample's."""
    try:
        data = read_range(url, offset, size)
    except RemoteError as exc:
        raise SampleError(name, str(exc)) from None
    if len(data) != size:
        raise SampleError(name, f"{url} ends at byte {offset + len(data)}, inside this sample (truncated object)")
    return data


def read_classes_file(path: str | os.PathLike | None) -> list[str] | None:
    """Class names from a text file of one name per line (line 1 is label 0); ``None`` without a file."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConversionError(f"{path}: no such classes file; give a text file with one class name per line") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path}: cannot read the classes file ({exc}); it must be UTF-8 text") from None
    names = [line.strip() for line in text.splitlines()]
    while names and not names[-1]:
        names.pop()
    if not names:
        raise ConversionError(f"{path}: the classes file is empty; give one class name per line")
    return names


def parse_label(text: bytes, name: str, what: str) -> int:
    """An integer label stored as text (WebDataset's ``.cls``); :class:`SampleError` for anything else."""
    try:
        return int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise SampleError(name, f"{what} is not an integer label ({bytes(text[:20])!r})") from None


def add_common_arguments(parser) -> None:
    """``--classes FILE``, which every packed source takes."""
    parser.add_argument(
        "--classes", metavar="FILE", help="class names, one per line (line 1 is label 0); overrides the source's own"
    )
