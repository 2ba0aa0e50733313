"""MixUp and CutMix with timm's ``Mixup`` semantics: the configuration and the per-batch random draws.

The draws are made in Python, once per batch, from a ``numpy.random.RandomState``
seeded by ``(seed, epoch, batch, rank)``, with the very calls, in the same order
and with the same dtypes, that timm's ``Mixup`` makes on numpy's global state. So
the mix of a batch is the same on every run and after a resume, and a test can
seed numpy's global state the same way and get timm's own result for the batch.
The DALI graph (:mod:`dali_pipes.pipelines.recipe_ops`) applies what is drawn
here. Nothing here imports DALI.

timm's partner of row ``i`` is row ``B - 1 - i`` (the batch reversed). Here the
batch is reversed among its real rows only: the ``is_pad`` filler of a last batch
is never a real row's partner, and filler rows are left unmixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np

from dali_pipes.pipelines.config import check_choice, check_probability

__all__ = ["MIX_MODES", "Mix", "MixDraw"]

MixMode = Literal["batch", "pair", "elem"]
MIX_MODES: tuple[str, ...] = ("batch", "pair", "elem")


@dataclass(frozen=True, kw_only=True)
class Mix:
    """MixUp/CutMix in the DALI graph, with the arguments and meaning of timm's ``Mixup``.

    ``mixup_alpha`` and ``cutmix_alpha`` are the Beta distributions' parameters
    (0 turns that one off; at least one must be > 0); ``prob`` is the chance that a
    batch (``mode="batch"``), a pair of rows (``"pair"``) or a row (``"elem"``) is
    mixed at all; ``switch_prob`` the chance of CutMix rather than MixUp when both
    are on. CutMix's lambda is corrected by the box's area after clipping to the
    image (timm's ``correct_lam=True``). Labels come out as soft targets, float32
    ``[B, num_classes]``, smoothed by ``label_smoothing``; ``num_classes=None``
    takes the number of classes from the dataset's manifest.
    """

    mixup_alpha: float = 1.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5
    mode: MixMode = "batch"
    label_smoothing: float = 0.1
    num_classes: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("mixup_alpha", "cutmix_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"Mix.{name} must be a finite number >= 0 (0 turns it off), got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.mixup_alpha == 0 and self.cutmix_alpha == 0:
            raise ValueError("Mix: mixup_alpha and cutmix_alpha are both 0; set one > 0, or pass mix=None")
        object.__setattr__(self, "prob", check_probability("Mix.prob", self.prob))
        object.__setattr__(self, "switch_prob", check_probability("Mix.switch_prob", self.switch_prob))
        object.__setattr__(self, "label_smoothing", check_probability("Mix.label_smoothing", self.label_smoothing))
        check_choice("Mix.mode", self.mode, MIX_MODES)
        n = self.num_classes
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
            raise ValueError(f"Mix.num_classes must be an integer >= 2, or None for the dataset's, got {n!r}")

    @property
    def on_off_values(self) -> tuple[float, float]:
        """The one-hot target's values after label smoothing (timm's ``mixup_target``)."""
        off = self.label_smoothing / self.num_classes
        return 1.0 - self.label_smoothing + off, off

    def draw(self, rng: np.random.RandomState, is_pad: np.ndarray, size: tuple[int, int]) -> "MixDraw":
        """What to do to each row of a batch: timm's draws on ``rng`` for the batch's real rows.

        ``is_pad`` marks the filler rows; ``size`` is the images' ``(height, width)``.
        """
        return _draw(self, rng, np.asarray(is_pad, dtype=bool), size)

    # --- timm's _params_per_batch and _params_per_elem, the same calls on `rng` ---

    def _params_per_elem(self, rng: np.random.RandomState, n: int) -> tuple[np.ndarray, np.ndarray]:
        lam = np.ones(n, dtype=np.float32)
        use_cutmix = np.zeros(n, dtype=bool)
        if self.mixup_alpha > 0.0 and self.cutmix_alpha > 0.0:
            use_cutmix = rng.rand(n) < self.switch_prob
            lam_mix = np.where(
                use_cutmix,
                rng.beta(self.cutmix_alpha, self.cutmix_alpha, size=n),
                rng.beta(self.mixup_alpha, self.mixup_alpha, size=n),
            )
        elif self.mixup_alpha > 0.0:
            lam_mix = rng.beta(self.mixup_alpha, self.mixup_alpha, size=n)
        else:
            use_cutmix = np.ones(n, dtype=bool)
            lam_mix = rng.beta(self.cutmix_alpha, self.cutmix_alpha, size=n)
        lam = np.where(rng.rand(n) < self.prob, lam_mix.astype(np.float32), lam)
        return lam, use_cutmix

    def _params_per_batch(self, rng: np.random.RandomState) -> tuple[float, bool]:
        lam, use_cutmix = 1.0, False
        if rng.rand() < self.prob:
            if self.mixup_alpha > 0.0 and self.cutmix_alpha > 0.0:
                use_cutmix = bool(rng.rand() < self.switch_prob)
                alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
                lam_mix = rng.beta(alpha, alpha)
            elif self.mixup_alpha > 0.0:
                lam_mix = rng.beta(self.mixup_alpha, self.mixup_alpha)
            else:
                use_cutmix = True
                lam_mix = rng.beta(self.cutmix_alpha, self.cutmix_alpha)
            lam = float(lam_mix)
        return lam, use_cutmix


@dataclass(frozen=True)
class MixDraw:
    """One batch's mix, row by row: the partner, the image weight, the CutMix box and the label weight.

    Row ``i`` becomes ``img[i] * image_lam[i] + img[partner[i]] * (1 - image_lam[i])``
    outside its box and ``img[partner[i]]`` inside it (``box`` is ``[top, left, height,
    width]``, all 0 for no box); its target ``y[i] * target_lam[i] + y[partner[i]] *
    (1 - target_lam[i])``.
    """

    partner: np.ndarray  # int32 [B]
    image_lam: np.ndarray  # float32 [B]
    box: np.ndarray  # float32 [B, 4]
    target_lam: np.ndarray  # float32 [B]


def _draw(mix: Mix, rng: np.random.RandomState, is_pad: np.ndarray, size: tuple[int, int]) -> MixDraw:
    rows = len(is_pad)
    real = np.flatnonzero(~is_pad)
    n = len(real)
    partner = np.arange(rows, dtype=np.int32)
    partner[real] = real[::-1]
    image_lam = np.ones(rows, dtype=np.float32)
    target_lam = np.ones(rows, dtype=np.float32)
    box = np.zeros((rows, 4), dtype=np.float32)
    if n == 0:
        return MixDraw(partner, image_lam, box, target_lam)
    if mix.mode == "batch":
        lam, use_cutmix = mix._params_per_batch(rng)
        if lam != 1.0:
            if use_cutmix:
                box[real], lam = _cutmix_box(rng, size, lam)
            else:
                image_lam[real] = lam
            target_lam[real] = lam
        return MixDraw(partner, image_lam, box, target_lam)
    # "elem" draws for every real row, "pair" for the first half, each shared with its partner.
    count = n if mix.mode == "elem" else n // 2
    lams, use_cutmix = mix._params_per_elem(rng, count)
    for k in range(count):
        lam = lams[k]
        if lam == 1.0:
            continue
        rows_k = [real[k]] if mix.mode == "elem" else [real[k], real[n - 1 - k]]
        if use_cutmix[k]:
            box[rows_k], lam = _cutmix_box(rng, size, lam)
        else:
            image_lam[rows_k] = lam
        target_lam[rows_k] = lam
    return MixDraw(partner, image_lam, box, target_lam)


def _cutmix_box(rng: np.random.RandomState, size: tuple[int, int], lam: float) -> tuple[np.ndarray, float]:
    """timm's ``rand_bbox`` then ``correct_lam``: ``[top, left, height, width]`` and the corrected lambda."""
    img_h, img_w = size
    ratio = np.sqrt(1 - lam)  # float32 when lam is (the per-row draws), as in timm
    cut_h, cut_w = int(img_h * ratio), int(img_w * ratio)
    cy = rng.randint(0, img_h)
    cx = rng.randint(0, img_w)
    yl = np.clip(cy - cut_h // 2, 0, img_h)
    yh = np.clip(cy + (cut_h + 1) // 2, 0, img_h)
    xl = np.clip(cx - cut_w // 2, 0, img_w)
    xh = np.clip(cx + (cut_w + 1) // 2, 0, img_w)
    corrected = 1.0 - (yh - yl) * (xh - xl) / float(img_h * img_w)
    return np.array([yl, xl, yh - yl, xh - xl], dtype=np.float32), corrected
