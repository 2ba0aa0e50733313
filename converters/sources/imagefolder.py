"""``imagefolder``: ImageNet-style ``ROOT/CLASS/IMAGE`` folders."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping

import numpy as np

from converters.base import ConversionError, ImageOptions, Item, Sample, StreamingSource, absolute_path
from converters.images import load_image_file
from converters.remote_inputs import class_folders, is_url
from dali_pipes.dataset.manifest import Field

log = logging.getLogger(__name__)

#: The usual extensions of the accepted formats (lower case), for sources that must pick
#: files by name. ``imagefolder`` does not: it takes every visible file and judges it by
#: content (:mod:`converters.image_formats`), so a ``.jp2``, a ``.pgm`` or a JPEG named
#: ``.png`` is kept and anything else is listed with its reason.
IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".webp", ".tif", ".tiff"}
    | {".jp2", ".j2k", ".j2c", ".jpc", ".jpf", ".jpx", ".pnm", ".ppm", ".pgm", ".pbm"}
)


class ImageFolderSource(StreamingSource):
    """Images under ``ROOT/CLASS/...``; the label is the index of ``CLASS`` among the sorted class folders.

    Every visible sub-folder of ``root`` is a class (names sorted as strings, as
    torchvision's ``ImageFolder`` does); every visible file anywhere below it is an
    input, sorted by path, and is recognised as an image by its content, whatever its
    extension: a file that is not an image of an accepted format is left out and listed
    with its reason in ``errors.jsonl``. Hidden files and folders (``.name``) are ignored;
    loose files directly in ``root`` belong to no class and are named in one warning.

    A class folder that yields no sample (no files, or none that is an image) is refused,
    naming it, as torchvision's ``ImageFolder`` refuses an empty class: it would still
    take a label, and a stray folder (an earlier output written inside the input, say)
    shifts every label after it. ``allow_empty_classes=True`` keeps such a class, with
    its label reserved and no sample.

    Fields: ``image`` (the file's bytes), ``label`` (int64), ``key`` (the path
    relative to ``root``, with ``/``).
    """

    kind: ClassVar[str] = "imagefolder"
    class_ordered: ClassVar[bool] = True  # class after class

    def __init__(
        self,
        root: str | os.PathLike,
        image_options: ImageOptions = ImageOptions(),
        *,
        allow_empty_classes: bool = False,
    ) -> None:
        self.root = absolute_path(root)
        self.image_options = image_options
        self.allow_empty_classes = allow_empty_classes
        self._found: dict[int, int] = {}  # label -> files, counted while the items are walked in this process
        self._loose_said = False

    def _class_names(self) -> list[str]:
        if is_url(self.root):  # a tree in object storage: its class folders are the prefixes below ROOT
            names = class_folders(self.root)[0]
            if not names:
                raise ConversionError(f"{self.root}: no class folders; imagefolder expects objects at ROOT/CLASS/IMAGE")
            return names
        root = Path(self.root)
        if not root.exists():
            raise ConversionError(f"{root}: no such folder; give the root of a ROOT/CLASS/IMAGE tree")
        if not root.is_dir():
            raise ConversionError(f"{root}: not a folder; imagefolder reads a ROOT/CLASS/IMAGE tree")
        with os.scandir(root) as entries:
            names = sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())
        if not names:
            raise ConversionError(f"{root}: no class folders; imagefolder expects images in ROOT/CLASS/ sub-folders")
        return names

    def classes(self) -> list[str]:
        """The class folder names, sorted; the index of a name is its label."""
        return self._class_names()

    def fields(self) -> dict[str, Field]:
        return {"image": Field.image(), "label": Field.array("int64", ()), "key": Field.text()}

    def streams(self) -> bool:
        # A tree in object storage is listed once, whole (one request per 1,000 objects), and its items held.
        return not is_url(self.root)

    def iter_items(self) -> Iterator[Item]:
        """Every visible file, class by class, each class sorted by relative path. ``Item.size`` is the file size;
        ``Item.anchor`` is ``(label, position in its class)``. Refuses an empty class at the end of the stream."""
        classes = self._class_names()
        loose, walk = _listing(self.root)
        if loose and not self._loose_said:
            self._loose_said = True  # said once, though planning may walk the tree twice
            log.warning(
                "%s: %d file(s) directly in the root belong to no class and are not converted: %s",
                self.root,
                len(loose),
                ", ".join(loose[:5]) + (", ..." if len(loose) > 5 else ""),
            )
        self._found = {}
        for label, name in enumerate(classes):
            for position, (rel, size) in enumerate(walk(name)):
                yield self._item(rel, size, label, position)
                self._found[label] = position + 1
        if not self._found:
            raise ConversionError(f"{self.root}: its class folders hold no files; imagefolder reads ROOT/CLASS/IMAGE")
        for label, name in enumerate(classes):
            if label not in self._found:
                self._empty_class(name, label, "holds no files")
        log.debug("%s: %d images in %d classes", self.root, sum(self._found.values()), len(classes))

    def items_from(self, anchor: tuple[int, int]) -> Iterator[Item]:
        first_label, skip = anchor
        classes = self._class_names()
        _, walk = _listing(self.root)
        for label in range(first_label, len(classes)):
            for position, (rel, size) in enumerate(walk(classes[label])):
                if label > first_label or position >= skip:
                    yield self._item(rel, size, label, position)

    def _item(self, rel: str, size: int, label: int, position: int) -> Item:
        return Item(name=os.path.join(self.root, rel), size=size, data=(rel, label), anchor=(label, position))

    def input_folders(self) -> list[Path]:
        return [] if is_url(self.root) else [Path(self.root)]

    def check_result(self, left_out: Mapping[str, str]) -> None:
        """Refuse a class all of whose files were left out (none is an image): see the class docstring.

        The message names one file and why it was left out, so that the user learns the reason at once.
        """
        classes = self._class_names()
        label_of = {name: label for label, name in enumerate(classes)}
        lost: dict[int, list[str]] = {}
        for name in left_out:
            label = label_of.get(_class_of(self.root, name))
            if label is not None:
                lost.setdefault(label, []).append(name)
        for label, names in sorted(lost.items()):
            if len(names) >= self._found.get(label, 0):
                first = min(names)
                why = f"holds no image (every file in it was left out; {first}: {left_out[first]})"
                self._empty_class(classes[label], label, why)

    def _empty_class(self, name: str, label: int, why: str) -> None:
        if not self.allow_empty_classes:
            raise ConversionError(
                f"{os.path.join(self.root, name)}: class folder {name!r} {why}, yet it would take label {label} and "
                "shift the labels of the classes after it; remove the folder, or keep it as a class without "
                "samples with --allow-empty-classes"
            )
        log.warning(
            "%s: class folder %r %s; its label %d stays reserved (--allow-empty-classes)", self.root, name, why, label
        )

    def load(self, item: Item) -> Sample:
        rel, label = item.data
        data = load_image_file(os.path.join(self.root, rel), item.name, self.image_options)
        return {"image": data, "label": np.array(label, dtype=np.int64), "key": rel.encode("utf-8")}

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "root": self.root, "image_options": self.image_options.to_json()}


def _class_of(root: str, name: str) -> str:
    """The class folder of an input named ``name`` (``ROOT/CLASS/...``, a path or a URL)."""
    return name[len(root) :].lstrip("/").split("/", 1)[0]


def _listing(root: str):
    """The files loose in ``root`` (sorted), and a function giving a class folder's ``(relative path, size)``."""
    if is_url(root):
        _, loose, by_class = class_folders(root)
        return loose, lambda name: by_class.get(name, [])
    with os.scandir(root) as entries:
        loose = sorted(e.name for e in entries if not e.name.startswith(".") and not e.is_dir())
    return loose, lambda name: _walk_images(Path(root), name)


def _walk_images(root: Path, class_name: str) -> list[tuple[str, int]]:
    """``(path relative to root with '/', size in bytes)`` of every visible file below one class folder, sorted."""
    found: list[tuple[str, int]] = []
    seen: set[str] = set()
    # followlinks: class folders are often symlinked subsets of a larger tree; `seen` stops link loops.
    for folder, dirs, files in os.walk(root / class_name, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel_folder = Path(folder).relative_to(root).as_posix()
        for name in files:
            if not name.startswith("."):
                path = os.path.join(folder, name)
                try:
                    size = os.stat(path).st_size
                except OSError:
                    size = 0  # a dangling link: load() reports it as a bad sample with its reason
                found.append((f"{rel_folder}/{name}", size))
    found.sort()
    return found
