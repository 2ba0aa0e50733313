"""Conversion from Python: write any map-style dataset into shards with one manifest.

``from_dataset`` is to a PyTorch ``Dataset`` what ``dali-pipes convert`` is to
files on disk: the same parallel, resumable, byte-identical run (see
:func:`converters.runner.convert`), its samples read by ``dataset[i]`` in worker
processes, as FFCV's ``DatasetWriter`` does.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from converters.base import ImageOptions
from converters.runner import ConvertResult, convert
from converters.sources.dataset import DatasetSource
from dali_pipes.dataset.manifest import Field

__all__ = ["Field", "from_dataset"]


def from_dataset(
    dataset: Any,
    out: str | os.PathLike,
    *,
    fields: Mapping[str, Field] | Sequence[str],
    format: str = "lmdb",
    classes: Sequence[str] | None = None,
    name: str | None = None,
    max_size: int | None = None,
    quality: int = 90,
    **options: Any,
) -> ConvertResult:
    """Convert ``dataset`` (``len`` and ``dataset[i]``) into the dataset folder ``out`` of ``format`` shards.

    ``dataset[i]`` returns a tuple of values in the order of ``fields``, or a dict
    by field name: encoded image bytes, text, numbers or numpy arrays. ``fields``
    maps names to :class:`Field` (``Field.image()``, ``Field.array("int64", ())``,
    ...) or only names them, their types following from ``dataset[0]``.
    ``classes`` are the class names (default: ``dataset.classes`` when it is a list
    of strings); ``name`` tells apart two datasets of one class and length, so that
    re-running the same call resumes it and a different one is refused.
    ``max_size``/``quality`` resize large images as ``convert --max-size`` does.
    ``options`` go to :func:`converters.runner.convert` (``workers``,
    ``samples_per_shard``, ``shard_size``, ``on_error``, ``progress``, ``engine``, ...).
    ``dataset[i]`` is sample ``i`` unless ``order="shuffled"`` (seeded by ``order_seed``, default 0): for a dataset
    ordered class by class (torchvision's ``ImageFolder``), so that each shard holds many classes.

    Example::

        from dali_pipes.convert import Field, from_dataset
        from_dataset(my_dataset, "data/train", fields={"image": Field.image(), "label": Field.array("int64", ())})
    """
    source = DatasetSource(
        dataset, fields, ImageOptions(max_size=max_size, quality=quality), classes=classes, name=name
    )
    return convert(source, out, format=format, **options)
