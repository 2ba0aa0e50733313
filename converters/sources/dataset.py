"""``dataset``: any map-style dataset (a PyTorch ``Dataset`` or anything with ``len`` and ``[i]``)."""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Iterator, Mapping, Sequence

import numpy as np

from converters.base import ConversionError, ImageOptions, Item, Sample, SampleError, StreamingSource
from converters.images import prepare_image
from dali_pipes.dataset.manifest import Field

log = logging.getLogger(__name__)

#: Fields given by name only: what each Python value becomes.
INFERRED = (
    "bytes: an image (checked); str: text; int: int64; float: float64; a numpy array or tensor: its dtype and shape"
)


class DatasetSource(StreamingSource):
    """The samples of a map-style dataset, ``dataset[0]`` to ``dataset[len(dataset) - 1]``, read in the workers.

    A sample is a tuple or list (its values in the order of ``fields``) or a dict
    (by field name). ``fields`` maps names to :class:`~dali_pipes.dataset.manifest.Field`,
    or only names them and each type follows from ``dataset[0]`` (:data:`INFERRED`).
    Encoded images (``bytes``, or a 1-D uint8 array, in an image field) are checked as every source's are.
    An exception from ``dataset[i]`` makes sample ``i`` a bad input.

    The dataset is pickled once into each worker process, as a ``DataLoader`` pickles it
    into its workers, so it must be picklable (its class importable) and give the
    same samples on every call; it should hold paths rather than loaded data.
    Re-running a job resumes it when the dataset's class, length and ``name`` are the same.
    """

    kind: ClassVar[str] = "dataset"

    def __init__(
        self,
        dataset: Any,
        fields: Mapping[str, Field] | Sequence[str],
        image_options: ImageOptions = ImageOptions(),
        *,
        classes: Sequence[str] | None = None,
        name: str | None = None,
    ) -> None:
        try:
            self.length = len(dataset)
        except TypeError:
            raise ConversionError(f"{type(dataset).__name__} has no len(): give a map-style dataset") from None
        if self.length < 1:
            raise ConversionError(f"{type(dataset).__name__} is empty: nothing to convert")
        self.dataset = dataset
        self.image_options = image_options
        self.name = name
        self._fields = dict(fields) if isinstance(fields, Mapping) else _infer_fields(list(fields), dataset)
        own = getattr(dataset, "classes", None)
        self._classes = list(classes) if classes is not None else _string_list(own)
        self._sample_size = _size(self._values(0, dataset[0]))

    def fields(self) -> dict[str, Field]:
        return dict(self._fields)

    def classes(self) -> list[str] | None:
        return self._classes

    def iter_items(self) -> Iterator[Item]:
        """One item per index; ``Item.size`` is the size of sample 0, for planning shard sizes."""
        return self.items_from(0)

    def items_from(self, anchor: int) -> Iterator[Item]:
        return (Item(name=f"sample {i}", size=self._sample_size, data=i, anchor=i) for i in range(anchor, self.length))

    def _values(self, index: int, raw: Any) -> dict[str, Any]:
        names = list(self._fields)
        if isinstance(raw, Mapping):
            missing = [n for n in names if n not in raw]
            if missing:
                raise SampleError(f"sample {index}", f"has no {missing} (keys: {sorted(raw)})")
            return {n: raw[n] for n in names}
        if isinstance(raw, (tuple, list)) and len(raw) == len(names):
            return dict(zip(names, raw))
        raise SampleError(f"sample {index}", f"is a {type(raw).__name__}, expected a tuple of {len(names)} ({names})")

    def load(self, item: Item) -> Sample:
        try:
            raw = self.dataset[item.data]
        except Exception as exc:  # noqa: BLE001 - whatever the dataset raises makes this sample a bad input
            raise SampleError(item.name, f"dataset[{item.data}] raised {type(exc).__name__}: {exc}") from None
        sample: Sample = {}
        for name, value in self._values(item.data, raw).items():
            field = self._fields[name]
            if field.is_image:
                sample[name] = prepare_image(_encoded_image(value, item.name, name), item.name, self.image_options)
            elif field.kind == "bytes":
                sample[name] = _text(value, item.name, name)
            else:
                sample[name] = np.asarray(value)
        return sample

    def describe(self) -> dict[str, Any]:
        cls = type(self.dataset)
        return {
            "kind": self.kind,
            "dataset": f"{cls.__module__}.{cls.__qualname__}",
            "length": self.length,
            "name": self.name,
            "fields": {name: field.to_json() for name, field in self._fields.items()},
            "image_options": self.image_options.to_json(),
        }


def _encoded_image(value: Any, where: str, name: str) -> bytes:
    """The encoded image bytes of an image field: bytes, or a 1-D uint8 array or tensor of them (as
    ``torchvision.io.read_file`` gives); pixels or other arrays are refused (they are an array field).
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, np.ndarray) or hasattr(value, "numpy"):
        array = np.asarray(value)
        if array.dtype == np.uint8 and array.ndim == 1:
            return array.tobytes()
        raise SampleError(
            where,
            f"field {name!r} is an image field (encoded image bytes) but holds a {array.dtype} array of shape "
            f"{array.shape}; declare it as Field.array({str(array.dtype)!r}, ...) to store the array",
        )
    raise SampleError(where, f"field {name!r} is an image field but holds a {type(value).__name__}, not bytes")


def _text(value: Any, where: str, name: str) -> bytes:
    """A text field's bytes: ``str`` as UTF-8, bytes-like as they are; anything else is refused."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise SampleError(where, f"field {name!r} is a text field but holds a {type(value).__name__}; give str or bytes")


def _infer_fields(names: list[str], dataset: Any) -> dict[str, Field]:
    """Each named field's type from the value ``dataset[0]`` gives it (:data:`INFERRED`)."""
    if not names:
        raise ConversionError("give the names of the dataset's fields (or a {name: Field} mapping)")
    first = dataset[0]
    values = [first.get(n) for n in names] if isinstance(first, Mapping) else first
    if not isinstance(values, (tuple, list)) or len(values) != len(names):
        raise ConversionError(f"dataset[0] is a {type(first).__name__}, expected {len(names)} values ({names})")
    fields = {}
    for name, value in zip(names, values):
        if isinstance(value, (bytes, bytearray, memoryview)):
            fields[name] = Field.image()
        elif isinstance(value, str):
            fields[name] = Field.text()
        elif isinstance(value, (bool, np.bool_)):
            fields[name] = Field.array("bool", ())
        elif isinstance(value, (int, np.integer)):
            fields[name] = Field.array("int64", ())
        elif isinstance(value, (float, np.floating)):
            fields[name] = Field.array(np.asarray(value).dtype, ())
        elif isinstance(value, np.ndarray) or hasattr(value, "numpy"):
            array = np.asarray(value)
            fields[name] = Field.array(array.dtype, array.shape)
        else:
            raise ConversionError(f"dataset[0] field {name!r} is a {type(value).__name__}; give its Field ({INFERRED})")
    return fields


def _string_list(value: Any) -> list[str] | None:
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _size(values: Mapping[str, Any]) -> int:
    """Bytes of one sample (encoded images and arrays), at least 1."""
    total = 0
    for value in values.values():
        total += len(value) if isinstance(value, (bytes, bytearray, str)) else np.asarray(value).nbytes
    return max(1, total)
