"""``list``: a text file of ``KEY PATH [LABEL]`` lines, the ``.scp`` lists of training recipes."""

from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Sequence

import numpy as np

from converters.base import ConversionError, ImageOptions, Item, Sample, StreamingSource, absolute_path
from converters.images import load_image_file
from converters.remote_inputs import beside, is_url, open_input, tree
from converters.sources._inputs import INTEGER, text_lines
from converters.unique_keys import RepeatedHashes
from dali_pipes.dataset.manifest import Field

log = logging.getLogger(__name__)

#: The column layouts a list file may have, by name. ``path`` is always needed;
#: without ``key`` the path as written is the key.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "key path label": ("key", "path", "label"),
    "key path": ("key", "path"),
    "path label": ("path", "label"),
    "path": ("path",),
}

#: How two-column lines are read when no layout is given; for the CLI help.
TWO_COLUMN_RULE = (
    "two-column lines are 'PATH LABEL' when the second column of every line is an integer and "
    "'KEY PATH' when none is (a mix is refused); --columns 'key path' or 'path label' says which"
)


@dataclass(frozen=True)
class _Entry:
    line: int  # counted from where the reading started (the first line when it started at the top)
    key: str
    path: str  # resolved: absolute, or relative to the list file's folder joined to it
    label: int | None


class ListFileSource(StreamingSource):
    """Images named by the lines of a list file.

    Each non-blank line that does not start with ``#`` holds whitespace-separated
    columns (so paths cannot contain spaces). The layout is one of :data:`LAYOUTS`;
    with ``columns=None`` it is inferred from the column count, the same for every line:

    - 3 columns: ``KEY PATH LABEL``;
    - 1 column: ``PATH`` (the key is the path as written);
    - 2 columns: ``PATH LABEL`` when the second column of *every* line is an
      integer (``imagenet-mini/image_list.txt``: ``425/barn.jpg 425``), ``KEY PATH``
      when no line's is (``utt001 wav/utt001.png``); a mix is refused, naming the
      first line that breaks the pattern. A list of ``KEY PATH`` lines whose
      paths are all integers would be misread: pass ``columns="key path"``.

    ``LABEL`` is an integer, stored as given (it is not remapped to ``0..C-1``);
    either every line has one or none does, and then there is no ``label`` field.
    Relative paths are taken from the list file's folder. Keys must be unique.

    The list is streamed, never held: it is checked once (columns, labels, unique keys) in the
    conversion's process, and each shard task reads its own lines from their byte offset (the items'
    anchor). A list in object storage is the exception: its files' sizes come from one listing of
    its folder, so its items are listed once and held.

    Fields: ``image``, ``label`` (int64, only when the list has labels), ``key`` (UTF-8).
    """

    kind: ClassVar[str] = "list"

    def __init__(
        self,
        list_file: str | os.PathLike,
        image_options: ImageOptions = ImageOptions(),
        *,
        columns: str | Sequence[str] | None = None,
    ) -> None:
        self.list_file = absolute_path(list_file)
        self.image_options = image_options
        self.columns = _layout(columns)
        # The columns, given or inferred, once the list was checked; kept when pickled, so a task never re-checks.
        self._checked: tuple[str, ...] | None = None
        self._missing_said = False

    def streams(self) -> bool:
        return not is_url(self.list_file)

    def _where(self) -> Path | str:
        # A list in object storage stays a URL (its paths are then read from beside it, in the bucket).
        return self.list_file if is_url(self.list_file) else Path(self.list_file)

    def _layout_checked(self) -> tuple[str, ...]:
        if self._checked is None:
            self._checked = _check(self._where(), self.columns)
        return self._checked

    @property
    def class_ordered(self) -> bool:  # type: ignore[override]
        """A list with labels is usually written class by class (ImageNet's train list is); one without has none."""
        return "label" in self._layout_checked()

    def fields(self) -> dict[str, Field]:
        fields = {"image": Field.image()}
        if "label" in self._layout_checked():
            fields["label"] = Field.array("int64", ())
        fields["key"] = Field.text()
        return fields

    def iter_items(self) -> Iterator[Item]:
        """One item per line, in file order. ``Item.size`` is the file size (0 for a missing file, reported by
        ``load``); ``Item.anchor`` the byte offset of the line."""
        sizes = _listed_sizes(self.list_file)
        count = missing = 0
        first: _Entry | None = None
        for offset, entry in _entries(self._where(), self._layout_checked(), 0):
            size = _file_size(entry.path, sizes)
            count += 1
            first = first or entry
            missing += size is None
            yield _item(entry, size or 0, offset)
        if first is None:
            raise ConversionError(f"{self.list_file}: no entries (only blank or '#' lines); the list is empty")
        if missing == count:
            raise ConversionError(
                f"{self.list_file}: none of its {count} paths exists (first: {first.path} from line "
                f"{first.line}); relative paths are read from the list file's folder"
            )
        if missing and not self._missing_said:
            self._missing_said = True  # said once, though planning may read the list twice
            log.warning(
                "%s: %d of %d listed files do not exist; they will be reported as errors",
                self.list_file,
                missing,
                count,
            )

    def items_from(self, anchor: int) -> Iterator[Item]:
        for offset, entry in _entries(self._where(), self._layout_checked(), anchor):
            yield _item(entry, _file_size(entry.path, None) or 0, offset)

    def load(self, item: Item) -> Sample:
        path, key, label = item.data
        sample: Sample = {"image": load_image_file(path, item.name, self.image_options)}
        if label is not None:
            sample["label"] = np.array(label, dtype=np.int64)
        sample["key"] = key.encode("utf-8")
        return sample

    def describe(self) -> dict[str, Any]:
        columns = " ".join(self.columns) if self.columns else None
        return {
            "kind": self.kind,
            "list_file": self.list_file,
            "columns": columns,
            "image_options": self.image_options.to_json(),
        }


def _item(entry: _Entry, size: int, offset: int) -> Item:
    return Item(name=entry.path, size=size, data=(entry.path, entry.key, entry.label), anchor=offset)


def _file_size(path: str, sizes: dict[str, int] | None) -> int | None:
    """The size of a listed file (from the folder's listing for a list in object storage); ``None``: missing."""
    if sizes is not None:
        return sizes.get(path)
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _layout(columns: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if columns is None:
        return None
    names = tuple(columns.replace(",", " ").split()) if isinstance(columns, str) else tuple(columns)
    if names not in LAYOUTS.values():
        choices = ", ".join(repr(k) for k in LAYOUTS)
        raise ConversionError(f"unknown list columns {' '.join(names)!r}; expected one of {choices}")
    return names


def _listed_sizes(list_file: str) -> dict[str, int] | None:
    """For a list in object storage: the size of each object below its folder, listed once (not one request per
    line); ``None`` for a local list, whose files are looked at one by one."""
    if not is_url(list_file):
        return None
    folder = posixpath.dirname(list_file)
    return {posixpath.join(folder, rel): size for rel, size in tree(folder).items()}


def _rows(list_file: Path | str, start: int = 0) -> Iterator[tuple[int, int, list[str]]]:
    """``(line number, byte offset, columns)`` of every entry line from byte ``start`` on, streamed: the list is
    never held whole in memory. Line numbers count from ``start``."""
    with open_input(list_file) if isinstance(list_file, str) else open(list_file, "rb") as f:
        yield from text_lines(f, start, list_file)


def _entries(list_file: Path | str, columns: tuple[str, ...], start: int) -> Iterator[tuple[int, _Entry]]:
    """``(byte offset, entry)`` of the lines from byte ``start`` on, read with the checked ``columns``."""
    base = f"{list_file}" if isinstance(list_file, str) else list_file.parent
    for number, offset, parts in _rows(list_file, start):
        row = dict(zip(columns, parts))
        path = beside(base, row["path"]) if isinstance(list_file, str) else os.path.join(base, row["path"])
        label = int(row["label"]) if "label" in row else None
        yield offset, _Entry(line=number, key=row.get("key", row["path"]), path=path, label=label)


def _check(list_file: Path | str, columns: tuple[str, ...] | None) -> tuple[str, ...]:
    """The list's columns (``columns``, or inferred), once every line is known good: the same column count,
    integer labels, unique keys. Reads the list two or three times, holding none of it."""
    if isinstance(list_file, str):  # a URL: a missing list is named by the read
        pass
    elif not list_file.exists():
        raise ConversionError(f"{list_file}: no such list file; give a text file of 'KEY PATH [LABEL]' lines")
    elif not list_file.is_file():
        raise ConversionError(f"{list_file}: not a file; the list source reads a text file of 'KEY PATH [LABEL]' lines")
    columns = _checked_columns(list_file, columns)
    repeated = RepeatedHashes()
    for number, _, parts in _rows(list_file):
        row = dict(zip(columns, parts))
        if "label" in row and not INTEGER.match(row["label"]):
            raise ConversionError(f"{list_file}:{number}: label {row['label']!r} is not an integer")
        repeated.add(row.get("key", row["path"]))
    candidates = repeated.repeated()
    if candidates:  # some hashes repeat: find the keys that do, by their line numbers
        seen: dict[str, int] = {}
        for number, _, parts in _rows(list_file):
            key = dict(zip(columns, parts)).get("key", parts[columns.index("path")])
            if hash(key) in candidates:
                if key in seen:
                    raise ConversionError(
                        f"{list_file}:{number}: key {key!r} repeats line {seen[key]}; keys must be unique"
                    )
                seen[key] = number
    log.debug("%s: columns %s", list_file, " ".join(columns))
    return columns


def _checked_columns(list_file: Path | str, columns: tuple[str, ...] | None) -> tuple[str, ...]:
    """The columns every line has: ``columns`` when given (and matching), else inferred by :data:`TWO_COLUMN_RULE`."""
    first: int | None = None
    width = 0
    integer_line: int | None = None  # first line whose second column is an integer
    other_line: int | None = None  # first line whose second column is not
    for number, _, parts in _rows(list_file):
        if first is None:
            first, width = number, len(parts)
        elif len(parts) != width:
            raise ConversionError(
                f"{list_file}:{number}: {len(parts)} columns where line {first} has {width}; "
                "every line needs the same columns (either every line has a label or none does)"
            )
        if width == 2:
            if INTEGER.match(parts[1]):
                integer_line = integer_line or number
            else:
                other_line = other_line or number
    if first is None:
        raise ConversionError(f"{list_file}: no entries (only blank or '#' lines); the list is empty")
    if columns is None:
        return _infer_layout(list_file, width, first, integer_line, other_line)
    if len(columns) != width:
        raise ConversionError(
            f"{list_file}:{first}: {width} columns, but the layout {' '.join(columns)!r} has {len(columns)}"
        )
    return columns


def _infer_layout(
    list_file: Path | str, width: int, first: int, integer_line: int | None, other_line: int | None
) -> tuple[str, ...]:
    if width == 3:
        return LAYOUTS["key path label"]
    if width == 1:
        return LAYOUTS["path"]
    if width == 2:
        if other_line is None:
            return LAYOUTS["path label"]
        if integer_line is None:
            return LAYOUTS["key path"]
        raise ConversionError(
            f"{list_file}:{other_line}: the second column is not an integer, but on line {integer_line} it is, so the "
            "list is neither all 'PATH LABEL' nor all 'KEY PATH'; fix the line, or say which: --columns 'key path' (columns= in Python)"
        )
    raise ConversionError(
        f"{list_file}:{first}: {width} columns; a list line is 'KEY PATH [LABEL]' (paths cannot contain spaces)"
    )
