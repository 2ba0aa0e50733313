"""``dali-pipes show``: a PNG grid of augmented samples, to check by eye that an augmentation is sane.

:func:`show` runs one batch of a dataset through a pipeline spec (the same
:class:`~dali_pipes.DALILoader` a training script uses) and :func:`write_grid`
lays it out: one tile per sample, a caption strip above it with the label and
class name, and for detection batches the boxes drawn in the output pixels
(only the first ``num_boxes`` rows of each sample; the rest is padding). Instance
segmentation adds each box's mask in its colour; semantic segmentation draws the
label map, class by class, with the most frequent class in the caption.
``--pipeline recipe`` is the training graph with RandomErasing and MixUp/CutMix:
its labels are soft targets, captioned with their two largest classes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dali_pipes.cli.words import counted

log = logging.getLogger(__name__)

#: ``--pipeline`` names -> what they run.
PIPELINES: tuple[str, ...] = (
    "train",
    "recipe",
    "val",
    "detection",
    "detection-val",
    "instance",
    "instance-val",
    "semantic",
    "semantic-val",
)
#: Height in pixels of the caption strip above each tile.
CAPTION = 14
#: Box outline width in pixels.
BOX_WIDTH = 2
# Saturated colours that stand out against photos; box k of class c takes PALETTE[c % len].
PALETTE: tuple[tuple[int, int, int], ...] = (
    (255, 0, 0),
    (0, 255, 0),
    (0, 0, 255),
    (255, 255, 0),
    (255, 0, 255),
    (0, 255, 255),
    (255, 128, 0),
    (128, 0, 255),
)


def box_color(label: int) -> tuple[int, int, int]:
    """The RGB colour boxes of class ``label`` are drawn in."""
    return PALETTE[int(label) % len(PALETTE)]


def make_spec(pipeline: str, *, size: int | None = None, ignore_index: int = 255) -> Any:
    """The pipeline spec behind a ``--pipeline`` name, at ``size`` (default 224, detection and segmentation 300)."""
    from dali_pipes import pipelines as p
    from dali_pipes.pipelines import ClassificationTrain, ClassificationVal, Detection, DetectionVal, Mix, RandomErasing

    if pipeline not in PIPELINES:
        raise ValueError(f"unknown pipeline {pipeline!r}; choose from {', '.join(PIPELINES)}")
    if pipeline == "train":
        return ClassificationTrain(size=size or 224)
    if pipeline == "recipe":
        # DeiT's settings, but per sample ("elem") and always erasing, so that one grid shows every kind of tile.
        mix = Mix(mixup_alpha=0.8, cutmix_alpha=1.0, mode="elem", label_smoothing=0.1)
        return ClassificationTrain(size=size or 224, mix=mix, erasing=RandomErasing(prob=1.0, mode="pixel"))
    if pipeline == "val":
        size = size or 224
        # The usual 224/256 ratio of ImageNet evaluation.
        return ClassificationVal(size=size, resize=max(size, round(size * 256 / 224)))
    side = size or 300
    if pipeline.startswith("semantic"):
        semantic = p.SemanticSegmentation if pipeline == "semantic" else p.SemanticSegmentationVal
        return semantic(size=(side, side), ignore_index=ignore_index)
    spec = {
        "detection": Detection,
        "detection-val": DetectionVal,
        "instance": p.InstanceSegmentation,
        "instance-val": p.InstanceSegmentationVal,
    }[pipeline]
    return spec(size=(side, side))


def spec_settings(spec: Any) -> str:
    """The settings of ``spec`` that differ from its class's defaults, as ``name=value`` (what a grid was drawn with)."""
    import dataclasses

    changed = []
    for field in dataclasses.fields(spec):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(spec, field.name)
        if value != default:
            changed.append(f"{field.name}={value!r}")
    return f"{type(spec).__name__}({', '.join(changed)})"


def show(
    dataset: str | os.PathLike,
    out: str | os.PathLike,
    *,
    pipeline: str = "train",
    num: int = 16,
    seed: int = 0,
    size: int | None = None,
    device: str = "auto",
    columns: int = 4,
) -> Path:
    """Write a grid of ``num`` augmented samples of ``dataset`` through ``pipeline`` to ``out``; return its path.

    The samples are the first batch of a shuffled epoch with ``seed``, so
    another seed shows other samples and other random augmentations.
    """
    from dali_pipes.loading.config import RunOptions
    from dali_pipes.loading.loader import DALILoader

    if num < 1:
        raise ValueError(f"num must be at least 1, got {num}")
    from dali_pipes.cli.show_masks import overlay_instances, overlay_label_maps
    from dali_pipes.stores import open_store

    manifest = open_store(dataset).manifest
    ignore_index = manifest.extra.get("ignore_index", 255) if isinstance(manifest.extra, dict) else 255
    spec = make_spec(pipeline, size=size, ignore_index=ignore_index)
    run = RunOptions(device=device, py_num_workers=0)
    with DALILoader(dataset, spec, batch_size=num, shuffle=True, seed=seed, run=run) as loader:
        classes = loader.store.manifest.classes
        batch = next(iter(loader))
    detection = pipeline.startswith(("detection", "instance"))
    log.info(
        "show: %s of %s, drawn with %s",
        counted(len(batch["image"]), f"{pipeline} sample"),
        dataset,
        spec_settings(spec),
    )
    images, labels = batch["image"], batch.get("labels", batch.get("label"))
    if pipeline.startswith("instance"):
        images = overlay_instances(to_pixels(images), batch["masks"], labels, batch["num_boxes"], box_color)
    elif pipeline.startswith("semantic"):
        images, labels = overlay_label_maps(to_pixels(images), batch["mask"], ignore_index, box_color)
    return write_grid(
        images,
        labels,
        out,
        classes=classes,
        columns=columns,
        max_images=num,
        boxes=batch["boxes"] if detection else None,
        num_boxes=batch["num_boxes"] if detection else None,
    )


def _numpy(value: Any) -> np.ndarray:
    """A torch tensor (any device) or array-like as a numpy array."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return np.asarray(value)


def to_pixels(images: Any, *, mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> np.ndarray:
    """A batch (NCHW or NHWC; normalised float or uint8) as uint8 NHWC pixels.

    Normalised batches are mapped back with ``mean``/``std`` (default: ImageNet's,
    the specs' default).
    """
    from dali_pipes.pipelines.config import IMAGENET_MEAN, IMAGENET_STD

    array = _numpy(images).astype(np.float32)
    if array.ndim != 4:
        raise ValueError(f"images must be a batch of shape (N, C, H, W) or (N, H, W, C), got {array.shape}")
    if array.shape[1] == 3 and array.shape[-1] != 3:
        array = array.transpose(0, 2, 3, 1)
    if array.size and array.max() > 20:  # uint8 output, not normalised
        pixels = array
    else:
        mean = np.asarray(IMAGENET_MEAN if mean is None else mean)
        std = np.asarray(IMAGENET_STD if std is None else std)
        pixels = array * std * 255 + mean * 255
    return np.clip(pixels, 0, 255).astype(np.uint8)


def _class_name(label: int, classes: Sequence[str] | None) -> str:
    return str(classes[label]) if classes is not None and 0 <= label < len(classes) else str(label)


def _caption(label: np.ndarray, classes: Sequence[str] | None) -> str:
    """``label: class`` for an integer label; the two largest classes and weights of a soft target."""
    if label.ndim == 0:
        return f"{int(label)}: {_class_name(int(label), classes)}"
    top = np.argsort(label)[::-1][:2]
    return " + ".join(f"{_class_name(int(k), classes)} {label[k]:.2f}" for k in top)[:60]


def _draw_boxes(
    draw: Any,
    origin: tuple[int, int],
    size: tuple[int, int],
    boxes: np.ndarray,
    labels: np.ndarray,
    classes: Sequence[str] | None,
) -> list[str]:
    """Draw one tile's ``boxes`` (xyxy in the tile's pixels) at its top-left ``origin``; return their class names in order.

    Each box is clipped to the tile of ``size`` (width, height), so that it never bleeds into its neighbour;
    one left empty by the clipping is not drawn but still named.
    """
    x, y = origin
    width, height = size
    names = []
    for (x1, y1, x2, y2), label in zip(boxes, labels):
        label = int(label)
        names.append(_class_name(label, classes))
        left, right = x + max(0.0, min(x1, x2)), x + min(width - 1.0, max(x1, x2))
        top, bottom = y + max(0.0, min(y1, y2)), y + min(height - 1.0, max(y1, y2))
        if right > left and bottom > top:
            draw.rectangle((left, top, right, bottom), outline=box_color(label), width=BOX_WIDTH)
    return names


def write_grid(
    images: Any,
    labels: Any,
    path: str | os.PathLike,
    *,
    classes: Sequence[str] | None = None,
    columns: int = 4,
    max_images: int = 16,
    boxes: Any = None,
    num_boxes: Any = None,
) -> Path:
    """Save a batch as a labelled PNG grid of ``columns`` tiles per row; return the path.

    ``images``: NCHW or NHWC, normalised float or uint8. Classification:
    ``labels`` holds one integer per image, written as ``label: class``, or
    soft targets ``(N, num_classes)``, written as their two largest classes.
    Detection: ``labels`` is ``(N, M)``, ``boxes`` ``(N, M, 4)`` xyxy in the
    output pixels and ``num_boxes`` ``(N,)``; the first ``num_boxes[i]`` boxes
    of image ``i`` are drawn in :func:`box_color` of their label, and the
    caption lists their class names.
    """
    from PIL import Image, ImageDraw

    if columns < 1:
        raise ValueError(f"columns must be at least 1, got {columns}")
    pixels = to_pixels(images)[:max_images]
    n, height, width, _ = pixels.shape
    label_array = _numpy(labels)
    detection = boxes is not None
    if detection:
        if num_boxes is None:
            raise ValueError("write_grid: boxes given without num_boxes (how many rows of each sample are real)")
        box_array = _numpy(boxes).astype(np.float32)
        counts = _numpy(num_boxes).reshape(-1).astype(int)
    elif label_array.ndim != 2:  # soft targets (MixUp/CutMix) stay (N, num_classes)
        label_array = label_array.reshape(-1)
    columns = min(columns, n) if n else columns
    rows = (n + columns - 1) // columns
    canvas = Image.new("RGB", (columns * width, rows * (height + CAPTION)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, tile in enumerate(pixels):
        x, y = (i % columns) * width, (i // columns) * (height + CAPTION)
        canvas.paste(Image.fromarray(tile), (x, y + CAPTION))
        if not detection:
            draw.text((x + 2, y + 1), _caption(label_array[i], classes), fill="black")
            continue
        count = int(counts[i])
        names = _draw_boxes(
            draw, (x, y + CAPTION), (width, height), box_array[i, :count], label_array[i, :count], classes
        )
        draw.text((x + 2, y + 1), f"{count} box(es): {', '.join(names)}"[:60], fill="black")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path
