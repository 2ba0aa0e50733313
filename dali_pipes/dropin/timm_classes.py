"""timm's class indices for a converted image folder, and the relabelling that gives them to the loader's labels.

Why a relabelling: ``dali-pipes convert imagefolder`` numbers the class folders
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
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Relabel", "load_class_map", "natural_key", "timm_class_to_idx"]


def natural_key(name: str) -> list[Any]:
    """timm's ``timm.utils.misc.natural_key``: digit runs compare as numbers, the rest case-folded."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name.lower())]


def timm_class_to_idx(classes: Sequence[str], class_map: Any = None, root: str | os.PathLike = "") -> dict[str, int]:
    """The ``class_to_idx`` timm's folder reader gives these class names: ``class_map``'s, else natural order.

    ``class_map`` as timm's ``create_dataset`` takes it (None or ``""``: none; a
    dict; a ``.txt``/``.pkl`` file, looked for as given, then under ``root``).
    """
    if class_map:
        return load_class_map(class_map, root)
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
    looks under its image folder). ValueError naming ``class_map`` when it cannot be read.
    """
    if isinstance(class_map, Mapping):
        if not class_map:
            raise ValueError("create_dataset(class_map={}): give the classes' indices, or leave class_map out")
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
            return {line.strip(): index for index, line in enumerate(lines)}
    if extension == ".pkl":
        with open(path, "rb") as file:
            loaded = _NoGlobals(file).load()
        if not isinstance(loaded, dict):
            raise ValueError(f"create_dataset(class_map={class_map!r}): the pickle holds no dict of class indices")
        return load_class_map(loaded)
    raise ValueError(f"create_dataset(class_map={class_map!r}): timm reads a .txt or .pkl class map, or a dict")


class Relabel:
    """A ``BatchFormat.transform``: each label ``i`` becomes ``label_map[i]``, then ``then`` (if any) gets the batch.

    ``mixup_enabled`` is ``then``'s (timm's ``Mixup``), so that ``loader.mixup_enabled = False``
    still switches the mixing; without a ``then`` that has it, reading it raises AttributeError,
    as on a transform that does not mix.
    """

    def __init__(self, label_map: Sequence[int], then: Callable[..., Any] | None = None) -> None:
        self.label_map = tuple(int(index) for index in label_map)
        self.then = then
        self._tables: dict[Any, Any] = {}  # the lookup table on each device it was used on

    def __call__(self, image: Any, label: Any) -> Any:
        import torch

        table = self._tables.get(label.device)
        if table is None:
            table = self._tables[label.device] = torch.tensor(self.label_map, dtype=torch.int64, device=label.device)
        label = table[label.long()].to(label.dtype)
        return (image, label) if self.then is None else self.then(image, label)

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
