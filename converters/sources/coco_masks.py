"""COCO instance masks rasterised at conversion time into one small PNG per image.

The stored layout, and why. Each image gets two fields:

- ``masks``: a PNG of the image's size whose channels are *layers* of instance ids.
  Instances are placed greedily in the first layer where none of their pixels
  meet another instance's, and get the next id (1..255) of that layer; 0 is
  background. One layer (a grey PNG) holds every image whose instances do not
  overlap, which is most of COCO; overlapping instances (a person on a horse, a
  crowd region) open a second layer, and so on up to four (RGB for two or three
  layers, the unused channel zero; RGBA for four).
- ``mask_code``: int32 ``(n,)``, per annotation ``layer * 256 + id``.

Why this one: the loader needs a mask per box without Python work per instance,
and DALI must be able to move the masks with the image. A PNG is decoded by
DALI's own decoder, cropped with the same window as the image (``image_slice``
with the same relative anchor and shape), resized with nearest neighbour and
flipped, all on whatever device the image is on, at the cost of one to four
channels whatever the number of instances; each box's binary mask is then one
broadcast comparison (``layer_pixels == id``). Nearest-neighbour resizing moves
ids without mixing them, so the layers stay exact. The alternatives: one bit
plane per instance (n channels to crop and resize, and no image format DALI
decodes holds more than four); a plain instance-id map (one layer: loses the
overlapped part of every overlapping instance); RLE or polygons decoded in the
loader (Python per instance, or DALI's CPU-only polygon operators that do not
take RLE). A PNG of a few flat regions is small: a few percent of its JPEG on
disk, and little CPU per image to the conversion (the figures on the sample COCO
data are in the segmentation section of dali_pipes/pipelines/README.md).

Rasterisation is pycocotools' (``frPyObjects``/``decode``), the code COCO's own
evaluation uses, so a stored mask is bit for bit ``COCO.annToMask`` of the annotation.

Polygons of fewer than 3 points (:func:`degenerate_polygons`; DALI_extra's coco-mini has
three, 2-point lines of ``area`` 0) are not drawn: such a polygon has no area, and
pycocotools, which draws it as nothing when it follows a real polygon, cannot take it
alone (``frPyObjects`` reads a lone 4-number polygon as a box and fails), so that
``annToMask`` and torchvision's reference (``ConvertCocoPolysToMask``) fail on it, which
would leave its whole image out. detectron2 drops such polygons too, and drops
whole, box included, an instance that has no other polygon. Here that instance keeps its
box, category and crowd flag, and its mask is empty (its ``mask_code`` names an id no
pixel has, as for any instance whose polygon covers no pixel centre), because:

- the boxes, categories and crowd flags stay the JSON's whatever ``--masks`` (the
  same detection data with and without masks), and ``boxes``, ``category_id``,
  ``iscrowd`` and ``mask_code`` keep one row per annotation;
- an empty mask is what the annotation says (COCO's ``area`` of those three is 0);
  dropping the box instead would teach a detector that the object (each of coco-mini's
  three is its image's only instance: a clock, two pizzas) is background.

Each such annotation is listed in ``errors.jsonl`` (see ``CocoSource``); a training
loop that wants detectron2's behaviour drops the boxes whose mask is empty.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np
from PIL import Image

from converters.base import ConversionError, SampleError

#: Ids per layer (uint8, 0 = background) and layers per PNG (RGBA).
MAX_IDS_PER_LAYER = 255
MAX_LAYERS = 4
#: ``mask_code = layer * CODE_BASE + id``.
CODE_BASE = 256
#: The fewest coordinates of a polygon with an area (3 points); shorter ones are not drawn (module docstring).
MIN_POLYGON_COORDS = 6
_PNG_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def pycocotools_mask() -> Any:
    """pycocotools' ``mask`` module, or :class:`ConversionError` saying how to install it."""
    try:
        from pycocotools import mask
    except ImportError:
        raise ConversionError(
            "instance masks need pycocotools: pip install 'dali-pipes[coco]' (or pycocotools), "
            "or convert without --masks"
        ) from None
    return mask


def has_pycocotools() -> bool:
    """True when pycocotools can be imported."""
    try:
        pycocotools_mask()
    except ConversionError:
        return False
    return True


def decode_segmentation(segmentation: Any, height: int, width: int, where: str) -> np.ndarray:
    """The binary uint8 ``(height, width)`` mask of one COCO ``segmentation``; ValueError naming ``where``.

    Polygons (a list of ``[x0, y0, x1, y1, ...]`` in pixels), compressed RLE
    (``counts`` a string) and uncompressed RLE (``counts`` a list of run lengths)
    are accepted, whatever the crowd flag. Polygons of fewer than 3 points are not
    drawn (all of them: an empty mask); see the module docstring.
    """
    mask_api = pycocotools_mask()
    if isinstance(segmentation, list):
        _check_polygons(segmentation, where)
        drawn = [[float(v) for v in poly] for poly in segmentation if len(poly) >= MIN_POLYGON_COORDS]
        if not drawn:  # only polygons without area (listed by the source): an empty mask, see the module docstring
            return np.zeros((height, width), dtype=np.uint8)
        rle = mask_api.merge(mask_api.frPyObjects(drawn, height, width))
    elif isinstance(segmentation, dict) and "counts" in segmentation and "size" in segmentation:
        size = segmentation["size"]
        if not (isinstance(size, list) and len(size) == 2 and [int(v) for v in size] == [height, width]):
            raise ValueError(f"{where}: RLE size {size!r} disagrees with the image's [height, width] {[height, width]}")
        counts = segmentation["counts"]
        if isinstance(counts, list):
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts):
                raise ValueError(f"{where}: uncompressed RLE counts must be non-negative integers")
            if sum(counts) != height * width:
                raise ValueError(f"{where}: RLE counts cover {sum(counts)} pixels, the image has {height * width}")
            rle = mask_api.frPyObjects(segmentation, height, width)
        elif isinstance(counts, (str, bytes)):
            rle = {"size": [height, width], "counts": counts.encode("ascii") if isinstance(counts, str) else counts}
        else:
            raise ValueError(
                f"{where}: RLE counts must be a string (compressed) or a list, got {type(counts).__name__}"
            )
    else:
        raise ValueError(f"{where}: segmentation must be a list of polygons or an RLE object, got {segmentation!r:.80}")
    try:
        mask = mask_api.decode(rle)
    except Exception as exc:  # noqa: BLE001 - pycocotools raises plain exceptions for corrupt counts
        raise ValueError(f"{where}: unreadable RLE ({exc})") from None
    if mask.shape != (height, width):
        raise ValueError(f"{where}: RLE decodes to {mask.shape}, the image is {(height, width)}")
    return np.ascontiguousarray(mask, dtype=np.uint8)


def _check_polygons(polygons: list, where: str) -> None:
    if not polygons:
        raise ValueError(f"{where}: empty polygon list")
    for j, poly in enumerate(polygons):
        if not isinstance(poly, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in poly
        ):
            raise ValueError(f"{where}: polygon {j} must be a list of numbers x0, y0, x1, y1, ...")
        if len(poly) % 2:
            raise ValueError(f"{where}: polygon {j} has an odd number of coordinates ({len(poly)})")


def _is_points(poly: Any) -> bool:
    """Whether ``poly`` is a well-formed polygon: an even number of finite numbers."""
    return (
        isinstance(poly, list)
        and len(poly) % 2 == 0
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in poly)
    )


def degenerate_polygons(segmentation: Any) -> list[int]:
    """The indices of the polygons of ``segmentation`` with fewer than 3 points, not drawn (none for an RLE).

    Only well-formed polygons count: a malformed one (odd length, not numbers) is left
    for :func:`decode_segmentation` to refuse with its reason, which leaves its image out.
    """
    if not isinstance(segmentation, list):
        return []
    return [j for j, poly in enumerate(segmentation) if _is_points(poly) and len(poly) < MIN_POLYGON_COORDS]


def degenerate_note(segmentation: Any) -> str | None:
    """Why some polygons of ``segmentation`` are not drawn, and what becomes of its instance; None when all are.

    For ``errors.jsonl`` (the caller names the annotation and its image); the instance is kept either way.
    """
    dropped = degenerate_polygons(segmentation)
    if not dropped:
        return None
    points = [len(segmentation[j]) // 2 for j in dropped]
    which = (
        f"polygon {dropped[0]} has {points[0]} point(s)"
        if len(dropped) == 1
        else f"polygons {', '.join(map(str, dropped))} have {', '.join(map(str, points))} points"
    )
    left = len(segmentation) - len(dropped)
    mask = f"its mask is drawn from its other {left} polygon(s)" if left else "this instance's mask is empty"
    return (
        f"{which} (a polygon needs at least 3), no area: not drawn, so {mask}; its box, category and image are "
        "kept. Correct the annotation if the object should have a mask"
    )


def layer_instances(masks: Sequence[np.ndarray], height: int, width: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Greedy layers of instance ids: ``(layers uint8 (height, width, L), codes int32 (n,))``.

    ``L`` is 1, 3 or 4 (two layers are stored as three channels, the last zero).
    :class:`SampleError` naming ``name`` when a pixel is covered by more than
    :data:`MAX_LAYERS` instances.
    """
    layers: list[np.ndarray] = []
    counts: list[int] = []
    codes = np.zeros(len(masks), dtype=np.int32)
    for k, mask in enumerate(masks):
        on = mask.astype(bool)
        for layer, ids in enumerate(layers):
            if counts[layer] < MAX_IDS_PER_LAYER and not ids[on].any():
                break
        else:
            if len(layers) == MAX_LAYERS:
                raise SampleError(
                    name,
                    f"annotation {k} overlaps instances in all {MAX_LAYERS} mask layers (more than {MAX_LAYERS} "
                    "instances cover one pixel, or over 1020 instances); convert without --masks to keep its boxes",
                )
            layers.append(np.zeros((height, width), dtype=np.uint8))
            counts.append(0)
            layer = len(layers) - 1
        counts[layer] += 1
        layers[layer][on] = counts[layer]
        codes[k] = layer * CODE_BASE + counts[layer]
    if not layers:
        layers.append(np.zeros((height, width), dtype=np.uint8))
    if len(layers) == 2:
        layers.append(np.zeros((height, width), dtype=np.uint8))
    return np.stack(layers, axis=-1), codes


def encode_layers(layers: np.ndarray, size: tuple[int, int] | None = None) -> bytes:
    """PNG bytes of ``layers`` (H, W, 1|3|4), resized with nearest neighbour to ``size`` (width, height) if given."""
    channels = layers.shape[2]
    image = Image.fromarray(layers[:, :, 0] if channels == 1 else layers, mode=_PNG_MODES[channels])
    if size is not None and image.size != tuple(size):
        image = image.resize(tuple(size), Image.Resampling.NEAREST)
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=6)
    return out.getvalue()


def instance_masks(
    segmentations: Sequence[Any], ann_ids: Sequence[Any], height: int, width: int, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """Rasterise one image's segmentations and layer them (see :func:`layer_instances`).

    A bad segmentation is a :class:`SampleError` naming the image and the annotation's id.
    """
    masks = []
    for segmentation, ann_id in zip(segmentations, ann_ids):
        try:
            masks.append(decode_segmentation(segmentation, height, width, f"annotation id {ann_id}"))
        except ValueError as exc:
            raise SampleError(name, str(exc)) from None
    return layer_instances(masks, height, width, name)
