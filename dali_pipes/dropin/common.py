"""What the drop-ins share: a converted split as a script's dataset, the sampler a script holds, collate on batches.

Why a pending sampler: torchvision's reference script gets ``train_sampler`` from
``load_data`` and calls ``train_sampler.set_epoch(epoch)`` on it, before and apart
from its loader; :class:`PendingSampler` is that object, and the loader made from
its dataset binds it, so that its ``set_epoch`` is the loader's.

Why a ``collate_fn`` on whole batches: scripts mix (MixUp/CutMix) in their
``collate_fn``, which a ``DataLoader`` calls on a list of samples. The loader
hands out batches, so :func:`collate_on_batches` cuts each batch into its
samples and calls the script's ``collate_fn`` on them, exactly as a
``DataLoader`` would (one re-stacking copy of the batch, on its device); the
identity ``default_collate`` is skipped. timm's ``FastCollateMixup`` mixes uint8
samples before normalisation and cannot take ours: :mod:`~dali_pipes.dropin.timm_train`
hands its settings to timm's ``Mixup`` instead.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Iterable, Mapping

from dali_pipes.dataset.classes import unique_name_index
from dali_pipes.dataset.manifest import ManifestError
from dali_pipes.loading.compat import LoaderDataset, refuse_fast_collate_mixup
from dali_pipes.remote.dataset import load_manifest

logger = logging.getLogger(__name__)

__all__ = [
    "ConvertedSplit",
    "PendingSampler",
    "collate_on_batches",
    "device_name",
    "refuse_unknown",
    "refuse_unsupported",
]


class ConvertedSplit(LoaderDataset):
    """A dataset converted by ``dali-pipes convert``, as a script's dataset object.

    ``len()``, ``classes``, ``class_to_idx`` and ``root`` as an ``ImageFolder``
    has them (or in a script's own class order, through :meth:`relabel`):
    ``classes[i]`` is the name of stored label ``i``, as the manifest lists them.
    ``class_to_idx`` is refused (ValueError naming them) when two classes share a
    name (ImageNet's human-readable names repeat ``'crane'`` and ``'maillot'``): no
    name-to-index dict can hold both, and one silently dropped would give two classes
    one index. ``source_kind`` is the manifest's ``source["kind"]`` (``"imagefolder"``,
    ``"webdataset"``, ...; None when it records none): it says who numbered the labels.
    ``train``/``val`` are the specs its loader will use (from the script's flags;
    None where the loader's maker builds it), ``is_training`` says which; ``seed``
    the loader's (the same on every rank). Samples are read by the loader, inside
    DALI, not by indexing this object.
    """

    def __init__(
        self, root: str | os.PathLike, *, train: Any, val: Any, is_training: bool, hint: str, seed: int = 0
    ) -> None:
        try:
            manifest = load_manifest(root)
        except ManifestError as exc:
            # Without an index.json the long reason says nothing the advice below does not.
            reason = "no index.json" if not os.path.exists(os.path.join(root, "index.json")) else str(exc)
            raise ManifestError(
                f"{root} is not a dataset converted by dali-pipes ({reason}). Convert the image folder first, "
                f"e.g. 'dali-pipes convert imagefolder IMAGES/train SHARDS/train', and {hint}"
            ) from None
        self._describe(root, manifest.classes, manifest.num_samples)
        self.train, self.val, self.is_training, self.seed = train, val, bool(is_training), int(seed)
        source = manifest.source if isinstance(manifest.source, Mapping) else {}
        self.source_kind: str | None = source.get("kind")
        #: The index each stored label becomes (None: the stored labels as they are); see :meth:`relabel`.
        self.label_map: tuple[int, ...] | None = None

    def relabel(self, class_to_idx: Mapping[str, int], argument: str, *, all_named: bool = True) -> None:
        """Give the classes the indices of ``class_to_idx`` (a script's class order); the loader maps its labels.

        The stored labels number the classes as the manifest lists them; ``label_map``
        becomes the permutation (or injection, for a class map with more classes) from
        those to ``class_to_idx``'s, None when they agree. ``classes`` lists the names by
        their new index. A class of the dataset missing from ``class_to_idx`` is refused
        naming ``argument``: its samples would need leaving out, which the loader cannot;
        so are classes sharing a name (ValueError naming them): mapped by name, they
        would share one index. ``all_named``: every stored label is known to have a name
        (an image folder's labels are its folders'); otherwise ``label_map`` is kept even
        where it changes nothing, so that the loader checks that each label has one.
        """
        unique_name_index(self.classes, f"{argument}: the classes of {self.root}")
        missing = [name for name in self.classes if name not in class_to_idx]
        if missing:
            shown = ", ".join(map(repr, missing[:5])) + (", ..." if len(missing) > 5 else "")
            raise ValueError(
                f"{argument}: {len(missing)} class(es) of {self.root} are not in it ({shown}); their images would "
                "have to be left out, which the DALI loader cannot do: add them to the class map, or convert only "
                "the classes it lists"
            )
        label_map = tuple(int(class_to_idx[name]) for name in self.classes)
        self.label_map = None if all_named and label_map == tuple(range(len(self.classes))) else label_map
        self._class_to_idx = {str(name): int(index) for name, index in class_to_idx.items()}
        self.classes = sorted(self._class_to_idx, key=self._class_to_idx.__getitem__)

    @property
    def spec(self) -> Any:
        """The spec this split is read with: the training one, or the evaluation one."""
        return self.train if self.is_training else self.val

    def __repr__(self) -> str:
        return f"ConvertedSplit({str(self.root)!r}, samples={len(self)}, training={self.is_training})"


class PendingSampler:
    """The sampler a script gets with its dataset; the loader made from that dataset binds it.

    ``set_epoch`` is the loader's (kept until the loader exists); ``len()`` this
    rank's samples per epoch once it does. ``shuffle``: whether the loader shuffles.
    """

    def __init__(self, *, shuffle: bool) -> None:
        self.shuffle = bool(shuffle)
        self._loader: Callable[[], Any] | None = None
        self._epoch: int | None = None

    def bind(self, loader: Any) -> None:
        """Make ``set_epoch`` the loader's (held weakly); an epoch set before applies now."""
        self._loader = weakref.ref(loader)
        if self._epoch is not None:
            loader.set_epoch(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler.set_epoch``: the next pass of the loader covers ``epoch``."""
        loader = self._loader() if self._loader is not None else None
        if loader is None:
            self._epoch = int(epoch)
        else:
            loader.set_epoch(epoch)

    def __len__(self) -> int:
        loader = self._loader() if self._loader is not None else None
        if loader is None:
            raise TypeError("this sampler has no length until a loader is made from its dataset")
        return loader.samples_per_epoch


def collate_on_batches(collate_fn: Callable[[list], Any] | None) -> Callable[..., Any] | None:
    """A script's ``collate_fn`` as a ``BatchFormat.transform`` (see the module docstring); None for none."""
    from torch.utils.data import default_collate

    if collate_fn is None or collate_fn is default_collate:
        return None
    refuse_fast_collate_mixup(
        collate_fn,
        "collate_fn=FastCollateMixup(...)",
        "use dali_pipes.dropin.timm_train.create_loader, which mixes with timm's Mixup and the same settings",
    )

    def transform(*outputs: Any) -> Any:
        # The batch as the list of (image, label, ...) samples a DataLoader would hand its collate_fn.
        return collate_fn(list(zip(*(output.unbind(0) for output in outputs))))

    transform.collate_fn = collate_fn  # type: ignore[attr-defined]
    return transform


def refuse_unsupported(function: str, given: Mapping[str, Any], accepted: Mapping[str, Iterable[Any]]) -> None:
    """ValueError naming the first argument of ``given`` whose value the loader cannot honour.

    ``accepted`` maps an argument to the values that ask for nothing (its defaults):
    any other value is refused, so that no option is silently dropped.
    """
    for name, ok in accepted.items():
        if name in given and given[name] not in tuple(ok):
            raise ValueError(
                f"{function}({name}={given[name]!r}): DALILoader has no equivalent; "
                f"leave it at {tuple(ok)[0]!r} or use the script's own loader for this run"
            )


def refuse_unknown(function: str, given: Iterable[str], known: Iterable[str], where: str) -> None:
    """TypeError naming the arguments of ``given`` that ``known`` lacks, as Python's own for a misspelt keyword.

    ``where`` says whose signature ``known`` is (``"timm 1.0's create_loader"``): a
    ``**kwargs`` must not swallow a name the script's real function would refuse, or
    one this function never looks at.
    """
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(
            f"{function}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: {where} takes no "
            "such argument; check the spelling against its signature, or leave it out"
        )


def note_ignored(function: str, given: Mapping[str, Any], machinery: Iterable[str]) -> None:
    """Log once which of a ``DataLoader``'s own settings were given and left to DALI."""
    names = sorted(name for name in machinery if name in given)
    if names:
        logger.info("%s: %s are the DataLoader's own settings; DALI chooses its threads and buffers", function, names)


def device_name(device: Any) -> str:
    """``"gpu"``, ``"cpu"`` or ``"auto"`` for a script's torch device (or its name, or None)."""
    if device is None:
        return "auto"
    kind = getattr(device, "type", str(device).split(":")[0])
    return "gpu" if kind == "cuda" else "cpu"
