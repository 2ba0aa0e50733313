"""timm's ``create_dataset`` and ``create_loader``, reading datasets converted by ``dali-pipes convert``.

In timm's ``train.py`` the change is the import::

    -from timm.data import create_dataset, create_loader, resolve_data_config, Mixup, FastCollateMixup, AugMixDataset
    +from timm.data import resolve_data_config, Mixup, FastCollateMixup, AugMixDataset
    +from dali_pipes.dropin.timm_train import create_dataset, create_loader

and ``--data-dir`` names the folder holding the converted ``train/`` and
``validation/`` (or ``val/``) datasets. Every argument of timm 1.0's
``create_dataset`` and ``create_loader`` is honoured or refused by name, and a
name neither has is a TypeError, as it is for timm's ``create_loader``:

- the class indices are timm's. Labels are renumbered only where timm's folder
  reader defines the numbering: a dataset converted from an image folder (manifest
  source kind ``"imagefolder"``) gets the class folders in timm's natural order
  (``'9'`` before ``'84'``), or ``class_map``'s; its converted labels (plain sorted
  order) are mapped to them on each batch, and ``dataset.classes``/``class_to_idx``
  list them. A dataset converted from anything else (TFRecord, WebDataset, plain
  LMDB, Parquet, a Hugging Face or Python dataset) keeps its labels exactly as stored,
  its source's own numbering, unless ``class_map`` is given: then stored label ``i``,
  named ``classes[i]``, becomes that name's index in the map. Repeated class names
  are refused wherever a name decides an index, and a label no class name covers
  raises naming it (:mod:`~dali_pipes.dropin.timm_classes`);
- the augmentation (``input_size``, ``scale``, ``ratio``, ``hflip``,
  ``color_jitter``, ``interpolation``, ``re_prob``/``re_mode``, ``mean``/``std``,
  ``crop_pct``, ``no_aug``) builds :func:`~dali_pipes.pipelines.presets.timm_defaults`'s specs;
- ``img_dtype`` (or the deprecated ``fp16``) casts the images as timm's prefetcher
  does, and only with ``use_prefetcher`` (the default), as timm;
- ``collate_fn=FastCollateMixup(...)`` (what ``--mixup``/``--cutmix`` make with
  the prefetcher) mixes the loader's batches with timm's ``Mixup`` of the same
  settings, which ``loader.mixup_enabled = False`` (``--mixup-off-epoch``) switches off;
- training yields as many batches per rank as timm's loader: its
  ``DistributedSampler`` pads the epoch to a multiple of the world size and each
  rank drops its incomplete last batch, so a rank has ``ceil(N / world) // batch``
  batches (:func:`train_last_batch`); evaluation reads every sample, the ranks' last
  batches filled by wrap-around as timm's distributed sampler fills them (timm's
  ``validate`` averages each batch's metric with equal weight, so its batches keep the filler);
- ``vflip``, ``grayscale_prob``, ``gaussian_blur_prob``, ``color_jitter_prob``,
  ``auto_augment``, ``num_aug_splits``/``num_aug_repeats``, ``re_count``/``re_split``,
  other crop modes and the scheduled-batch options are refused when set; so are
  ``create_dataset``'s ``load_bytes``, ``num_samples``, ``repeats``, an
  ``input_img_mode`` other than RGB and a reader's ``transform``/``input_key``/...;
- ``num_workers``, ``pin_memory``, ``distributed`` (the loader finds the rank
  itself) and the other worker settings are left to DALI; ``download``,
  ``batch_size`` and ``trust_remote_code`` of ``create_dataset`` do nothing for a
  folder dataset, in timm as here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from dali_pipes.dropin.common import (
    ConvertedSplit,
    collate_on_batches,
    device_name,
    note_ignored,
    refuse_unknown,
    refuse_unsupported,
)
from dali_pipes.dropin.timm_classes import Relabel, timm_class_to_idx
from dali_pipes.loading.config import RunOptions
from dali_pipes.loading.loader import DALILoader
from dali_pipes.sampling import check_int

logger = logging.getLogger(__name__)

__all__ = ["TimmLoader", "create_dataset", "create_loader", "train_last_batch"]

#: The manifest source kind of ``dali-pipes convert imagefolder`` (converters.sources.ImageFolderSource.kind): the
#: only datasets whose class numbering is timm's folder reader's to define.
_FOLDER_KIND = "imagefolder"
#: timm's names for the training and evaluation splits, tried in turn after the one asked for (its _search_split).
_TRAIN_SPLITS = ("train", "training")
_EVAL_SPLITS = ("val", "valid", "validation", "eval", "evaluation")

#: Arguments of timm's create_dataset the loader cannot honour, with the values that ask for nothing. The last five
#: are what timm hands on to its dataset and reader (``**kwargs``; train.py passes input_key and target_key).
_DATASET_UNSUPPORTED = {
    "load_bytes": (False, None),
    "num_samples": (None,),
    "repeats": (0, None),
    "input_img_mode": ("RGB",),
    "transform": (None,),
    "target_transform": (None,),
    "additional_features": (None,),
    "input_key": (None,),
    "target_key": (None,),
}

#: Arguments of timm's create_loader that are honoured (see the module docstring).
_HONOURED = (
    "no_aug",
    "re_prob",
    "re_mode",
    "scale",
    "ratio",
    "hflip",
    "color_jitter",
    "interpolation",
    "mean",
    "std",
    "crop_pct",
    "collate_fn",
    "fp16",
    "img_dtype",
    "device",
    "use_prefetcher",
)
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
#: A DataLoader's own settings: taken, and left to DALI (the batch_choice_*/schedule ones only act with
#: input_size_choices, which is refused).
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


class TimmLoader(DALILoader):
    """The :class:`~dali_pipes.DALILoader` :func:`create_loader` returns, with timm's ``DataLoader`` attributes.

    ``dataset`` is the dataset it was made from (timm's loader keeps the dataset it
    was given: its ``classes``/``class_to_idx`` are timm's); ``drop_last`` is timm's
    (true when training), whichever ``last_batch`` gives its batch count.
    """

    def __init__(self, dataset: ConvertedSplit, pipeline: Any, *, drop_last: bool, **options: Any) -> None:
        self._timm_dataset = dataset
        self._timm_drop_last = bool(drop_last)
        super().__init__(dataset.root, pipeline, **options)

    @property
    def dataset(self) -> ConvertedSplit:  # type: ignore[override]
        """The dataset :func:`create_dataset` returned, as ``DataLoader.dataset``."""
        return self._timm_dataset

    @property
    def drop_last(self) -> bool:
        """timm's ``drop_last``: training drops each rank's incomplete last batch."""
        return self._timm_drop_last


def create_dataset(
    name: str,
    root: str | os.PathLike | None = None,
    split: str = "validation",
    search_split: bool = True,
    class_map: Any = None,
    load_bytes: bool = False,
    is_training: bool = False,
    download: bool = False,
    batch_size: int = 1,
    num_samples: int | None = None,
    seed: int | None = 42,
    repeats: int = 0,
    input_img_mode: str = "RGB",
    trust_remote_code: bool = False,
    **kwargs: Any,
) -> ConvertedSplit:
    """timm's ``create_dataset`` for a folder dataset: ``root/split``, converted by ``dali-pipes convert``.

    ``name`` must be timm's folder dataset (``""``, ``"folder"`` or ``"imagefolder"``);
    ``split`` is looked up under ``root`` by timm's names for it (``validation``:
    also ``val``, ``valid``...) unless ``search_split`` is false, and ``root`` itself
    serves when no such folder is there. Class indices are timm's: for a dataset
    converted from an image folder, ``class_map``'s, else the natural order of the
    folder names (the stored labels are renumbered to them); for any other source, the
    stored labels as they are (its own numbering, which timm's folder order does not
    apply to), or, with ``class_map``, each stored label's class name looked up in it.
    ``seed`` is the loader's (train.py passes
    ``--seed``, the same on every rank). ``download``, ``batch_size`` and
    ``trust_remote_code`` act on timm's other dataset kinds, not on a folder.
    """
    del download, batch_size, trust_remote_code  # timm's folder datasets take them and do nothing with them
    if name not in ("", "folder", "imagefolder"):
        raise ValueError(f"create_dataset({name!r}): the DALI loader reads folder datasets converted by dali-pipes")
    refuse_unknown("create_dataset", kwargs, _DATASET_UNSUPPORTED, "timm 1.0's create_dataset for a folder dataset")
    given = dict(load_bytes=load_bytes, num_samples=num_samples, repeats=repeats, input_img_mode=input_img_mode)
    refuse_unsupported("create_dataset", {**given, **kwargs}, _DATASET_UNSUPPORTED)
    if root is None:
        raise ValueError("create_dataset: give root (timm's --data-dir), the folder of the converted splits")
    folder = _split_folder(Path(root), split) if search_split else Path(root)
    dataset = ConvertedSplit(
        folder,
        train=None,  # create_loader builds the spec from its own arguments
        val=None,
        is_training=is_training,
        hint="point --data-dir at the folder holding the converted train/ and validation/ (or val/) datasets",
        seed=0 if seed is None else seed,
    )
    if class_map and not dataset.classes:
        raise ValueError(
            f"create_dataset(class_map={class_map!r}): {folder} has no class names to map; leave class_map out"
        )
    if dataset.source_kind == _FOLDER_KIND or class_map:
        # timm's folder reader numbers an image folder's classes (natural order, or its class_map); elsewhere only
        # a class_map does, by each stored label's name (as timm's Hugging Face readers remap a class index).
        argument = f"create_dataset(class_map={class_map!r})" if class_map else "create_dataset"
        is_folder = dataset.source_kind == _FOLDER_KIND
        dataset.relabel(timm_class_to_idx(dataset.classes, class_map, folder), argument, all_named=is_folder)
    # Otherwise the labels are the source's own numbering (line i of its classes file is label i): kept as stored.
    return dataset


def create_loader(
    dataset: ConvertedSplit, input_size: Any, batch_size: int, is_training: bool = False, **options: Any
) -> TimmLoader:
    """timm's ``create_loader``: a :class:`~dali_pipes.DALILoader` over ``dataset`` with timm's augmentation.

    Takes timm's arguments by their names (see the module docstring for what each does);
    a name timm 1.0's ``create_loader`` does not have is a TypeError, as in timm.
    """
    from dali_pipes.loading.compat import BatchFormat
    from dali_pipes.loading.world import detect_world

    if not isinstance(dataset, ConvertedSplit):
        raise TypeError(
            f"create_loader: dataset must come from dali_pipes.dropin.timm_train.create_dataset, got {dataset!r}"
        )
    refuse_unknown("create_loader", options, (*_HONOURED, *_UNSUPPORTED, *_MACHINERY), "timm 1.0's create_loader")
    refuse_unsupported("create_loader", options, _UNSUPPORTED)
    note_ignored("create_loader", options, _MACHINERY)
    spec = _spec(input_size, is_training, options)
    # The world is needed to count timm's training batches; the loader is given the same one.
    world, _ = detect_world()
    last_batch = train_last_batch(len(dataset), batch_size, world.world_size) if is_training else "pad"
    transform = _mixer(options.get("collate_fn"))
    if dataset.label_map is not None:  # timm's class indices, before any mixing one-hots them
        in_range = dataset.source_kind == _FOLDER_KIND  # an image folder's labels number its class folders
        transform = Relabel(dataset.label_map, transform, dataset=dataset.root, check_range=not in_range)
    batch_format = BatchFormat(keys=("image", "label"), dtype=_dtype_name(options), transform=transform)
    return TimmLoader(
        dataset,
        spec,
        drop_last=bool(is_training),
        batch_size=batch_size,
        shuffle=bool(is_training),
        seed=dataset.seed,
        last_batch=last_batch,
        batch_format=batch_format,
        run=RunOptions(device=device_name(options.get("device")), rank=world.rank, world_size=world.world_size),
    )


def train_last_batch(num_samples: int, batch_size: int, world_size: int) -> str:
    """The ``last_batch`` policy that gives each rank timm's number of training batches for this epoch.

    timm's training loader is a ``DistributedSampler`` (padding the epoch by
    wrap-around to ``ceil(N / world) * world`` samples, ``ceil(N / world)`` a rank)
    under a ``DataLoader`` that drops each rank's incomplete last batch: a rank has
    ``ceil(N / world) // batch`` batches. The loader cuts global batches of
    ``batch * world``: with ``"drop"`` it has ``N // (batch * world)`` of them, and
    with ``"pad"`` one more, whose tail of ``T`` samples gives each rank
    ``ceil(T / world)``, padded by wrap-around as timm's sampler pads. timm's count
    is the second exactly when that tail is a whole batch a rank, else the first.
    """
    n = check_int("number of samples", num_samples, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    world_size = check_int("world_size", world_size, 1)
    tail = n % (batch_size * world_size)
    return "pad" if tail and -(-tail // world_size) == batch_size else "drop"


def _split_folder(root: Path, split: str) -> Path:
    """``root/split`` by timm's names for the split (timm's ``_search_split``); ``root`` when none is there."""
    name = split.split("[")[0]
    if name != split:  # e.g. "train[:10%]": a slice timm's folder datasets ignore as well
        logger.warning(
            "create_dataset(split=%r): folder datasets are read whole; the slice is ignored, as in timm", split
        )
    synonyms = _TRAIN_SPLITS if name in _TRAIN_SPLITS else _EVAL_SPLITS if name in _EVAL_SPLITS else ()
    for candidate in (name, *synonyms):
        if (root / candidate).exists():
            return root / candidate
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


def _dtype_name(options: dict[str, Any]) -> str | None:
    """``BatchFormat.dtype`` for timm's ``img_dtype``/``fp16`` (None: float32, the specs' own output).

    timm casts in its prefetcher: without ``use_prefetcher`` its images stay float32.
    """
    if not options.get("use_prefetcher", True):
        return None
    # timm's PrefetchLoader: the deprecated fp16 overrides img_dtype.
    dtype = "float16" if options.get("fp16") else options.get("img_dtype")
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
