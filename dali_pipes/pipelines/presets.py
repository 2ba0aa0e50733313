"""Spec pairs that give the augmentation of the scripts people train with, from those scripts' own flags.

- :func:`torchvision_reference`: torchvision's ``references/classification``
  (``ClassificationPresetTrain``/``ClassificationPresetEval``): random-resized crop,
  flip, no colour jitter, optional auto-augment and random erasing; evaluation
  resizes the shorter side and centre-crops.
- :func:`timm_defaults`: timm's ``train.py`` (``transforms_imagenet_train``/``_eval``):
  the same crop and flip with its colour jitter (no hue shift), and evaluation at
  ``crop_pct`` of the resize.

Both evaluations are :class:`~dali_pipes.pipelines.ClassificationVal`, whose geometry is
torchvision's ``Resize`` + ``CenterCrop``, which timm's evaluation uses too (its default
``crop_mode="center"`` with a square size): the longer side truncated, the window
``int(round(margin / 2))`` pixels in, halves to even (timm at 64 px: 73 -> 64, 4 pixels in).

Each returns ``(train, val)`` specs for :class:`~dali_pipes.DALILoader`. Mixing
(MixUp/CutMix) stays where each script does it: pass its mixer as
``BatchFormat(transform=...)`` (see :mod:`dali_pipes.loading.compat`). What a
flag asks for and DALI cannot do is refused, naming the flag.
"""

from __future__ import annotations

import math

from dali_pipes.pipelines.classification import ClassificationTrain, ClassificationVal
from dali_pipes.pipelines.config import ColorJitter
from dali_pipes.pipelines.erasing import RandomErasing

__all__ = ["timm_defaults", "torchvision_reference"]

#: torchvision's ``--auto-augment`` values that DALI has, by this package's names.
_TORCHVISION_AUTO_AUGMENT = {"ra": "rand_augment", "ta_wide": "trivial_augment"}


def torchvision_reference(
    *,
    train_crop_size: int = 224,
    val_resize_size: int = 256,
    val_crop_size: int = 224,
    interpolation: str = "bilinear",
    auto_augment: str | None = None,
    random_erase: float = 0.0,
    dtype: str = "float32",
) -> tuple[ClassificationTrain, ClassificationVal]:
    """The specs of torchvision's reference script for its flags (``--train-crop-size``, ``--interpolation``...)."""
    policy = None
    if auto_augment is not None:
        policy = _TORCHVISION_AUTO_AUGMENT.get(auto_augment)
        if policy is None:
            raise ValueError(
                f"--auto-augment {auto_augment}: DALI has {', '.join(_TORCHVISION_AUTO_AUGMENT)} "
                "(RandAugment, TrivialAugment Wide); AugMix and the AutoAugment policies are not available"
            )
    erasing = RandomErasing(prob=random_erase) if random_erase > 0 else None
    common = dict(interpolation=interpolation, dtype=dtype)
    train = ClassificationTrain(
        size=train_crop_size, flip=0.5, jitter=None, auto_augment=policy, erasing=erasing, **common
    )
    return train, ClassificationVal(size=val_crop_size, resize=val_resize_size, **common)


def timm_defaults(
    *,
    input_size: int = 224,
    crop_pct: float = 0.875,
    train_interpolation: str = "random",
    interpolation: str = "bicubic",
    color_jitter: float = 0.4,
    hflip: float = 0.5,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    reprob: float = 0.0,
    dtype: str = "float32",
) -> tuple[ClassificationTrain, ClassificationVal]:
    """The specs of timm's ``train.py`` for its flags (``--color-jitter``, ``--crop-pct``, ``--reprob``...).

    timm's colour jitter has no hue shift (``ColorJitter(x, x, x, 0)``); its
    evaluation resizes the shorter side to ``floor(input_size / crop_pct)`` and crops
    ``input_size``.
    """
    if not 0 < crop_pct <= 1:
        raise ValueError(f"--crop-pct must be in (0, 1], got {crop_pct}")
    jitter = ColorJitter(color_jitter, color_jitter, color_jitter, 0.0) if color_jitter > 0 else None
    train = ClassificationTrain(
        size=input_size,
        scale=scale,
        ratio=ratio,
        flip=hflip,
        jitter=jitter,
        erasing=RandomErasing(prob=reprob, mode="pixel") if reprob > 0 else None,
        interpolation=train_interpolation,
        dtype=dtype,
    )
    resize = math.floor(input_size / crop_pct)
    return train, ClassificationVal(size=input_size, resize=resize, interpolation=interpolation, dtype=dtype)
