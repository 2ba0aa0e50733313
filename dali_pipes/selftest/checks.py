"""What ``dali-pipes selftest`` asks of one batch of each pipeline spec (host copies, as numpy arrays).

Each check returns the first problem as a sentence, or ``None``. The bounds come
from the spec itself (output size, dtype, layout, mean and std), so a check
fails on a wrong shape, dtype, layout, normalisation, label or box, never on
the random augmentation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dali_pipes.selftest.data import SampleData

_FLOAT_SLACK = 0.02  # float16 rounding and interpolation overshoot, in normalised units


def check_batch(name: str, batch: dict[str, np.ndarray], spec: Any, data: SampleData, *, classes: int, categories: int):
    """The first problem with ``batch`` of spec ``name``, or ``None``."""
    rows = len(batch["is_pad"])
    for output, value in batch.items():
        if len(value) != rows:
            return f"output {output!r} has {len(value)} rows but is_pad has {rows}"
    if name == "features":
        return _check_features(batch, data)
    problem = _check_images(batch["image"], spec)
    if problem:
        return problem
    if name.startswith("detection"):
        extent = tuple(batch["image"].shape[spec.layout.index(axis)] for axis in "HW")
        if (batch["image_size"] > np.array(extent)).any() or (batch["image_size"] < 1).any():
            return f"image_size {batch['image_size'].tolist()} does not fit the {extent[0]} x {extent[1]} batch"
        return _check_detection(batch, categories)
    return _check_labels(batch["label"], classes)


def _check_images(images: np.ndarray, spec: Any) -> str | None:
    if images.dtype != np.dtype(spec.dtype):
        return f"image dtype {images.dtype}, expected {spec.dtype}"
    if images.ndim != 4 or images.shape[spec.layout.index("C")] != 3:
        return f"image shape {images.shape} is not a batch of 3-channel images in {spec.layout}"
    height, width = (images.shape[spec.layout.index(axis)] for axis in "HW")
    # A size that follows a schedule is checked at epoch 0, the epoch the selftest checks.
    size = spec.size_at(0) if hasattr(spec, "size_at") else getattr(spec, "size", None)
    if isinstance(size, int) and not hasattr(spec, "max_size") and (height, width) != (size, size):
        return f"image shape {images.shape}: expected {size} x {size}"
    if isinstance(size, tuple) and (height, width) != size:
        return f"image shape {images.shape}: expected {size[0]} x {size[1]}"
    pixels = images.astype(np.float32)
    if not np.isfinite(pixels).all():
        return "image holds NaN or infinite values"
    low, high = _value_range(spec)
    if pixels.min() < low or pixels.max() > high:
        return f"image values span {pixels.min():.3f}..{pixels.max():.3f}, outside {low:.3f}..{high:.3f}"
    if pixels.std() < 1e-3 * (high - low):
        return "every image value is the same: nothing was decoded"
    return None


def _value_range(spec: Any) -> tuple[float, float]:
    """Where a spec's pixels must lie: 0..255 for uint8, else (0..1 - mean) / std with some slack."""
    if spec.dtype == "uint8":
        return 0.0, 255.0
    mean, std = np.asarray(spec.mean), np.asarray(spec.std)
    # 0 is also allowed: the detection specs pad the batch with zeros after normalising.
    low = min(0.0, float(((0.0 - mean) / std).min())) - _FLOAT_SLACK
    high = max(0.0, float(((1.0 - mean) / std).max())) + _FLOAT_SLACK
    return low, high


def _check_labels(labels: np.ndarray, classes: int) -> str | None:
    if labels.ndim == 2:  # MixUp/CutMix soft targets: one distribution over the classes per row
        if labels.dtype != np.float32 or labels.shape[1] != classes:
            return f"soft targets {labels.dtype} {labels.shape}, expected float32 (N, {classes})"
        if labels.min() < 0 or not np.allclose(labels.sum(axis=1), 1.0, atol=1e-4):
            return f"soft targets are not distributions over the classes: row sums {labels.sum(axis=1).tolist()}"
        return None
    if labels.dtype.kind not in "iu":
        return f"label dtype {labels.dtype}, expected an integer type"
    if labels.min() < 0 or labels.max() >= classes:
        return f"labels {sorted(set(labels.ravel().tolist()))} outside 0..{classes - 1}"
    return None


def _check_detection(batch: dict[str, np.ndarray], categories: int) -> str | None:
    boxes, labels, counts, sizes = batch["boxes"], batch["labels"], batch["num_boxes"], batch["image_size"]
    if boxes.dtype != np.float32 or boxes.ndim != 3 or boxes.shape[2] != 4:
        return f"boxes {boxes.dtype} {boxes.shape}, expected float32 (N, M, 4)"
    if labels.shape != boxes.shape[:2] or labels.dtype != np.int64:
        return f"labels {labels.dtype} {labels.shape}, expected int64 {boxes.shape[:2]}"
    if sizes.shape != (len(boxes), 2):
        return f"image_size {sizes.shape}, expected {(len(boxes), 2)}"
    for i, count in enumerate(counts.tolist()):
        valid, (height, width) = boxes[i, :count], sizes[i].tolist()
        x1, y1, x2, y2 = valid.T
        inside = (x1 >= -1e-3) & (y1 >= -1e-3) & (x2 <= width + 1e-3) & (y2 <= height + 1e-3)
        if not (inside & (x1 <= x2) & (y1 <= y2)).all():
            return f"sample {i}: boxes {valid.tolist()} are not [x1, y1, x2, y2] inside its {width} x {height} image"
        kept = labels[i, :count]
        if count and (kept.min() < 0 or kept.max() >= categories):
            return f"sample {i}: labels {kept.tolist()} outside 0..{categories - 1}"
        if (labels[i, count:] != -1).any() or (boxes[i, count:] != 0).any():
            return f"sample {i}: the rows past num_boxes={count} are not the filler (-1 labels, zero boxes)"
    return None


def _check_features(batch: dict[str, np.ndarray], data: SampleData) -> str | None:
    real = ~batch["is_pad"]
    index = batch["index"][real]
    if not np.array_equal(batch["features"][real], data.feature_values[index]):
        return f"features of samples {index.tolist()} differ from the stored arrays"
    if not np.array_equal(batch["label"][real], data.feature_labels[index]):
        return f"labels of samples {index.tolist()} differ from the stored ones"
    return None
