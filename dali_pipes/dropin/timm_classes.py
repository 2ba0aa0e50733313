"""timm's class indices for a converted image folder, and the relabelling that gives them to the loader's labels.

When labels are renumbered (:func:`~dali_pipes.dropin.timm_train.create_dataset`
decides): only where timm's folder reader would define the numbering, that is

- a dataset converted from an image folder (the manifest's ``source["kind"]`` is
  ``"imagefolder"``): its class indices become timm's natural order of the folder
  names, or ``class_map``'s when one is given;
- any other dataset with class names (TFRecord, WebDataset, plain LMDB, Parquet
  with ``--classes``, a Hugging Face or Python dataset), only when ``class_map`` is
  given: stored label ``i`` is class ``classes[i]`` (its source's own numbering,
  "line i is class i"), and becomes that name's index in the map, as timm's
  Hugging Face readers map a stored class index through its name. Without a
  ``class_map`` its labels are the data's own numbering and stay exactly as stored
  (a checkpoint trained on them scores as it should), whatever order the names are in.

Why a relabelling for an image folder: ``dali-pipes convert imagefolder`` numbers the class folders
in plain sorted order (``'10' < '84' < '9'``, as torchvision's ``ImageFolder``),
and that is what the dataset's labels hold. timm's folder reader
(``timm.data.readers.reader_image_folder.find_images_and_targets``) sorts them
with its ``natural_key`` (``'9' < '10' < '84'``, case folded), or takes them
from its ``class_map`` (a ``.txt`` of one name a line, a ``.pkl`` or a dict of
name to index). The same images would then carry other indices than under
timm's own loader, and a checkpoint or class map moved between the two would be
wrong without a word. :func:`timm_class_to_idx` computes timm's mapping for the
dataset's class names; :class:`Relabel` maps each batch's labels through it, as a
``BatchFormat.transform`` ahead of the script's own (a mixer, say), so that
mixing sees timm's indices.

Names are looked up by name, so a name that repeats (ImageNet's human-readable
names have two ``'crane'`` and two ``'maillot'``) would give two classes one
index: wherever a name-to-index map is built (the natural order, a class map,
relabelling by name) repeated names are refused, naming them. And a stored label
with no class name (outside ``0..len(classes) - 1``, e.g. ImageNet TFRecords'
labels 1..1000 beside 1000 names) cannot be renumbered: :class:`Relabel` checks
each batch and raises naming the label and the dataset, rather than indexing out
of range (an IndexError, a device-side assert on a GPU, or a negative label
silently wrapping around).
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any, Callable, Mapping, Sequence

from dali_pipes.dataset.classes import unique_name_index

__all__ = ["Relabel", "load_class_map", "natural_key", "timm_class_to_idx"]


def natural_key(name: str) -> list[Any]:
    """timm's ``timm.utils.misc.natural_key``: digit runs compare as numbers, the rest case-folded."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name.lower())]


def timm_class_to_idx(classes: Sequence[str], class_map: Any = None, root: str | os.PathLike = "") -> dict[str, int]:
    """The ``class_to_idx`` timm's folder reader gives these class names: ``class_map``'s, else natural order.

    ``class_map`` as timm's ``create_dataset`` takes it (None or ``""``: none; a
    dict; a ``.txt``/``.pkl`` file, looked for as given, then under ``root``).
    Repeated names (in ``classes``, or a ``.txt`` map's lines) are refused, naming them.
    """
    if class_map:
        return load_class_map(class_map, root)
    unique_name_index(classes, f"timm's class order for {root or 'the dataset'}")
    # Names equal under natural_key (differing in case only) are tied in timm, which then keeps a set's order,
    # which changes from run to run; the plain name breaks the tie here, the same every time.
    ordered = sorted(classes, key=lambda name: (natural_key(name), name))
    return {name: index for index, name in enumerate(ordered)}


class _NoGlobals(pickle.Unpickler):
    """timm's restricted unpickler for ``.pkl`` class maps: a dict of built-in types never needs a global."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global {module}.{name} is not permitted in a class map file")


def load_class_map(class_map: Any, root: str | os.PathLike = "") -> dict[str, int]:
    """timm's ``load_class_map``: a dict as it is, a ``.txt`` (line ``i`` is class ``i``) or a ``.pkl`` dict.

    A file is looked for as given, then under ``root`` (the split's folder, as timm
    looks under its image folder). ValueError naming ``class_map`` when it cannot be read,
    and naming the names when one repeats (two lines of a ``.txt``, where timm silently
    keeps the last; or two keys of one text, such as ``1`` and ``'1'``): blank lines may repeat.
    """
    if isinstance(class_map, Mapping):
        if not class_map:
            raise ValueError("create_dataset(class_map={}): give the classes' indices, or leave class_map out")
        unique_name_index(class_map, f"create_dataset(class_map={class_map!r})", what="key")
        return {str(name): int(index) for name, index in class_map.items()}
    path = os.fspath(class_map)
    if not os.path.exists(path):
        path = os.path.join(root, path)
    if not os.path.exists(path):
        raise ValueError(f"create_dataset(class_map={class_map!r}): no such file, as given nor under {root}")
    extension = os.path.splitext(path)[1].lower()
    if extension == ".txt":
        with open(path, encoding="utf-8") as lines:
            # As timm: every line counts, a blank one too, so that line i stays class i.
            names = [line.strip() for line in lines]
        return unique_name_index(names, f"create_dataset(class_map={class_map!r})", what="line", first=1, blank_ok=True)
    if extension == ".pkl":
        with open(path, "rb") as file:
            loaded = _NoGlobals(file).load()
        if not isinstance(loaded, dict):
            raise ValueError(f"create_dataset(class_map={class_map!r}): the pickle holds no dict of class indices")
        return load_class_map(loaded)
    raise ValueError(f"create_dataset(class_map={class_map!r}): timm reads a .txt or .pkl class map, or a dict")


class Relabel:
    """A ``BatchFormat.transform``: each label ``i`` becomes ``label_map[i]``, then ``then`` (if any) gets the batch.

    A label outside ``0..len(label_map) - 1`` has no class to map to: each batch's
    smallest and largest labels are checked (one small reduction and copy per batch,
    on the labels' device) and such a label raises ValueError naming it and
    ``dataset``, instead of an IndexError, a device-side assert on a GPU, or a
    negative label silently wrapping around to the table's end.

    ``check_range=False`` leaves the check out where every label is known to be in range.

    ``mixup_enabled`` is ``then``'s (timm's ``Mixup``), so that ``loader.mixup_enabled = False``
    still switches the mixing; without a ``then`` that has it, reading it raises AttributeError,
    as on a transform that does not mix.
    """

    def __init__(
        self,
        label_map: Sequence[int],
        then: Callable[..., Any] | None = None,
        dataset: Any = "the dataset",
        check_range: bool = True,
    ) -> None:
        self.label_map = tuple(int(index) for index in label_map)
        # The check copies each batch's label range to the host (a wait on the GPU): skipped where the labels
        # are in range by construction (an image folder's labels are its class folders' numbers).
        self.check_range = bool(check_range)
        self.then = then
        self.dataset = dataset
        self._tables: dict[Any, Any] = {}  # the lookup table on each device it was used on

    def __call__(self, image: Any, label: Any) -> Any:
        import torch

        if self.check_range:
            self._check_range(label)
        table = self._tables.get(label.device)
        if table is None:
            table = self._tables[label.device] = torch.tensor(self.label_map, dtype=torch.int64, device=label.device)
        label = table[label.long()].to(label.dtype)
        return (image, label) if self.then is None else self.then(image, label)

    def _check_range(self, label: Any) -> None:
        """ValueError naming a label that has no entry in ``label_map`` (checked before any indexing)."""
        import torch

        if label.numel() == 0:
            return
        low, high = torch.stack(torch.aminmax(label.long())).tolist()  # one copy to the host a batch
        if 0 <= low and high < len(self.label_map):
            return
        bad = low if low < 0 else high
        raise ValueError(
            f"{self.dataset}: a sample has label {bad}, but the dataset names {len(self.label_map)} classes "
            f"(labels 0..{len(self.label_map) - 1}), so it has no class to renumber to timm's index. The class "
            "names given to 'dali-pipes convert' (--classes: line i names label i) do not cover the stored "
            "labels: convert with a classes file that names every label (or, for a dataset not converted from an "
            "image folder, leave class_map out: its labels are then read as stored)"
        )

    @property
    def mixup_enabled(self) -> bool:
        """``then``'s ``mixup_enabled``; AttributeError when it has none."""
        if not hasattr(self.then, "mixup_enabled"):
            raise AttributeError("mixup_enabled")
        return self.then.mixup_enabled

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        if not hasattr(self.then, "mixup_enabled"):
            raise AttributeError("mixup_enabled: this transform does not mix")
        self.then.mixup_enabled = value
