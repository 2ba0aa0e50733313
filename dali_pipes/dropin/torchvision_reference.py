"""``load_data`` and ``DataLoader`` for torchvision's ``references/classification/train.py``.

The change in the script is four lines (and ``--data-path`` names the folder
holding the converted ``train/`` and ``val/`` datasets)::

    +from dali_pipes.dropin.torchvision_reference import DataLoader, load_data as dali_load_data
    ...
    -    dataset, dataset_test, train_sampler, test_sampler = load_data(train_dir, val_dir, args)
    +    dataset, dataset_test, train_sampler, test_sampler = dali_load_data(train_dir, val_dir, args)
    ...
    -    data_loader = torch.utils.data.DataLoader(
    +    data_loader = DataLoader(
    ...
    -    data_loader_test = torch.utils.data.DataLoader(
    +    data_loader_test = DataLoader(

The flags map onto
:func:`~dali_pipes.pipelines.presets.torchvision_reference`'s specs
(``--train-crop-size``, ``--val-resize-size``, ``--val-crop-size``,
``--interpolation``, ``--auto-augment ra|ta_wide``, ``--random-erase``); the
``collate_fn`` the script makes for ``--mixup-alpha``/``--cutmix-alpha`` runs on
each batch's samples (:func:`~dali_pipes.dropin.common.collate_on_batches`);
``train_sampler.set_epoch`` is the loader's. ``--ra-sampler``, AugMix and the
AutoAugment policies, a non-default ``--ra-magnitude`` and the weights'
own preprocessing (``--weights`` with ``--test-only``) are refused by name.
"""

from __future__ import annotations

from typing import Any, Callable

from dali_pipes.dropin.common import ConvertedSplit, PendingSampler, collate_on_batches, note_ignored

__all__ = ["DataLoader", "load_data"]

#: torch's DataLoader arguments about its own workers and memory: taken, and left to DALI.
_MACHINERY = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)
_HINT = "point --data-path at the folder holding the converted train/ and val/ datasets"


def load_data(traindir: str, valdir: str, args: Any) -> tuple[ConvertedSplit, ConvertedSplit, Any, Any]:
    """``(dataset, dataset_test, train_sampler, test_sampler)`` as the reference script's ``load_data`` returns them."""
    from dali_pipes.pipelines.presets import torchvision_reference

    for flag, value, default in (
        ("--ra-sampler", getattr(args, "ra_sampler", False), False),
        ("--ra-magnitude", getattr(args, "ra_magnitude", 9), 9),
    ):
        if value != default:
            raise ValueError(f"{flag} {value}: the DALI loader has no equivalent; run without it")
    if getattr(args, "weights", None) and getattr(args, "test_only", False):
        raise ValueError(
            "--weights with --test-only evaluates with the weights' own preprocessing: pass its sizes and "
            "interpolation as --val-resize-size, --val-crop-size and --interpolation instead"
        )
    train, val = torchvision_reference(
        train_crop_size=args.train_crop_size,
        val_resize_size=args.val_resize_size,
        val_crop_size=args.val_crop_size,
        interpolation=str(getattr(args, "interpolation", "bilinear")),
        auto_augment=getattr(args, "auto_augment", None),
        random_erase=getattr(args, "random_erase", 0.0),
    )
    dataset = ConvertedSplit(traindir, train=train, val=val, is_training=True, hint=_HINT)
    dataset_test = ConvertedSplit(valdir, train=train, val=val, is_training=False, hint=_HINT)
    return dataset, dataset_test, PendingSampler(shuffle=True), PendingSampler(shuffle=False)


def DataLoader(  # noqa: N802 - named as the class it stands in for
    dataset: ConvertedSplit,
    batch_size: int = 1,
    shuffle: bool | None = None,
    sampler: PendingSampler | None = None,
    collate_fn: Callable[[list], Any] | None = None,
    drop_last: bool = False,
    **options: Any,
) -> Any:
    """A :class:`~dali_pipes.DALILoader` where the script makes a ``torch.utils.data.DataLoader``.

    ``dataset`` and ``sampler`` come from :func:`load_data`; a training split is
    read with its training spec and shuffled (or as ``shuffle``/the sampler say), an
    evaluation split in order; under DDP the ranks' last batches are filled by
    wrap-around, as ``DistributedSampler`` fills them (one process: no filler). ``num_workers``,
    ``pin_memory`` and the other worker settings are left to DALI; a
    ``batch_sampler`` or a sampler of another kind is refused.
    """
    from dali_pipes.loading.compat import BatchFormat
    from dali_pipes.loading.loader import DALILoader

    if not isinstance(dataset, ConvertedSplit):
        raise TypeError(f"DataLoader: dataset must come from dali_pipes' load_data, got {dataset!r}")
    if options.get("batch_sampler") is not None or (sampler is not None and not isinstance(sampler, PendingSampler)):
        raise ValueError("DataLoader: the loader draws its own epochs; pass the sampler load_data returned, or none")
    unknown = sorted(set(options) - set(_MACHINERY) - {"batch_sampler"})
    if unknown:
        raise TypeError(f"DataLoader got unexpected keyword argument(s) {unknown}")
    if sampler is not None and shuffle:
        raise ValueError("DataLoader: sampler option is mutually exclusive with shuffle (as in torch)")
    note_ignored("DataLoader", options, _MACHINERY)
    if sampler is not None:
        shuffle = sampler.shuffle
    loader = DALILoader(
        dataset.root,
        dataset.spec,
        batch_size=batch_size,
        shuffle=dataset.is_training if shuffle is None else bool(shuffle),
        last_batch="drop" if drop_last else "pad",
        batch_format=BatchFormat(keys=("image", "label"), transform=collate_on_batches(collate_fn)),
    )
    if sampler is not None:
        sampler.bind(loader)
    return loader
