"""RandomErasing with timm's semantics: the configuration and the per-batch random draws.

As for :mod:`dali_pipes.pipelines.mixing`, the boxes are drawn in Python, once
per batch, with the very calls timm's ``RandomErasing`` makes on Python's
``random`` module, here on a ``random.Random`` seeded by ``(seed, epoch, batch,
rank)``; the DALI graph (:mod:`dali_pipes.pipelines.recipe_ops`) erases them. The
fill of ``mode="rand"`` (a normal colour per box) is drawn here too; the per-pixel
noise of ``mode="pixel"`` is drawn by DALI in the graph. Nothing here imports DALI.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np

from dali_pipes.pipelines.config import check_choice, check_probability, check_range

__all__ = ["ERASE_MODES", "ErasingDraw", "RandomErasing"]

EraseMode = Literal["const", "rand", "pixel"]
ERASE_MODES: tuple[str, ...] = ("const", "rand", "pixel")
#: timm tries this many boxes before giving one up.
_ATTEMPTS = 10


@dataclass(frozen=True, kw_only=True)
class RandomErasing:
    """timm's ``RandomErasing``, on the normalised images in the DALI graph.

    With probability ``prob`` an image gets between ``min_count`` and ``max_count``
    boxes (drawn uniformly; ``max_count=None`` means ``min_count``), each of area
    ``uniform(min_area, max_area) * H * W / count`` and aspect ratio (height/width)
    log-uniform in ``[min_aspect, max_aspect]`` (``None``: ``1 / min_aspect``); a box
    that does not fit in 10 attempts is skipped. ``mode`` fills a box with 0
    (``"const"``: the mean colour after normalisation), one normal colour per channel
    (``"rand"``) or normal noise per pixel (``"pixel"``).
    """

    prob: float = 0.5
    min_area: float = 0.02
    max_area: float = 1 / 3
    min_aspect: float = 0.3
    max_aspect: Optional[float] = None
    mode: EraseMode = "const"
    min_count: int = 1
    max_count: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prob", check_probability("RandomErasing.prob", self.prob))
        area = check_range("RandomErasing.(min_area, max_area)", (self.min_area, self.max_area), upper=1.0)
        object.__setattr__(self, "min_area", area[0])
        object.__setattr__(self, "max_area", area[1])
        min_aspect = check_range("RandomErasing.min_aspect", (self.min_aspect, self.min_aspect))[0]
        max_aspect = self.max_aspect if self.max_aspect is not None else 1 / min_aspect  # timm's default
        aspect = check_range("RandomErasing.(min_aspect, max_aspect)", (min_aspect, max_aspect))
        object.__setattr__(self, "min_aspect", aspect[0])
        object.__setattr__(self, "max_aspect", aspect[1])
        check_choice("RandomErasing.mode", self.mode, ERASE_MODES)
        max_count = self.min_count if self.max_count is None else self.max_count
        for name, value in (("min_count", self.min_count), ("max_count", max_count)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RandomErasing.{name} must be an integer >= 1, got {value!r}")
        if max_count < self.min_count:
            raise ValueError(f"RandomErasing.max_count ({max_count}) must be >= min_count ({self.min_count})")
        object.__setattr__(self, "max_count", max_count)

    def draw(
        self, rng: random.Random, colour_rng: np.random.Generator, rows: int, size: tuple[int, int], channels: int = 3
    ) -> "ErasingDraw":
        """The boxes of ``rows`` images of ``size`` = ``(height, width)``, drawn on ``rng`` as timm draws them.

        The ``"rand"`` colours come from ``colour_rng``: timm draws them with torch, so
        drawing them on ``rng`` would move every later box away from timm's.
        """
        img_h, img_w = size
        slots = int(self.max_count)  # type: ignore[arg-type] - set in __post_init__
        boxes = np.zeros((rows, slots, 4), dtype=np.float32)
        colours = np.zeros((rows, slots, channels), dtype=np.float32)
        log_aspect = (math.log(self.min_aspect), math.log(self.max_aspect))  # type: ignore[arg-type]
        for row in range(rows):
            for slot, box in enumerate(self._erase(rng, img_h, img_w, log_aspect)):
                boxes[row, slot] = box
                if self.mode == "rand":
                    colours[row, slot] = colour_rng.standard_normal(channels)
        return ErasingDraw(boxes, colours)

    def _erase(self, rng: random.Random, img_h: int, img_w: int, log_aspect: tuple[float, float]) -> list:
        """timm's ``RandomErasing._erase``, the same calls on ``rng``: the boxes ``[top, left, h, w]`` of one image."""
        if rng.random() > self.prob:
            return []
        area = img_h * img_w
        count = self.min_count if self.min_count == self.max_count else rng.randint(self.min_count, self.max_count)
        boxes = []
        for _ in range(count):
            for _attempt in range(_ATTEMPTS):
                target_area = rng.uniform(self.min_area, self.max_area) * area / count
                aspect_ratio = math.exp(rng.uniform(*log_aspect))
                h = int(round(math.sqrt(target_area * aspect_ratio)))
                w = int(round(math.sqrt(target_area / aspect_ratio)))
                if w < img_w and h < img_h:
                    top = rng.randint(0, img_h - h)
                    left = rng.randint(0, img_w - w)
                    boxes.append((top, left, h, w))
                    break
        return boxes


@dataclass(frozen=True)
class ErasingDraw:
    """One batch's boxes, ``[B, max_count, 4]`` as ``[top, left, height, width]`` (unused slots all 0),
    and the ``"rand"`` fill colours ``[B, max_count, C]``."""

    boxes: np.ndarray
    colours: np.ndarray
