"""``tfrecord``: ``tf.train.Example`` records, by default in the TF/TPU ImageNet layout, read without TensorFlow."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import numpy as np

from converters.base import ConversionError, ImageOptions, Item, Sample, SampleError
from converters.images import prepare_image
from converters.remote_inputs import is_url, open_input
from converters.sources._inputs import InputFilesSource, OpenFiles, add_common_arguments
from dali_pipes.dataset.manifest import Field
from dali_pipes.stores.base import StoreError
from dali_pipes.stores.tfexample import BYTES_LIST, FLOAT_LIST, INT64_LIST, decode_example, unframe
from dali_pipes.stores.tfrecord import walk_record_headers

log = logging.getLogger(__name__)

KIND = "tfrecord"
HELP = "TFRecord files of tf.train.Example (default: the TF/TPU ImageNet layout)"
BOX_SIDES = ("xmin", "ymin", "xmax", "ymax")


@dataclass(frozen=True)
class _Record:
    """Where record ``number`` of ``path`` lies; ``damage`` instead when the file cannot be read from here on."""

    path: str
    number: int
    offset: int
    size: int
    damage: str | None = None


class TFRecordSource(InputFilesSource):
    """Samples of TFRecord files of ``tf.train.Example`` records, one per record, in file order.

    Features by name (the defaults are the TF/TPU ImageNet layout of
    ``build_imagenet_data.py``): the image is the one byte string of
    ``image_feature``, the label the one integer of ``label_feature`` (``None``:
    no label field; ImageNet's labels are 1..1000 there and are stored as given),
    the key the ``key_feature`` string (``FILE:RECORD`` where a record has none).
    When the first record has ``{bbox_prefix}xmin``, the ``bbox`` field holds
    ``xmin ymin xmax ymax`` rows as stored (normalised, for ImageNet); it is not
    called ``boxes`` because the detection specs read ``boxes`` as COCO's xywh pixels.

    Both CRCs of every record are checked. A damaged record is a bad input; where
    a damaged header makes the rest of a file unreadable, that is one bad input
    naming the byte. Files are read as they are: a GZIP- or ZLIB-compressed file is refused.
    """

    kind: ClassVar[str] = KIND
    file_kind: ClassVar[str] = "TFRecord file"

    def __init__(
        self,
        files: Sequence[str | os.PathLike] | str,
        image_options: ImageOptions = ImageOptions(),
        *,
        image_feature: str = "image/encoded",
        label_feature: str | None = "image/class/label",
        key_feature: str | None = "image/filename",
        bbox_prefix: str | None = "image/object/bbox/",
        classes_file: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(files, image_options, classes_file)
        self.image_feature = image_feature
        self.label_feature = label_feature or None
        self.key_feature = key_feature or None
        self.bbox_prefix = bbox_prefix or None
        self._has_boxes: bool | None = None  # kept when pickled: every shard task asks fields()
        self._files = OpenFiles()

    def iter_items(self) -> Iterator[Item]:
        """One item per record, file by file; ``Item.size`` is the record's size, ``Item.anchor``
        ``(file number, byte offset, record number)``. The first readable record's features decide the fields."""
        readable = False
        for item in self.items_from((0, 0, 0)):
            if not readable and item.data.damage is None:
                self._learn_fields(item)
                readable = True
            yield item
        if not readable:
            raise self._no_samples("no readable record")

    def items_from(self, anchor: tuple[int, int, int]) -> Iterator[Item]:
        for index, path, (start, number) in self._files_from(anchor):
            for r in _records(path, start, number):
                yield Item(name=f"{r.path}:{r.number}", size=r.size, data=r, anchor=(index, r.offset, r.number))

    def _learn_fields(self, first: Item) -> None:
        features = self._features(first)
        if self.image_feature not in features:
            raise ConversionError(
                f"{first.name}: no feature {self.image_feature!r} (features: {', '.join(sorted(features))}); "
                "name the image feature with --image-feature"
            )
        self._has_boxes = self.bbox_prefix is not None and f"{self.bbox_prefix}xmin" in features

    def fields(self) -> dict[str, Field]:
        if self._has_boxes is None:
            for _ in self.iter_items():  # up to the first readable record
                if self._has_boxes is not None:
                    break
        fields = self._image_fields(self.label_feature is not None)
        if self._has_boxes:
            fields["bbox"] = Field.array("float32", (-1, 4))
        fields["key"] = Field.text()
        return fields

    def _features(self, item: Item) -> dict[str, tuple[str, Any]]:
        record: _Record = item.data
        if record.damage is not None:
            raise SampleError(item.name, record.damage)
        data = self._files.read(record.path, record.offset, record.size, item.name)
        try:
            return decode_example(unframe(data, item.name), item.name)
        except StoreError as exc:
            raise SampleError(item.name, str(exc).removeprefix(f"{item.name}: ")) from None

    def load(self, item: Item) -> Sample:
        features = self._features(item)
        image = _one(features, self.image_feature, BYTES_LIST, item.name)
        sample: Sample = {"image": prepare_image(image, item.name, self.image_options)}
        if self.label_feature:
            sample["label"] = np.array(_one(features, self.label_feature, INT64_LIST, item.name), dtype=np.int64)
        if self._has_boxes:
            sample["bbox"] = _boxes(features, self.bbox_prefix, item.name)
        if self.key_feature and self.key_feature in features:
            sample["key"] = _one(features, self.key_feature, BYTES_LIST, item.name)
        else:
            sample["key"] = item.name.encode("utf-8")
        return sample

    def extra(self) -> dict[str, Any]:
        if not self._has_boxes:
            return {}
        return {"bbox": f"xmin ymin xmax ymax rows from {self.bbox_prefix}{{xmin,ymin,xmax,ymax}}, as stored"}

    def describe(self) -> dict[str, Any]:
        return self._described(
            files=self.patterns,
            image_feature=self.image_feature,
            label_feature=self.label_feature,
            key_feature=self.key_feature,
            bbox_prefix=self.bbox_prefix,
        )


def _records(path: str, start: int = 0, number: int = 0) -> Iterator[_Record]:
    """The records of one file from record ``number`` at byte ``start`` on; a damaged header ends them with one
    record saying where and why.

    A local file is walked by its descriptor; a URL is read once in order, through a buffer of
    large ranged requests (headers in the same block cost nothing more), never copied whole.
    """
    with _header_reader(path) as (pread, end):
        where = start
        try:
            for offset, size in walk_record_headers(pread, end, path, start, number):
                yield _Record(path, number, offset, size)
                where, number = offset + size, number + 1
        except StoreError as exc:
            # A compressed file fails at its first header; refused whole, not counted as one bad record.
            compression = _compression(pread(0, 2)) if where == 0 else None
            if compression is not None:
                raise ConversionError(
                    f"{path}: the file is {compression}-compressed; TFRecord files are read in place, so decompress "
                    f"it first (TensorFlow's compression_type={compression!r})"
                ) from None
            damage = f"{str(exc).removeprefix(f'{path}: ')}; the rest of the file from byte {where} cannot be read"
            if start == 0:  # said by the planning pass; a task reading on from a later record says it again
                log.warning("%s: %s", path, damage)
            yield _Record(path, number, where, 0, damage)


@contextlib.contextmanager
def _header_reader(path: str) -> Iterator[tuple[Callable[[int, int], bytes], int]]:
    """``(pread(offset, size), file size)`` for ``path``, a local file or a URL."""
    if is_url(path):
        with open_input(path) as f:

            def pread_remote(offset: int, size: int) -> bytes:
                f.seek(offset)  # within the buffered block: no request
                return f.read(size)

            yield pread_remote, f.raw.size
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        yield (lambda offset, size: os.pread(fd, size, offset)), os.fstat(fd).st_size
    finally:
        os.close(fd)


def _compression(head: bytes) -> str | None:
    """``"GZIP"`` or ``"ZLIB"`` when ``head`` (a file's first two bytes) is that format's magic, else ``None``."""
    if head == b"\x1f\x8b":
        return "GZIP"
    if len(head) == 2 and head[0] == 0x78 and head[1] in (0x01, 0x5E, 0x9C, 0xDA):
        return "ZLIB"
    return None


def _one(features: dict[str, tuple[str, Any]], name: str, kind: str, where: str) -> Any:
    """The single value of feature ``name``, which must be a ``kind`` of one element."""
    if name not in features:
        raise SampleError(where, f"no feature {name!r} in this Example (features: {', '.join(sorted(features))})")
    found, values = features[name]
    if found != kind or len(values) != 1:
        raise SampleError(where, f"feature {name!r} is a {found} of {len(values)} values, expected one value ({kind})")
    return values[0]


def _boxes(features: dict[str, tuple[str, Any]], prefix: str, where: str) -> np.ndarray:
    """``(n, 4)`` float32 ``xmin ymin xmax ymax`` rows from the four float lists (none: an empty list)."""
    sides = []
    for side in BOX_SIDES:
        kind, values = features.get(prefix + side, (FLOAT_LIST, np.zeros(0, np.float32)))
        if kind != FLOAT_LIST:
            raise SampleError(where, f"feature {prefix + side!r} is a {kind}, expected a float_list")
        sides.append(values)
    if len({len(v) for v in sides}) != 1:
        counts = ", ".join(f"{s} {len(v)}" for s, v in zip(BOX_SIDES, sides))
        raise SampleError(where, f"the box features have different lengths ({counts})")
    return np.stack(sides, axis=1).astype(np.float32, copy=False)


# --- the command line -------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The ``dali-pipes convert tfrecord`` arguments (the output options are added by the CLI)."""
    parser.add_argument(
        "files", nargs="+", metavar="FILE", help="TFRecord files (paths, globs, 'train-*-of-01024'), then OUT"
    )
    parser.add_argument("--image-feature", default="image/encoded", help="encoded image (default: image/encoded)")
    parser.add_argument(
        "--label-feature", default="image/class/label", help="integer label ('' for none; default: image/class/label)"
    )
    parser.add_argument(
        "--key-feature", default="image/filename", help="sample key ('' for FILE:RECORD; default: image/filename)"
    )
    parser.add_argument(
        "--bbox-prefix",
        default="image/object/bbox/",
        help="box features PREFIX{xmin,ymin,xmax,ymax}, kept when present ('' for none; default: image/object/bbox/)",
    )
    add_common_arguments(parser)


def from_args(args, image_options: ImageOptions) -> tuple[TFRecordSource, str]:
    """The source the parsed command line describes, and the output folder (the last positional argument)."""
    features = ("image_feature", "label_feature", "key_feature", "bbox_prefix")
    return TFRecordSource.from_command_line(args, args.files, "TFRecord files", image_options, *features)
