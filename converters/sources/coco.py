"""``coco``: a COCO instances JSON and its image folder, one sample per image."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import posixpath
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
from PIL import Image

from converters.base import ConversionError, ImageOptions, Item, Sample, SampleError, Source, absolute_path
from converters.images import load_image_file
from converters.remote_inputs import is_url, open_input, tree
from converters.sources import coco_masks
from dali_pipes.dataset.manifest import Field

log = logging.getLogger(__name__)


class CocoSource(Source):
    """One sample per entry of the JSON's ``images``, sorted by image id.

    Per image: ``image`` (the file's bytes), ``boxes`` (float32, ``(n, 4)``, COCO's
    ``[x, y, width, height]`` in pixels as stored), ``category_id`` (int64, ``(n,)``,
    COCO's ids, not remapped), ``iscrowd`` (uint8, ``(n,)``), ``image_id`` (int64),
    ``image_size`` (int64 ``(height, width)`` from the JSON) and ``key`` (the
    ``file_name``). Annotations keep their order in the JSON; an image without
    annotations has ``n = 0``.

    Instance masks (``masks=True``; off by default because it needs pycocotools and
    leaves out the images of bad segmentations, boxes and all): two more fields, ``masks`` (a PNG of instance-id
    layers) and ``mask_code`` (int32 ``(n,)``), described in
    :mod:`converters.sources.coco_masks`. A bad segmentation leaves its image out,
    listed with the reason in ``errors.jsonl``. A polygon of fewer than 3 points is
    not bad but empty: it is not drawn, the image and every instance are kept (an
    instance with no other polygon keeps its box with an empty mask, so the
    per-instance fields keep one row per annotation, as without masks), and each
    such annotation is listed in ``errors.jsonl`` with ``part`` naming it
    (:meth:`left_out_parts`).

    :meth:`classes` lists the category names in order of id (so ``classes()[k]``
    is the k-th category, which is category id ``k`` only when ids run from 0);
    ``extra()["categories"]`` keeps the id of each.
    """

    kind: ClassVar[str] = "coco"

    def __init__(
        self,
        images_dir: str | os.PathLike,
        annotations_json: str | os.PathLike,
        image_options: ImageOptions = ImageOptions(),
        masks: bool = False,
    ) -> None:
        self.images_dir = absolute_path(images_dir)
        self.annotations_json = absolute_path(annotations_json)
        self.image_options = image_options
        self.masks = masks
        self._parsed: _Coco | None = None
        self._with_masks: bool | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The parsed JSON can be hundreds of MB (COCO train); workers only need Item.data.
        state = dict(self.__dict__)
        state["_parsed"] = None
        return state

    def _coco(self) -> "_Coco":
        if self._parsed is None:
            if not is_url(self.images_dir) and not Path(self.images_dir).is_dir():
                raise ConversionError(
                    f"{self.images_dir}: no such image folder; give the folder the JSON's file_names are in"
                )
            self._parsed = _parse(self.annotations_json)
        return self._parsed

    def _sizes(self) -> Callable[[str], int | None]:
        """The size of an image by its path (``None``: not there): one listing of a URL folder, or ``os.stat``."""
        if is_url(self.images_dir):
            listed = tree(self.images_dir)
            return lambda file_name: listed.get(file_name)

        def local(file_name: str) -> int | None:
            try:
                return os.stat(os.path.join(self.images_dir, file_name)).st_size
            except OSError:
                return None

        return local

    def with_masks(self) -> bool:
        """Whether instance masks are stored (``masks=True``); checks that there are segmentations and pycocotools."""
        if self.masks and self._with_masks is None:
            if not self._coco().has_segmentations:
                raise ConversionError(f"{self.annotations_json}: no annotation has a 'segmentation' to store as a mask")
            coco_masks.pycocotools_mask()
            self._with_masks = True
        return bool(self.masks)

    def fields(self) -> dict[str, Field]:
        masks = {"masks": Field.image(), "mask_code": Field.array("int32", (-1,))} if self.with_masks() else {}
        return {
            "image": Field.image(),
            "boxes": Field.array("float32", (-1, 4)),
            "category_id": Field.array("int64", (-1,)),
            "iscrowd": Field.array("uint8", (-1,)),
            "image_id": Field.array("int64", ()),
            "image_size": Field.array("int64", (2,)),
            "key": Field.text(),
            **masks,
        }

    def classes(self) -> list[str]:
        """Category names in order of category id."""
        return [c["name"] for c in self._coco().categories]

    def extra(self) -> dict[str, Any]:
        return {"categories": [dict(c) for c in self._coco().categories]}

    def items(self) -> list[Item]:
        """One item per image, by image id. ``Item.data`` carries that image's annotations."""
        coco = self._coco()
        items = []
        missing = 0
        size_of = self._sizes()
        for image in coco.images:
            path = (
                posixpath.join(self.images_dir, image["file_name"])
                if is_url(self.images_dir)
                else (os.path.join(self.images_dir, image["file_name"]))
            )
            size = size_of(image["file_name"])
            if size is None:
                size = 0
                missing += 1
            boxes, categories, crowd, segmentations, ann_ids = coco.annotations.get(image["id"], ([], [], [], [], []))
            data = (
                image["file_name"],
                image["id"],
                (image["height"], image["width"]),
                np.array(boxes, dtype=np.float32).reshape(-1, 4),
                np.array(categories, dtype=np.int64),
                np.array(crowd, dtype=np.uint8),
                (segmentations, ann_ids) if self.with_masks() else None,
                _degenerate_notes(image["id"], segmentations, ann_ids) if self.with_masks() else (),
            )
            items.append(Item(name=path, size=size, data=data))
        if missing == len(items):
            raise ConversionError(
                f"{self.images_dir}: none of the {len(items)} images of {self.annotations_json} is here "
                f"(first: {coco.images[0]['file_name']}); give the folder the file_names are relative to"
            )
        if missing:
            log.warning(
                "%s: %d of %d images named in %s are missing; they will be reported as errors",
                self.images_dir,
                missing,
                len(items),
                self.annotations_json,
            )
        return items

    def left_out_parts(self, item: Item) -> list[tuple[str, str]]:
        """The annotations of the image whose polygons of fewer than 3 points are not drawn (masks only).

        Found from the JSON while planning, so a resumed run lists the same; see :mod:`converters.sources.coco_masks`.
        """
        return list(item.data[7])

    def load(self, item: Item) -> Sample:
        file_name, image_id, size, boxes, categories, crowd, segmentations, _ = item.data
        image = load_image_file(item.name, item.name, self.image_options)
        sample: Sample = {
            "image": image,
            "boxes": boxes,
            "category_id": categories,
            "iscrowd": crowd,
            "image_id": np.array(image_id, dtype=np.int64),
            "image_size": np.array(size, dtype=np.int64),
            "key": file_name.encode("utf-8"),
        }
        if segmentations is not None:
            sample["masks"], sample["mask_code"] = _masks(item.name, image, size, *segmentations)
        return sample

    def input_folders(self) -> list[Path]:
        return [] if is_url(self.images_dir) else [Path(self.images_dir)]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "images_dir": self.images_dir,
            "annotations_json": self.annotations_json,
            "image_options": self.image_options.to_json(),
            # Only when on: a dataset (or unfinished job) converted without masks keeps the description it had.
            **({"masks": True} if self.with_masks() else {}),
        }


class _Coco:
    """The parts of a COCO JSON that are stored: images by id, categories by id, annotations per image."""

    def __init__(self, images: list[dict], categories: list[dict], annotations: dict[int, tuple[list, ...]]):
        self.images = images
        self.categories = categories
        self.annotations = annotations
        self.has_segmentations = any(s is not None for per in annotations.values() for s in per[3])


def _degenerate_notes(image_id: int, segmentations: list, ann_ids: list) -> tuple[tuple[str, str], ...]:
    """``(part, reason)`` for each annotation of one image that has polygons too short to draw."""
    notes = []
    for segmentation, ann_id in zip(segmentations, ann_ids):
        note = coco_masks.degenerate_note(segmentation)
        if note is not None:
            notes.append((f"annotation id {ann_id}", f"annotation id {ann_id} (image id {image_id}): {note}"))
    return tuple(notes)


def _masks(
    name: str, image: bytes, size: tuple[int, int], segmentations: list, ann_ids: list
) -> tuple[bytes, np.ndarray]:
    """The ``masks`` PNG and ``mask_code`` of one image, at the stored image's size; SampleError for bad input."""
    height, width = size
    stored = _image_size(image)
    if stored != (width, height) and _image_size_scaled(stored, width, height) is None:
        raise SampleError(name, f"the image is {stored[0]}x{stored[1]} but the annotations say {width}x{height}")
    missing = [i for i, s in zip(ann_ids, segmentations) if s is None]
    if missing:
        raise SampleError(name, f"annotation id {missing[0]} has no 'segmentation' while others have one")
    layers, codes = coco_masks.instance_masks(segmentations, ann_ids, height, width, name)
    return coco_masks.encode_layers(layers, stored), codes


def _image_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        return image.size


def _image_size_scaled(stored: tuple[int, int], width: int, height: int) -> tuple[int, int] | None:
    """``stored`` when it is ``(width, height)`` shrunk with its aspect kept (``--max-size``), else None."""
    if max(stored) >= max(width, height):
        return None
    scale = max(stored) / max(width, height)
    expected = (max(1, round(width * scale)), max(1, round(height * scale)))
    return stored if all(abs(a - b) <= 1 for a, b in zip(expected, stored)) else None


def _parse(path: str) -> _Coco:
    if not is_url(path) and not Path(path).is_file():
        raise ConversionError(f"{path}: no such annotations file; give a COCO instances JSON")
    try:
        # A URL is read in order through large ranged requests (each retried), never copied whole.
        with open_input(path) if is_url(path) else open(path, "rb") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object with 'images', 'annotations' and 'categories'")
    for key in ("images", "categories"):
        if not isinstance(data.get(key), list):
            raise ConversionError(f"{path}: no '{key}' list; is this a COCO instances file?")
    raw_annotations = data.get("annotations", [])
    if not isinstance(raw_annotations, list):
        raise ConversionError(f"{path}: 'annotations' must be a list")

    images = [_image(path, i, entry) for i, entry in enumerate(data["images"])]
    if not images:
        raise ConversionError(f"{path}: 'images' is empty; there is nothing to convert")
    images.sort(key=lambda im: im["id"])
    for a, b in zip(images, images[1:]):
        if a["id"] == b["id"]:
            raise ConversionError(f"{path}: image id {a['id']} appears twice ({a['file_name']}, {b['file_name']})")

    categories = [_category(path, i, entry) for i, entry in enumerate(data["categories"])]
    categories.sort(key=lambda c: c["id"])
    for a, b in zip(categories, categories[1:]):
        if a["id"] == b["id"]:
            raise ConversionError(f"{path}: category id {a['id']} appears twice ({a['name']!r}, {b['name']!r})")

    image_ids = {im["id"] for im in images}
    category_ids = {c["id"] for c in categories}
    per_image: dict[int, tuple[list, ...]] = {}
    for i, ann in enumerate(raw_annotations):
        image_id, box, category, crowd = _annotation(path, i, ann, image_ids, category_ids)
        boxes, cats, crowds, segmentations, ann_ids = per_image.setdefault(image_id, ([], [], [], [], []))
        boxes.append(box)
        cats.append(category)
        crowds.append(crowd)
        # Checked when the image is converted, so that a bad one leaves out its image, not the job.
        segmentations.append(ann.get("segmentation"))
        ann_ids.append(ann.get("id", f"at annotations[{i}]"))
    log.debug("%s: %d images, %d annotations, %d categories", path, len(images), len(raw_annotations), len(categories))
    return _Coco(images, categories, per_image)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _image(path: Path, i: int, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ConversionError(f"{path}: images[{i}] is not an object")
    where = f"{path}: images[{i}] (id {entry.get('id')!r})"
    if not _is_int(entry.get("id")):
        raise ConversionError(f"{where} has no integer 'id'")
    name = entry.get("file_name")
    if not isinstance(name, str) or not name:
        raise ConversionError(f"{where} has no 'file_name'")
    for side in ("height", "width"):
        if not _is_int(entry.get(side)) or entry[side] <= 0:
            raise ConversionError(f"{where} has {side} {entry.get(side)!r}; expected a positive integer")
    return {"id": entry["id"], "file_name": name, "height": entry["height"], "width": entry["width"]}


def _category(path: Path, i: int, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, dict) or not _is_int(entry.get("id")) or not isinstance(entry.get("name"), str):
        raise ConversionError(f"{path}: categories[{i}] needs an integer 'id' and a string 'name', got {entry!r}")
    return {"id": entry["id"], "name": entry["name"], "supercategory": entry.get("supercategory")}


def _annotation(
    path: Path, i: int, ann: Any, image_ids: set[int], category_ids: set[int]
) -> tuple[int, list, int, int]:
    if not isinstance(ann, dict):
        raise ConversionError(f"{path}: annotations[{i}] is not an object")
    where = f"{path}: annotations[{i}] (id {ann.get('id')!r})"
    image_id = ann.get("image_id")
    if not _is_int(image_id) or image_id not in image_ids:
        raise ConversionError(f"{where} points to image id {image_id!r}, which is not in 'images'")
    category = ann.get("category_id")
    if not _is_int(category) or category not in category_ids:
        raise ConversionError(f"{where} has category_id {category!r}, which is not in 'categories'")
    box = ann.get("bbox")
    if (
        not isinstance(box, list)
        or len(box) != 4
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)
        or box[2] < 0
        or box[3] < 0
    ):
        raise ConversionError(f"{where} has bbox {box!r}; expected [x, y, width, height] with width, height >= 0")
    crowd = ann.get("iscrowd", 0)
    if not _is_int(crowd) or crowd not in (0, 1):
        raise ConversionError(f"{where} has iscrowd {crowd!r}; expected 0 or 1")
    return image_id, box, category, int(crowd)
