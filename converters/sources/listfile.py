"""``list``: a text file of ``KEY PATH [LABEL]`` lines, the ``.scp`` lists of training recipes."""

from __future__ import annotations

import io
import logging
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Sequence

import numpy as np

from converters.base import ConversionError, ImageOptions, Item, Sample, Source, absolute_path
from converters.images import load_image_file
from converters.remote_inputs import beside, is_url, open_input, tree
from converters.sources._inputs import INTEGER
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
    line: int
    key: str
    path: str  # resolved: absolute, or relative to the list file's folder joined to it
    label: int | None


class ListFileSource(Source):
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
        self._entries: list[_Entry] | None = None
        self._labelled: bool | None = None  # kept when pickled: every shard task asks fields()

    def __getstate__(self) -> dict[str, Any]:
        # Workers only need Item.data; a parsed million-line list must not travel with every task.
        state = dict(self.__dict__)
        state["_entries"] = None
        return state

    def _parsed(self) -> list[_Entry]:
        if self._entries is None:
            # A list in object storage stays a URL (its paths are then read from beside it, in the bucket).
            self._entries = _parse(self.list_file if is_url(self.list_file) else Path(self.list_file), self.columns)
        return self._entries

    def _has_labels(self) -> bool:
        if self._labelled is None:
            self._labelled = self._parsed()[0].label is not None
        return self._labelled

    def fields(self) -> dict[str, Field]:
        fields = {"image": Field.image()}
        if self._has_labels():
            fields["label"] = Field.array("int64", ())
        fields["key"] = Field.text()
        return fields

    def items(self) -> list[Item]:
        """One item per line, in file order. ``Item.size`` is the file size (0 for a missing file, reported by ``load``)."""
        entries = self._parsed()
        # Decided here, in the parent, so that a shard task (which never gets the entries) knows it.
        self._labelled = entries[0].label is not None
        # The items carry what the workers need; the parsed entries would only double the parent's memory.
        self._entries = None
        items = []
        missing = 0
        sizes = _listed_sizes(self.list_file, entries)
        for entry in entries:
            try:
                size = sizes[entry.path] if sizes is not None else os.stat(entry.path).st_size
            except (OSError, KeyError):
                size = 0
                missing += 1
            items.append(Item(name=entry.path, size=size, data=(entry.path, entry.key, entry.label)))
        if missing == len(entries):
            raise ConversionError(
                f"{self.list_file}: none of its {len(entries)} paths exists (first: {entries[0].path} from line "
                f"{entries[0].line}); relative paths are read from the list file's folder"
            )
        if missing:
            log.warning(
                "%s: %d of %d listed files do not exist; they will be reported as errors",
                self.list_file,
                missing,
                len(entries),
            )
        return items

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


def _layout(columns: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if columns is None:
        return None
    names = tuple(columns.replace(",", " ").split()) if isinstance(columns, str) else tuple(columns)
    if names not in LAYOUTS.values():
        choices = ", ".join(repr(k) for k in LAYOUTS)
        raise ConversionError(f"unknown list columns {' '.join(names)!r}; expected one of {choices}")
    return names


def _listed_sizes(list_file: str, entries: list[_Entry]) -> dict[str, int] | None:
    """For a list in object storage: the size of each object below its folder, listed once (not one request per
    line); ``None`` for a local list, whose files are looked at one by one."""
    if not is_url(list_file):
        return None
    folder = posixpath.dirname(list_file)
    return {posixpath.join(folder, rel): size for rel, size in tree(folder).items()}


def _rows(list_file: Path | str) -> Iterator[tuple[int, list[str]]]:
    """``(line number, columns)`` of every entry line, streamed: the list is never held whole in memory."""
    try:
        with (
            io.TextIOWrapper(open_input(list_file), encoding="utf-8")
            if isinstance(list_file, str)
            else open(list_file, encoding="utf-8")
        ) as f:
            for number, line in enumerate(f, start=1):
                stripped = line.strip()
                if stripped and not stripped.startswith("#"):
                    yield number, stripped.split()
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{list_file}: not UTF-8 text ({exc}); save the list as UTF-8") from None


def _parse(list_file: Path | str, columns: tuple[str, ...] | None) -> list[_Entry]:
    if isinstance(list_file, str):  # a URL: a missing list is named by the read
        pass
    elif not list_file.exists():
        raise ConversionError(f"{list_file}: no such list file; give a text file of 'KEY PATH [LABEL]' lines")
    elif not list_file.is_file():
        raise ConversionError(f"{list_file}: not a file; the list source reads a text file of 'KEY PATH [LABEL]' lines")

    # A first pass checks the columns and infers the layout; the second builds the entries.
    first: int | None = None
    width = 0
    integer_line: int | None = None  # first line whose second column is an integer
    other_line: int | None = None  # first line whose second column is not
    for number, parts in _rows(list_file):
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
        columns = _infer_layout(list_file, width, first, integer_line, other_line)
    elif len(columns) != width:
        raise ConversionError(
            f"{list_file}:{first}: {width} columns, but the layout {' '.join(columns)!r} has {len(columns)}"
        )

    base = posixpath.dirname(list_file) if isinstance(list_file, str) else list_file.parent
    entries: list[_Entry] = []
    seen: dict[str, int] = {}
    for number, parts in _rows(list_file):
        row = dict(zip(columns, parts))
        label = None
        if "label" in row:
            if not INTEGER.match(row["label"]):
                raise ConversionError(f"{list_file}:{number}: label {row['label']!r} is not an integer")
            label = int(row["label"])
        key = row.get("key", row["path"])
        if key in seen:
            raise ConversionError(f"{list_file}:{number}: key {key!r} repeats line {seen[key]}; keys must be unique")
        seen[key] = number
        entries.append(
            _Entry(
                line=number,
                key=key,
                path=beside(f"{base}/list", row["path"])
                if isinstance(list_file, str)
                else os.path.join(base, row["path"]),
                label=label,
            )
        )
    log.debug("%s: %d entries, columns %s", list_file, len(entries), " ".join(columns))
    return entries


def _infer_layout(
    list_file: Path, width: int, first: int, integer_line: int | None, other_line: int | None
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
