"""The ``DataLoader``-shaped surface of :class:`~dali_pipes.DALILoader`, for training scripts written for one.

Scripts such as torchvision's reference ``train.py`` and timm's ``train.py`` unpack
``(image, target)`` tuples, call ``loader.sampler.set_epoch(epoch)``, read
``len(loader.dataset)``, ``loader.dataset.classes``, ``loader.batch_size`` and
``loader.drop_last``. The loader answers all of these:

- :class:`BatchFormat` (``DALILoader(..., batch_format=...)``) says what a batch is:
  the loader's dict (the default), or a tuple of named outputs as a ``DataLoader``
  yields, and whether the last batch keeps its padding rows;
- ``loader.dataset`` is a :class:`LoaderDataset` (``len()``: the samples in the
  dataset; ``classes``, ``class_to_idx``);
- ``loader.sampler`` is an :class:`EpochSampler` whose ``set_epoch`` is the loader's.

Why padding is kept unless asked: with ``last_batch="pad"`` every rank yields the
same number of full batches, the tail filled by wrap-around, as
``DistributedSampler`` fills it; training steps then never see a batch of one row
(which ``BatchNorm`` refuses). An evaluation loop wants each sample exactly once:
``drop_padding=True`` drops the filler rows of the last batch, so the ranks'
counts add up to ``len(loader.dataset)`` exactly. Every rank still yields the same
number of batches (the metrics' ``all_reduce`` of each step needs every rank), and
none is empty: accuracy functions divide by a batch's rows (torchvision's
``utils.accuracy`` raises ZeroDivisionError, timm's gives NaN). The rank split deals
the last step's samples out evenly (:mod:`dali_pipes.sampling.rules`), so only a last
step with fewer samples than ranks leaves a rank nothing real; that case cannot be
exact, in step and non-empty at once, so :meth:`BatchFormat.check_steps` refuses it
when the loader is made, naming batch sizes that work. Only the last batch of a pass
can hold padding, so only it is looked at: no GPU synchronisation on the others.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from dali_pipes.stores import Store

__all__ = ["BatchFormat", "DataLoaderSurface", "EpochSampler", "LoaderDataset"]


@dataclass(frozen=True)
class BatchFormat:
    """What each batch of a :class:`~dali_pipes.DALILoader` is.

    ``keys``: yield a tuple of these outputs, in this order (``("image", "label")``
    as a ``DataLoader`` over an image folder yields); ``None`` (default): the dict
    of every output, ``is_pad`` included (and ``index`` with ``with_index``). ``drop_padding``: leave out the last
    batch's wrap-around filler rows, for evaluation that counts each sample once
    (see the module docstring for why it is off by default).
    """

    keys: tuple[str, ...] | None = None
    drop_padding: bool = False
    #: Add the global sample ``index`` (``int64``) to each batch's outputs; with ``keys``, name ``"index"`` there to
    #: get it in the tuple.
    with_index: bool = False
    #: The ``image`` output cast to this torch dtype (``"bfloat16"``, ``"float16"``...), as timm's prefetcher casts
    #: to the model's dtype; on the output's device.
    dtype: str | None = None
    #: The ``image`` output as NCHW in ``torch.channels_last`` memory format, as ``--channels-last`` models take it.
    #: From a spec with ``layout="NHWC"`` this is a view, no copy; from NCHW, one copy.
    channels_last: bool = False
    #: Applied to each batch last, as a script's ``collate_fn`` applies it: called with the tuple's items
    #: (``transform(image, label)``, as torchvision's ``v2.MixUp``/``v2.CutMix`` and timm's ``Mixup`` take them),
    #: or with the dict when ``keys`` is None; what it returns is the batch.
    transform: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.keys is not None:
            if isinstance(self.keys, str) or not all(isinstance(k, str) for k in self.keys) or not self.keys:
                raise TypeError(
                    f"BatchFormat.keys must be a tuple of output names such as ('image', 'label'), got {self.keys!r}"
                )
            object.__setattr__(self, "keys", tuple(self.keys))
        if self.dtype is not None:
            import torch

            if not isinstance(getattr(torch, str(self.dtype), None), torch.dtype):
                raise ValueError(f"BatchFormat.dtype must name a torch dtype such as 'bfloat16', got {self.dtype!r}")
        if self.transform is not None:
            _check_transform(self.transform)

    def apply(self, batch: Mapping[str, Any], *, last: bool, layout: str = "NCHW") -> Any:
        """``batch`` (the loader's dict) in this format.

        ``last``: the pass's last batch, the only one with padding; ``layout``: the
        spec's layout of the ``image`` output (``"NCHW"`` or ``"NHWC"``).
        """
        if self.drop_padding and last:
            keep = ~batch["is_pad"]
            batch = {name: value[keep.to(value.device)] for name, value in batch.items()}
        if (self.dtype is not None or self.channels_last) and "image" in batch:
            batch = {**batch, "image": self._image(batch["image"], layout)}
        if self.keys is None:
            return batch if self.transform is None else self.transform(batch)
        missing = [key for key in self.keys if key not in batch]
        if missing:
            raise KeyError(
                f"BatchFormat.keys names {', '.join(map(repr, missing))}, which the pipeline does not output; "
                f"its outputs are {', '.join(map(repr, batch))}"
            )
        out = tuple(batch[key] for key in self.keys)
        return out if self.transform is None else self.transform(*out)

    def check_steps(self, num_samples: int, batch_size: int, world_size: int, last_batch: str, start: int = 0) -> None:
        """Refuse ``drop_padding`` where some rank's last batch would be empty (its only rows padding).

        ``num_samples``: the epoch's samples over all ranks, ``start`` those already
        consumed (a resumed pass); see the module docstring for why it is refused.
        """
        from dali_pipes.sampling import padding_only_ranks

        empty = padding_only_ranks(num_samples, batch_size, world_size, last_batch, start) if self.drop_padding else ()
        if not empty:
            return
        rest, tail = num_samples - start, (num_samples - start) % (batch_size * world_size)
        fits = _batch_sizes_without_empty_ranks(rest, batch_size, world_size)
        choose = (
            f"use batch_size={' or '.join(map(str, fits))}, for which every rank's last batch keeps a sample"
            if fits
            else f"evaluate on at most {rest} ranks"
        )
        raise ValueError(
            f"BatchFormat(drop_padding=True): {rest} samples in batches of {batch_size} on {world_size} ranks leave "
            f"{tail} for the last step, so rank(s) {', '.join(map(str, empty))} would get an empty last batch "
            "(accuracy functions divide by its rows, and every rank must take as many steps); "
            f"{choose}, or keep the padding (drop_padding=False, the dict format) and count only the rows where "
            "batch['is_pad'] is False"
        )

    def check_spec(self, spec: Any) -> None:
        """Refuse a mixing ``transform`` on a spec that mixes in its graph: the transform would get soft targets."""
        if self.transform is not None and getattr(spec, "mix", None) is not None and _is_mixer(self.transform):
            raise ValueError(
                f"{type(spec).__name__} mixes in the graph (mix={spec.mix!r}) and BatchFormat.transform "
                f"({type(self.transform).__name__}) would mix its soft targets again: mix in one place"
            )

    def _image(self, image: Any, layout: str) -> Any:
        import torch

        if self.channels_last:
            if layout == "NHWC":
                image = image.permute(0, 3, 1, 2)  # NHWC bytes are NCHW in channels_last format: a view
            else:
                image = image.contiguous(memory_format=torch.channels_last)
        if self.dtype is not None:
            image = image.to(getattr(torch, self.dtype))  # keeps the memory format
        return image


def _batch_sizes_without_empty_ranks(samples: int, batch_size: int, world_size: int) -> list[int]:
    """The batch sizes nearest ``batch_size`` (one below, one above) for which no rank's last batch is all padding."""
    from dali_pipes.sampling import padding_only_ranks

    def fits(b: int) -> bool:
        return not padding_only_ranks(samples, b, world_size)

    if samples < world_size:
        return []  # fewer samples than ranks: no batch size gives every rank one
    below = next((b for b in range(batch_size - 1, 0, -1) if fits(b)), None)
    # b >= samples puts all of them in one step of at least world_size samples: the search always ends.
    above = next(b for b in range(batch_size + 1, samples + 2) if fits(b))
    return [b for b in (below, above) if b is not None]


#: Class names of torchvision's mixing transforms: ``v2.MixUp``/``v2.CutMix``, and the references' own
#: ``RandomMixUp``/``RandomCutMix`` (``RandomMixup``/``RandomCutmix`` in older releases).
_MIXER_NAMES = frozenset(("mixup", "cutmix", "randommixup", "randomcutmix"))


def _is_mixer(transform: Any) -> bool:
    """Whether ``transform`` mixes samples: timm's ``Mixup`` (``mixup_enabled``), torchvision's ``MixUp``/``CutMix``,
    or a ``RandomChoice``/``Compose`` holding one (what torchvision's reference ``get_mixup_cutmix`` returns)."""
    if hasattr(transform, "mixup_enabled") or type(transform).__name__.lower() in _MIXER_NAMES:
        return True
    inner = getattr(transform, "transforms", None)
    return isinstance(inner, (list, tuple)) and any(_is_mixer(t) for t in inner)


def _check_transform(transform: Any) -> None:
    if not callable(transform):
        raise TypeError(f"BatchFormat.transform must be callable, such as timm's Mixup(...), got {transform!r}")
    refuse_fast_collate_mixup(
        transform,
        "BatchFormat.transform",
        "pass timm.data.Mixup with the same arguments instead (it mixes a batch; timm's train.py makes one with "
        "--no-prefetcher), or mix in the graph with ClassificationTrain(mix=Mix(...))",
    )


def refuse_fast_collate_mixup(mixer: Any, given: str, instead: str) -> None:
    """ValueError naming ``given`` and what to use ``instead`` where ``mixer`` is timm's ``FastCollateMixup``.

    It mixes a list of uint8 samples inside a ``collate_fn``, and the loader hands out whole batches, so it
    cannot run on them; timm's ``Mixup`` (its parent class) mixes a batch with the same settings.
    """
    if type(mixer).__name__ == "FastCollateMixup":
        raise ValueError(
            f"{given}: timm's FastCollateMixup mixes a list of uint8 samples inside a collate_fn, and the loader "
            f"hands out whole batches: {instead}"
        )


class LoaderDataset:
    """``loader.dataset``: what scripts read from a ``DataLoader``'s dataset, for the dataset a loader reads.

    ``len()`` is the number of samples in the dataset (all ranks together), as
    ``len(DataLoader.dataset)`` is; ``classes`` and ``class_to_idx`` come from the
    manifest (an image folder's class names; empty for a dataset without them).
    Samples are read inside DALI, not through this object: ``open_store(path)[i]``
    reads one. The drop-ins' dataset (:class:`~dali_pipes.dropin.common.ConvertedSplit`)
    is one too, made from a dataset folder before its loader.
    """

    def __init__(self, store: "Store") -> None:
        self._describe(store.root, store.manifest.classes, len(store))

    def _describe(self, root: Any, classes: Any, num_samples: int) -> None:
        """Set what the dataset answers: its ``root``, its ``classes`` (a manifest's, or None) and its length."""
        self.root = root
        self.classes: list[str] = list(classes or ())
        self._class_to_idx: dict[str, int] | None = None  # None: each name's position in classes (built when read)
        self._num_samples = int(num_samples)

    @property
    def class_to_idx(self) -> dict[str, int]:
        """``{class name: label}``; ValueError naming them where two classes share a name (a dict would merge them)."""
        if self._class_to_idx is None:
            from dali_pipes.dataset.classes import unique_name_index

            self._class_to_idx = unique_name_index(self.classes, f"{self.root}: its classes")
        return self._class_to_idx

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, index: int) -> Any:
        raise TypeError(
            f"{self.root}: a DALILoader's dataset is read inside DALI, not by index; "
            "dali_pipes.open_store(path)[i] reads sample i"
        )

    def __repr__(self) -> str:
        return f"LoaderDataset({str(self.root)!r}, samples={len(self)}, classes={len(self.classes)})"


class EpochSampler:
    """``loader.sampler``: ``set_epoch`` as on a ``DistributedSampler``, and ``len()``, this rank's samples per epoch.

    Holds its loader weakly: a loader dropped by its user is freed at once.
    """

    def __init__(self, loader: Any) -> None:
        self._loader = weakref.ref(loader)

    def _get(self) -> Any:
        loader = self._loader()
        if loader is None:
            raise RuntimeError("the DALILoader of this sampler no longer exists")
        return loader

    def set_epoch(self, epoch: int) -> None:
        """The loader's :meth:`~dali_pipes.DALILoader.set_epoch`: the next pass covers ``epoch``."""
        self._get().set_epoch(epoch)

    def __len__(self) -> int:
        return self._get().samples_per_epoch


class DataLoaderSurface:
    """The attributes of a ``DataLoader`` that training scripts read, for :class:`~dali_pipes.DALILoader`.

    Needs ``store``, ``batch_size``, ``last_batch``, ``world``, ``batch_format``, ``pipeline`` and
    ``set_epoch`` of the class it is mixed into.
    """

    store: "Store"
    batch_size: int
    last_batch: str
    world: Any
    batch_format: BatchFormat
    pipeline: Any

    @property
    def dataset(self) -> LoaderDataset:
        """The dataset as a ``DataLoader``'s: ``len()`` its samples, ``classes`` and ``class_to_idx``."""
        return LoaderDataset(self.store)

    @property
    def sampler(self) -> EpochSampler:
        """``sampler.set_epoch(epoch)`` as on a ``DistributedSampler``: the loader's ``set_epoch``."""
        return EpochSampler(self)

    @property
    def batch_sampler(self) -> None:
        """None, as on a ``DataLoader`` without a ``BatchSampler``: the loader forms its batches itself, and scripts
        that look here first for ``set_epoch`` (timm's ``train.py``) go on to :attr:`sampler`."""
        return None

    @property
    def drop_last(self) -> bool:
        """Whether the incomplete last global batch is dropped (``last_batch="drop"``)."""
        return self.last_batch == "drop"

    @property
    def mixup_enabled(self) -> bool:
        """Whether batches are mixed: the ``mixup_enabled`` of a ``BatchFormat.transform`` that has one
        (timm's ``Mixup``), else whether the spec mixes in the graph.

        Set it as timm's ``train.py`` does at ``--mixup-off-epoch``: it switches the
        transform. A spec's in-graph ``Mix`` cannot be switched mid-run: that is refused, saying what to use.
        """
        mixer = self.batch_format.transform
        if mixer is not None and hasattr(mixer, "mixup_enabled"):
            return bool(mixer.mixup_enabled)
        return getattr(self.pipeline, "mix", None) is not None

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        mixer = self.batch_format.transform
        if mixer is not None and hasattr(mixer, "mixup_enabled"):
            mixer.mixup_enabled = bool(value)
            return
        if bool(value) != self.mixup_enabled:
            raise ValueError(
                f"mixup_enabled={bool(value)}: this loader's mixing cannot be switched "
                f"({'the spec mixes in its graph' if self.mixup_enabled else 'nothing mixes'}); to switch it mid-run, "
                "mix with BatchFormat(transform=timm.data.Mixup(...)) instead of the spec's Mix"
            )

    @property
    def epoch_length(self) -> int:
        """Samples in an epoch over all ranks: the dataset's, or a weighted draw's ``num_samples``."""
        sampling = getattr(self, "sampling", None)
        return len(self.store) if sampling is None else sampling.epoch_length(len(self.store))

    @property
    def samples_per_epoch(self) -> int:
        """The samples this rank reads in a whole epoch, padding included (``len(DistributedSampler)``)."""
        from dali_pipes.sampling import samples_per_rank

        return samples_per_rank(self.epoch_length, self.batch_size, self.world.world_size, self.last_batch, 0)
