"""``parquet``: Parquet files with an image column (bytes, or Hugging Face's ``{bytes, path}`` struct) and labels.

Needs ``pyarrow`` (``pip install 'dali-pipes[parquet]'``). Files are read one row
group at a time, so memory stays flat however large a file is.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Sequence

import numpy as np

from converters.base import ConversionError, ImageOptions, Item, Sample, SampleError, process_wide_error
from converters.images import load_image_file, prepare_image
from converters.remote_inputs import beside, is_url, open_input
from converters.sources._inputs import InputFilesSource, PlannedInputs, add_common_arguments, read_classes_file
from dali_pipes.dataset.manifest import Field

log = logging.getLogger(__name__)

KIND = "parquet"
HELP = "Parquet files (as Hugging Face datasets writes them): an image column and a label column"


@dataclass(frozen=True)
class _Row:
    path: str
    group: int  # row group in the file
    index: int  # row within the group
    row: int  # row within the file


class ParquetSource(PlannedInputs, InputFilesSource):
    """One sample per row of Parquet files, file by file, in row order.

    ``image_column`` holds the encoded image: binary, or a struct with a
    ``bytes`` member (and optionally ``path``), the layout of a Hugging Face
    ``Image`` feature. ``label_column`` (``None``: no label field) holds integers.
    The key is the struct's ``path`` where it has one, else ``FILE:ROW``. Class
    names come from the Hugging Face ``ClassLabel`` of the label column (kept in
    the file's schema metadata) unless a classes file is given.

    A row whose image is null, not an image or damaged, or whose label is null,
    is a bad input.
    """

    kind: ClassVar[str] = KIND
    file_kind: ClassVar[str] = "Parquet file"
    _not_pickled = ("_class_names", "_group")

    def __init__(
        self,
        files: Sequence[str | os.PathLike] | str,
        image_options: ImageOptions = ImageOptions(),
        *,
        image_column: str = "image",
        label_column: str | None = "label",
        classes_file: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(files, image_options, classes_file)
        self.image_column = image_column
        self.label_column = label_column or None
        self._class_names: list[str] | None = None
        self._group: tuple[int, str, int, dict[str, list] | str] | None = None  # (pid, path, group, columns or why not)

    def iter_items(self) -> Iterator[Item]:
        """One item per row, file by file, from the files' footers alone; ``Item.size`` is the row group's bytes
        shared out over its rows, ``Item.anchor`` ``(file number, row group, row in the group)``."""
        count = 0
        for count, item in enumerate(self.items_from((0, 0, 0)), start=1):
            yield item
        if not count:
            raise self._no_samples("no rows")

    def items_from(self, anchor: tuple[int, int, int]) -> Iterator[Item]:
        for number, path, (group, index) in self._files_from(anchor):
            yield from self._rows(path, number, group, index)

    def _rows(self, path: str, number: int, first_group: int, first_index: int) -> Iterator[Item]:
        meta = _open(path).metadata
        self._check_schema(path, meta.schema.to_arrow_schema())
        if number == 0:
            self._class_names = _hf_class_names(meta.schema.to_arrow_schema(), self.label_column)
        row = sum(meta.row_group(group).num_rows for group in range(first_group))
        for group in range(first_group, meta.num_row_groups):
            info = meta.row_group(group)
            size = info.total_byte_size // max(1, info.num_rows)
            for index in range(first_index if group == first_group else 0, info.num_rows):
                anchor = (number, group, index)
                yield Item(
                    name=f"{path}:{row + index}", size=size, data=_Row(path, group, index, row + index), anchor=anchor
                )
            row += info.num_rows

    def _check_schema(self, path: str, schema) -> None:
        import pyarrow as pa

        names = ", ".join(schema.names)
        if self.image_column not in schema.names:
            raise ConversionError(f"{path}: no column {self.image_column!r} (columns: {names}); use --image-column")
        image = schema.field(self.image_column).type
        binary = (pa.types.is_binary, pa.types.is_large_binary)
        if pa.types.is_struct(image):
            member = image.get_field_index("bytes")
            if image.get_field_index("path") < 0 and (
                member < 0 or not any(test(image.field(member).type) for test in binary)
            ):
                raise ConversionError(
                    f"{path}: column {self.image_column!r} is {image}, with neither a binary 'bytes' nor a 'path'"
                )
        elif not any(test(image) for test in binary):
            raise ConversionError(f"{path}: column {self.image_column!r} is {image}; expected binary image bytes")
        if self.label_column is not None:
            if self.label_column not in schema.names:
                raise ConversionError(f"{path}: no column {self.label_column!r} (columns: {names}); use --label-column")
            if not pa.types.is_integer(schema.field(self.label_column).type):
                label = schema.field(self.label_column).type
                raise ConversionError(f"{path}: label column {self.label_column!r} is {label}, not integers")

    def fields(self) -> dict[str, Field]:
        return {**self._image_fields(self.label_column is not None), "key": Field.text()}

    def classes(self) -> list[str] | None:
        if self.classes_file is not None:
            return read_classes_file(self.classes_file)
        return self._class_names

    def _columns(self, row: _Row) -> dict[str, list]:
        """The row group of ``row`` as Python lists, read once per group and kept while rows come from it."""
        if self._group is None or self._group[:3] != (os.getpid(), row.path, row.group):
            columns = [self.image_column] + ([self.label_column] if self.label_column else [])
            self._group = None  # the previous group is released before the next is read
            try:
                table = _open(row.path).read_row_group(row.group, columns=columns)
                values: dict[str, list] | str = {c: table.column(c).to_pylist() for c in columns}
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for damaged files
                fatal = process_wide_error(exc, row.path)
                if fatal is not None:
                    raise fatal from exc
                why = " ".join(str(exc).split())  # pyarrow's messages run over several lines
                values = f"cannot read row group {row.group} ({type(exc).__name__}: {why})"
            # A damaged group is kept as its reason too: each of its rows fails without reading it again.
            self._group = (os.getpid(), row.path, row.group, values)
        values = self._group[3]
        if isinstance(values, str):
            raise SampleError(f"{row.path}:{row.row}", values)
        return values

    def load(self, item: Item) -> Sample:
        row: _Row = item.data
        columns = self._columns(row)
        value = columns[self.image_column][row.index]
        path = None
        if isinstance(value, dict):
            value, path = value.get("bytes"), value.get("path")
        if value is None and path:  # Hugging Face `datasets` built from files: the struct names the file only
            image = load_image_file(beside(row.path, path), item.name, self.image_options)
        elif value is None:
            raise SampleError(item.name, f"the image ({self.image_column!r}) is null")
        else:
            image = prepare_image(value, item.name, self.image_options)
        sample: Sample = {"image": image}
        if self.label_column:
            label = columns[self.label_column][row.index]
            if label is None:
                raise SampleError(item.name, f"the label ({self.label_column!r}) is null")
            sample["label"] = np.array(label, dtype=np.int64)
        sample["key"] = (path or f"{os.path.basename(row.path)}:{row.row}").encode("utf-8")
        return sample

    def describe(self) -> dict[str, Any]:
        return self._described(files=self.patterns, image_column=self.image_column, label_column=self.label_column)


def _open(path: str):
    """A ``pyarrow.parquet.ParquetFile``; a clear error without pyarrow or for a file that is not Parquet."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConversionError("convert parquet needs pyarrow: pip install 'dali-pipes[parquet]'") from None
    try:
        # In object storage: a file whose reads are ranged requests, so a row group reads only its own pages.
        return pq.ParquetFile(open_input(path) if is_url(path) else path)
    except ConversionError:
        raise
    except Exception as exc:  # noqa: BLE001 - ArrowInvalid, OSError, ...
        raise ConversionError(f"{path}: not a readable Parquet file ({exc})") from None


def _hf_class_names(schema, label_column: str | None) -> list[str] | None:
    """The names of a Hugging Face ``ClassLabel`` label column, from the schema's ``huggingface`` metadata."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None or label_column is None:
        return None
    try:
        features = json.loads(raw)["info"]["features"]
    except (ValueError, KeyError, TypeError):
        log.warning("the Parquet schema's Hugging Face metadata cannot be read; class names left out")
        return None
    feature = features.get(label_column) if isinstance(features, dict) else None
    if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and isinstance(feature.get("names"), list):
        return [str(name) for name in feature["names"]]
    return None


# --- the command line -------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The ``dali-pipes convert parquet`` arguments (the output options are added by the CLI)."""
    parser.add_argument(
        "files", nargs="+", metavar="FILE", help="Parquet files (paths or 'data/train-*.parquet'), then OUT"
    )
    parser.add_argument("--image-column", default="image", help="image bytes or {bytes, path} struct (default: image)")
    parser.add_argument("--label-column", default="label", help="integer labels ('' for none; default: label)")
    add_common_arguments(parser)


def from_args(args, image_options: ImageOptions) -> tuple[ParquetSource, str]:
    """The source the parsed command line describes, and the output folder (the last positional argument)."""
    columns = ("image_column", "label_column")
    return ParquetSource.from_command_line(args, args.files, "Parquet files", image_options, *columns)
