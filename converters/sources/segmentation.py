"""``segmentation``: images and their label maps (semantic segmentation), one sample per image.

Pairs are found by relative path without extension (VOC's ``JPEGImages/2007_000032.jpg``
with ``SegmentationClass/2007_000032.png``, ADE20K's ``images/training/x.jpg`` with
``annotations/training/x.png``), or listed in a ``--pairs`` file of ``IMAGE MASK``
lines (Cityscapes, whose names differ: ``..._leftImg8bit.png`` / ``..._gtFine_labelIds.png``).
A pairs file is streamed (the parent keeps no record per line: a task reads its lines again from a byte
offset); paired folders are walked and held, one small record per image, since pairing needs both listings.

The label map is read as class indices: a palette PNG's indices (VOC), a grey
image's values, 8 or 16 bit; a colour image is refused (it holds colours, not
indices). It is stored losslessly as a 16-bit grey PNG, whatever it came as, so
that the loader decodes every map the same way (DALI's decoder needs the bit
depth when the graph is built); a PNG of flat regions barely grows with the
unused high byte. A map whose size differs from its image, an image without a
map, and values at or above the class count (other than the ignore value) leave
the image out, listed with the reason in ``errors.jsonl``.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any, ClassVar, Iterator

import numpy as np
from PIL import Image

from converters.base import ConversionError, ImageOptions, Item, Sample, SampleError, StreamingSource, absolute_path
from converters.images import load_image_file
from converters.sources._inputs import read_classes_file, text_lines
from converters.sources.imagefolder import IMAGE_EXTENSIONS
from dali_pipes.dataset.manifest import Field
from dali_pipes.remote.urls import is_url, redact

log = logging.getLogger(__name__)

KIND = "segmentation"
HELP = "images and label maps paired by relative path (VOC, ADE20K), or by a --pairs file (Cityscapes)"
#: Pillow modes that hold class indices.
_INDEX_MODES = ("P", "L", "I;16", "I;16B", "I;16L", "I")
DEFAULT_IGNORE_INDEX = 255


class SegmentationSource(StreamingSource):
    """One sample per image: ``image`` (its bytes), ``mask`` (16-bit grey PNG of class indices) and ``key``.

    ``images`` and ``masks`` are the two folders (pairs by relative path without
    extension), or ``pairs`` a file of ``IMAGE MASK`` lines, paths relative to
    the file's folder or absolute. ``classes_file`` names the classes, one per
    line; with it, label values must be below the class count or equal
    ``ignore_index``. The manifest's ``extra`` keeps ``ignore_index`` and ``num_classes``.
    """

    kind: ClassVar[str] = KIND

    def __init__(
        self,
        images: str | os.PathLike | None = None,
        masks: str | os.PathLike | None = None,
        *,
        pairs: str | os.PathLike | None = None,
        classes_file: str | os.PathLike | None = None,
        ignore_index: int = DEFAULT_IGNORE_INDEX,
        image_options: ImageOptions = ImageOptions(),
    ) -> None:
        if (pairs is None) == (images is None or masks is None):
            raise ConversionError("give either an image folder and a label-map folder, or --pairs FILE")
        for given in (images, masks, pairs):
            if is_url(given):
                raise ConversionError(
                    f"{redact(given)}: segmentation reads local folders and pairs files only; copy them to a local "
                    "disk first (for example with 'aws s3 sync' or 'gsutil -m rsync'), or convert the image-label "
                    "pairs to a WebDataset or Parquet input, which convert reads from object storage"
                )
        if not isinstance(ignore_index, int) or not 0 <= ignore_index <= 65535:
            raise ConversionError(f"--ignore-index must be an integer in 0..65535, got {ignore_index!r}")
        self.images = None if images is None else absolute_path(images)
        self.masks = None if masks is None else absolute_path(masks)
        self.pairs = None if pairs is None else absolute_path(pairs)
        self.classes_file = None if classes_file is None else absolute_path(classes_file)
        self.ignore_index = ignore_index
        self.image_options = image_options
        self._classes = read_classes_file(self.classes_file)

    def fields(self) -> dict[str, Field]:
        return {"image": Field.image(), "mask": Field.image(), "key": Field.text()}

    def classes(self) -> list[str] | None:
        return self._classes

    def extra(self) -> dict[str, Any]:
        return {"ignore_index": self.ignore_index, "num_classes": None if self._classes is None else len(self._classes)}

    def input_folders(self) -> list[Path]:
        return [Path(p) for p in (self.images, self.masks) if p is not None]

    def streams(self) -> bool:
        return self.pairs is not None

    def items(self) -> list[Item]:
        """One item per image, each with its label map's path (``None`` when it has none): the pairs file's lines
        in order, or the paired folders' images sorted by key."""
        if self.streams():
            return list(self.iter_items())
        pairs = self._paired_folders()
        items = [Item(name=image, size=_size(image), data=(image, mask, key)) for key, image, mask in pairs]
        if not items:
            raise ConversionError(f"{self.images}: no images found")
        return items

    def iter_items(self) -> Iterator[Item]:
        """The pairs file's lines as items, streamed; ``Item.anchor`` is a line's byte offset. Paired folders:
        their held list (:meth:`items`), since the runner does not stream them."""
        if not self.streams():
            yield from self.items()
            return
        found = False
        for item in self.items_from(0):
            found = True
            yield item
        if not found:
            raise ConversionError(f"{self.pairs}: no images found (only blank or '#' lines)")

    def items_from(self, anchor: int) -> Iterator[Item]:
        """The pairs file's items from the line at byte ``anchor`` on."""
        path = Path(self.pairs)
        folder = os.path.dirname(self.pairs)  # relative paths are read from the pairs file's folder
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise ConversionError(f"{path}: cannot read the pairs file ({exc})") from None
        with f:
            for number, offset, parts in text_lines(f, anchor, path):
                if len(parts) != 2:
                    where = f"{path}:{number}" if anchor == 0 else f"{path}: line {number} after byte {anchor}"
                    raise ConversionError(f"{where}: expected 'IMAGE MASK', got {' '.join(parts)!r}")
                # os.path, not pathlib: pathlib interns every part of every path, a table that grows with the file.
                image, mask = (os.path.abspath(os.path.join(folder, p)) for p in parts)
                yield Item(name=image, size=_size(image), data=(image, mask, parts[0]), anchor=offset)

    def _paired_folders(self) -> list[tuple[str, str, str | None]]:
        for folder in (self.images, self.masks):
            if not Path(folder).is_dir():
                raise ConversionError(f"{folder}: no such folder")
        images = _by_key(Path(self.images), IMAGE_EXTENSIONS)
        masks = _by_key(Path(self.masks), None)
        orphans = sorted(set(masks) - set(images))
        if orphans:
            log.warning("%s: %d label map(s) have no image, e.g. %s", self.masks, len(orphans), masks[orphans[0]])
        return [(key, images[key], masks.get(key)) for key in sorted(images)]

    def load(self, item: Item) -> Sample:
        image_path, mask_path, key = item.data
        image = load_image_file(image_path, item.name, self.image_options)
        if mask_path is None or not os.path.isfile(mask_path):
            where = mask_path or os.path.join(self.masks, os.path.splitext(key)[0] + ".*")
            raise SampleError(item.name, f"no label map ({where} not found)")
        labels = _read_label_map(mask_path, item.name)
        with Image.open(io.BytesIO(image)) as decoded:
            size = decoded.size
        if (labels.shape[1], labels.shape[0]) != size:
            if self.image_options.max_size is None:
                raise SampleError(
                    item.name,
                    f"label map {mask_path} is {labels.shape[1]}x{labels.shape[0]}, the image is {size[0]}x{size[1]}",
                )
            # As int32 ("I"): Pillow's NEAREST samples 16-bit images ("I;16") at other pixels than 8- and 32-bit ones.
            labels = np.asarray(Image.fromarray(labels.astype(np.int32)).resize(size, Image.Resampling.NEAREST))
        self._check_values(labels, item.name, mask_path)
        out = io.BytesIO()
        Image.fromarray(labels.astype(np.uint16)).save(out, format="PNG", compress_level=6)
        return {"image": image, "mask": out.getvalue(), "key": key.encode("utf-8")}

    def _check_values(self, labels: np.ndarray, name: str, mask_path: str) -> None:
        if self._classes is None:
            return
        values = np.unique(labels)
        bad = values[(values >= len(self._classes)) & (values != self.ignore_index)]
        if bad.size:
            raise SampleError(
                name,
                f"label map {mask_path} has value(s) {bad[:5].tolist()} at or above the class count "
                f"{len(self._classes)} (ignore value {self.ignore_index})",
            )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "images": self.images,
            "masks": self.masks,
            "pairs": self.pairs,
            "classes_file": self.classes_file,
            "ignore_index": self.ignore_index,
            "image_options": self.image_options.to_json(),
        }


def _by_key(root: Path, extensions: frozenset[str] | None) -> dict[str, str]:
    """Files below ``root`` by relative path without extension (hidden files skipped); a key twice is refused."""
    found: dict[str, str] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if name.startswith(".") or (extensions is not None and ext.lower() not in extensions):
                continue
            path = os.path.join(folder, name)
            key = os.path.relpath(os.path.join(folder, stem), root)
            if key in found:
                raise ConversionError(f"{found[key]} and {path} have the same name without extension; keep one")
            found[key] = path
    return found


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read_label_map(path: str, name: str) -> np.ndarray:
    """The class indices of a label-map file, as a 2-D integer array; SampleError for what is not one."""
    try:
        with Image.open(path) as image:
            mode = image.mode
            if mode not in _INDEX_MODES:
                raise SampleError(
                    name,
                    f"label map {path} is a {mode} image (colours, not class indices); give palette or grey maps "
                    "(for Cityscapes, the *_labelIds.png files)",
                )
            labels = np.asarray(image)
    except (OSError, ValueError) as exc:
        raise SampleError(name, f"cannot read label map {path} ({exc})") from None
    if labels.ndim != 2 or labels.min(initial=0) < 0 or labels.max(initial=0) > 65535:
        raise SampleError(name, f"label map {path} must be 2-D with values in 0..65535")
    return labels


def add_arguments(parser) -> None:
    """The ``dali-pipes convert segmentation`` arguments (the output options are added by the CLI)."""
    parser.add_argument("paths", nargs="+", help="IMAGES MASKS OUT (two folders), or OUT alone with --pairs")
    parser.add_argument("--pairs", metavar="FILE", help="'IMAGE MASK' lines (relative to the file's folder)")
    parser.add_argument("--classes", metavar="FILE", help="class names, one per line (line 1 is class 0)")
    parser.add_argument(
        "--ignore-index",
        type=int,
        default=DEFAULT_IGNORE_INDEX,
        help=f"the label value that marks pixels to ignore (default: {DEFAULT_IGNORE_INDEX})",
    )


def from_args(args, image_options: ImageOptions) -> tuple[SegmentationSource, str]:
    """The source the parsed command line describes, and the output folder."""
    want = 1 if args.pairs else 3
    if len(args.paths) != want:
        raise ConversionError("give IMAGES MASKS OUT, or --pairs FILE and OUT")
    folders = {} if args.pairs else {"images": args.paths[0], "masks": args.paths[1]}
    source = SegmentationSource(
        **folders,
        pairs=args.pairs,
        classes_file=args.classes,
        ignore_index=args.ignore_index,
        image_options=image_options,
    )
    return source, args.paths[-1]
