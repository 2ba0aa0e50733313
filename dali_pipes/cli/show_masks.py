"""Masks drawn over the tiles of ``dali-pipes show``: instance masks in their box's colour, label maps by class.

Both blend a colour into the pixels a mask covers (``ALPHA`` of colour), so the
photo stays visible under it; padding (rows past ``num_boxes``, the ignore value
of a label map) is not drawn.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: How much of a mask's colour replaces the photo's where the mask is on.
ALPHA = 0.45


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return np.asarray(value)


def _blend(pixels: np.ndarray, where: np.ndarray, color: tuple[int, int, int]) -> None:
    area = pixels[where].astype(np.float32)
    pixels[where] = (area * (1 - ALPHA) + np.asarray(color, np.float32) * ALPHA).astype(np.uint8)


def overlay_instances(pixels: np.ndarray, masks: Any, labels: Any, num_boxes: Any, palette) -> np.ndarray:
    """``pixels`` (uint8 NHWC) with each real instance mask ``(N, M, H, W)`` blended in ``palette(label)``."""
    out = pixels.copy()
    masks, labels = _numpy(masks), _numpy(labels)
    counts = _numpy(num_boxes).reshape(-1).astype(int)
    height, width = out.shape[1:3]
    for i in range(len(out)):
        for k in range(int(counts[i])):
            _blend(out[i], masks[i, k, :height, :width].astype(bool), palette(int(labels[i, k])))
    return out


def overlay_label_maps(pixels: np.ndarray, maps: Any, ignore_index: int, palette) -> tuple[np.ndarray, np.ndarray]:
    """``pixels`` with each class of the label maps ``(N, H, W)`` blended in ``palette(class)`` (class 0 and the
    ignore value left bare), and each image's most frequent class other than those (-1 for none), for captions."""
    out = pixels.copy()
    maps = _numpy(maps)
    dominant = np.full(len(out), -1, dtype=np.int64)
    for i in range(len(out)):
        values, counts = np.unique(maps[i], return_counts=True)
        shown = (values != ignore_index) & (values != 0)
        for value in values[shown]:
            _blend(out[i], maps[i] == value, palette(int(value)))
        if shown.any():
            dominant[i] = int(values[shown][np.argmax(counts[shown])])
    return out, dominant
