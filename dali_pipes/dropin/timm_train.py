"""timm's ``create_dataset`` and ``create_loader``, reading datasets converted by ``dali-pipes convert``.

In timm's ``train.py`` the change is the import::

    -from timm.data import create_dataset, create_loader, resolve_data_config, Mixup, FastCollateMixup, AugMixDataset
    +from timm.data import resolve_data_config, Mixup, FastCollateMixup, AugMixDataset
    +from dali_pipes.dropin.timm_train import create_dataset, create_loader

and ``--data-dir`` names the folder holding the converted ``train/`` and
``validation/`` (or ``val/``) datasets. Every ``create_loader`` argument the
script passes is honoured or refused by name:

- the augmentation (``input_size``, ``scale``, ``ratio``, ``hflip``,
  ``color_jitter``, ``interpolation``, ``re_prob``/``re_mode``, ``mean``/``std``,
  ``crop_pct``, ``no_aug``) builds :func:`~dali_pipes.pipelines.presets.timm_defaults`'s specs;
- ``img_dtype`` casts the images as timm's prefetcher does;
- ``collate_fn=FastCollateMixup(...)`` (what ``--mixup``/``--cutmix`` make with
  the prefetcher) mixes the loader's batches with timm's ``Mixup`` of the same
  settings, which ``loader.mixup_enabled = False`` (``--mixup-off-epoch``) switches off;
- training drops the incomplete last batch (timm's ``drop_last``); evaluation reads
  every sample, the ranks' last batches filled by wrap-around as timm's distributed
  sampler fills them (dropping the filler would leave a rank an empty batch, which
  the script's metrics divide by);
- ``vflip``, ``grayscale_prob``, ``gaussian_blur_prob``, ``color_jitter_prob``,
  ``auto_augment``, ``num_aug_splits``/``num_aug_repeats``, ``re_count``/``re_split``,
  other crop modes and the scheduled-batch options are refused when set;
- ``num_workers``, ``pin_memory``, ``distributed`` (the loader finds the rank
  itself) and the other worker settings are left to DALI.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from dali_pipes.dropin.common import (
    ConvertedSplit,
    collate_on_batches,
    device_name,
    note_ignored,
    refuse_unsupported,
)

__all__ = ["create_dataset", "create_loader"]

#: timm's names for a split, tried in turn when the one asked for is not a folder (as timm's folder search does).
_SPLIT_NAMES = {"train": ("train", "training"), "validation": ("validation", "val", "valid", "eval", "evaluation")}
_SPLIT_NAMES["val"] = _SPLIT_NAMES["validation"]

#: Arguments of timm's create_loader the loader cannot honour, with the values that ask for nothing.
_UNSUPPORTED = {
    "vflip": (0.0, 0, None),
    "grayscale_prob": (0.0, 0, None),
    "gaussian_blur_prob": (0.0, 0, None),
    "color_jitter_prob": (None, 1.0),
    "auto_augment": (None, ""),
    "num_aug_repeats": (0, None),
    "num_aug_splits": (0, 1, None),
    "re_count": (1, None),
    "re_split": (False, None),
    "train_crop_mode": (None, "rrc"),
    "crop_mode": (None, "center"),
    "crop_border_pixels": (None, 0),
    "tf_preprocessing": (False, None),
    "input_size_choices": (None,),
    "batch_size_choices": (None,),
    "num_batches": (None,),
}
#: A DataLoader's own settings: taken, and left to DALI.
_MACHINERY = (
    "num_workers",
    "pin_memory",
    "distributed",
    "persistent_workers",
    "worker_seeding",
    "use_multi_epochs_loader",
    "batch_choice_weights",
    "batch_choice_seed",
    "batch_choice_schedule",
    "batch_schedule_epochs",
    "batch_schedule_spread",
    "batch_schedule_random_mix",
)


def create_dataset(
    name: str,
    root: str | os.PathLike | None = None,
    split: str = "validation",
    is_training: bool = False,
    **kwargs: Any,
) -> ConvertedSplit:
    """timm's ``create_dataset`` for a folder dataset: ``root/split``, converted by ``dali-pipes convert``.

    ``name`` must be timm's folder dataset (``""``, ``"folder"`` or ``"imagefolder"``);
    ``split`` is looked up under ``root`` by timm's names for it (``validation``:
    also ``val``, ``valid``...), and ``root`` itself serves when it is the dataset.
    """
    if name not in ("", "folder", "imagefolder"):
        raise ValueError(f"create_dataset({name!r}): the DALI loader reads folder datasets converted by dali-pipes")
    refuse_unsupported(
        "create_dataset", kwargs, {"class_map": (None, ""), "repeats": (0, None), "num_samples": (None,)}
    )
    if root is None:
        raise ValueError("create_dataset: give root (timm's --data-dir), the folder of the converted splits")
    return ConvertedSplit(
        _split_folder(Path(root), split),
        train=None,  # create_loader builds the spec from its own arguments
        val=None,
        is_training=is_training,
        hint="point --data-dir at the folder holding the converted train/ and validation/ (or val/) datasets",
        seed=kwargs.get("seed") or 0,  # train.py passes args.seed: the same on every rank
    )


def create_loader(
    dataset: ConvertedSplit, input_size: Any, batch_size: int, is_training: bool = False, **options: Any
) -> Any:
    """timm's ``create_loader``: a :class:`~dali_pipes.DALILoader` over ``dataset`` with timm's augmentation.

    Takes timm's arguments by their names (see the module docstring for what each does).
    """
    from dali_pipes.loading.compat import BatchFormat
    from dali_pipes.loading.loader import DALILoader

    if not isinstance(dataset, ConvertedSplit):
        raise TypeError(
            f"create_loader: dataset must come from dali_pipes.dropin.timm_train.create_dataset, got {dataset!r}"
        )
    refuse_unsupported("create_loader", options, _UNSUPPORTED)
    note_ignored("create_loader", options, _MACHINERY)
    spec = _spec(input_size, is_training, options)
    batch_format = BatchFormat(
        keys=("image", "label"),
        dtype=_dtype_name(options.get("img_dtype")),
        transform=_mixer(options.get("collate_fn")),
    )
    return DALILoader(
        dataset.root,
        spec,
        batch_size=batch_size,
        shuffle=bool(is_training),
        seed=dataset.seed,
        last_batch="drop" if is_training else "pad",
        device=device_name(options.get("device")),
        batch_format=batch_format,
    )


def _split_folder(root: Path, split: str) -> Path:
    """``root/split`` by timm's names for the split; ``root`` when it is the dataset itself."""
    for name in (split, *_SPLIT_NAMES.get(split, ())):
        if (root / name / "index.json").is_file() or (root / name).is_dir():
            return root / name
    return root


def _spec(input_size: Any, is_training: bool, options: dict[str, Any]) -> Any:
    """The spec timm's transforms for these arguments make (``transforms_imagenet_train``/``_eval``/no-aug)."""
    from dali_pipes.pipelines.config import ColorJitter
    from dali_pipes.pipelines.erasing import RandomErasing
    from dali_pipes.pipelines.presets import timm_defaults

    size = _square(input_size)
    interpolation = options.get("interpolation", "bilinear")
    train, val = timm_defaults(
        input_size=size,
        crop_pct=options.get("crop_pct") or 0.875,
        train_interpolation=interpolation,
        interpolation="bicubic" if interpolation == "random" else interpolation,
        hflip=options.get("hflip", 0.5),
        scale=tuple(options.get("scale") or (0.08, 1.0)),
        ratio=tuple(options.get("ratio") or (3 / 4, 4 / 3)),
    )
    normalise = {key: tuple(options[key]) for key in ("mean", "std") if options.get(key) is not None}
    if not is_training:
        return dataclasses.replace(val, **normalise)
    if options.get("no_aug"):  # timm's transforms_noaug_train: resize the shorter side, centre crop
        return dataclasses.replace(val, resize=size, **normalise)
    jitter = options.get("color_jitter", 0.4)
    if isinstance(jitter, (int, float)):
        jitter = (jitter, jitter, jitter, 0.0) if jitter > 0 else None  # timm's float: no hue shift
    erasing = None
    if options.get("re_prob", 0.0) > 0:
        erasing = RandomErasing(prob=options["re_prob"], mode=options.get("re_mode", "const"))
    return dataclasses.replace(train, jitter=ColorJitter(*jitter) if jitter else None, erasing=erasing, **normalise)


def _square(input_size: Any) -> int:
    """The side of timm's ``input_size`` (an int, or ``(channels, height, width)``); a non-square one is refused."""
    if isinstance(input_size, int):
        return input_size
    *channels, height, width = tuple(input_size)
    if height != width or channels not in ([], [3]):
        raise ValueError(f"create_loader(input_size={input_size!r}): the DALI loader makes square RGB images")
    return int(height)


def _dtype_name(dtype: Any) -> str | None:
    """A torch dtype's name for ``BatchFormat.dtype`` (None: float32, the specs' own output)."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return None if name == "float32" else name


def _mixer(collate_fn: Any) -> Any:
    """A batch transform for ``collate_fn``: timm's ``Mixup`` for a ``FastCollateMixup`` (same settings), else the
    ``collate_fn`` called on the batch's samples."""
    if type(collate_fn).__name__ != "FastCollateMixup":
        return collate_on_batches(collate_fn)
    # FastCollateMixup is a Mixup that mixes inside a collate_fn: its parent class mixes whole batches.
    mixup_class = next(cls for cls in type(collate_fn).__mro__ if cls.__name__ == "Mixup")
    fast = collate_fn
    mixup = mixup_class(
        mixup_alpha=fast.mixup_alpha,
        cutmix_alpha=fast.cutmix_alpha,
        cutmix_minmax=fast.cutmix_minmax,
        prob=fast.mix_prob,
        switch_prob=fast.switch_prob,
        mode=fast.mode,
        correct_lam=fast.correct_lam,
        label_smoothing=fast.label_smoothing,
        num_classes=fast.num_classes,
    )
    mixup.mixup_enabled = fast.mixup_enabled
    return mixup
