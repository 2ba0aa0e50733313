"""The baseline a user has today: a ``torch.utils.data.DataLoader`` with PIL decoding and
numpy/PIL transforms, doing the same augmentation as :class:`~dali_pipes.pipelines.ClassificationTrain`.

The transforms follow torchvision's PIL code paths (``RandomResizedCrop`` with its
ten attempts and centre fallback, ``RandomHorizontalFlip``, ``ColorJitter`` in a
random order with the hue shift in HSV, ``ToTensor`` + ``Normalize``), written
with PIL and numpy because torchvision is not installable everywhere this runs.

The datasets take any :class:`TrainTransform` (encoded bytes -> CHW float tensor),
so the optional torchvision and Albumentations transforms of
:mod:`dali_pipes.bench.backends` run in the very same ``DataLoader``.
"""

from __future__ import annotations

import io
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from PIL import Image, ImageEnhance

from dali_pipes.pipelines.config import IMAGENET_MEAN, IMAGENET_STD
from dali_pipes.stores import Store, open_store


class TrainTransform(Protocol):
    """Encoded image bytes -> augmented, normalised CHW float32 tensor."""

    def from_bytes(self, data: bytes, rng: random.Random) -> torch.Tensor:
        """Decode ``data`` and augment it, drawing the random choices from ``rng`` where the backend allows."""
        ...


@dataclass(frozen=True)
class PilTrainTransform:
    """Random-resized crop, flip, colour jitter and normalise on a PIL image -> CHW float32 tensor."""

    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.1
    jitter: bool = True
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    @classmethod
    def from_spec(cls, spec: Any) -> "PilTrainTransform":
        """The same augmentation as a :class:`~dali_pipes.pipelines.ClassificationTrain` spec."""
        jitter = spec.jitter
        return cls(
            size=spec.size,
            scale=tuple(spec.scale),
            ratio=tuple(spec.ratio),
            flip=spec.flip,
            brightness=jitter.brightness if jitter else 0.0,
            contrast=jitter.contrast if jitter else 0.0,
            saturation=jitter.saturation if jitter else 0.0,
            hue=jitter.hue if jitter else 0.0,
            jitter=jitter is not None and not jitter.is_identity,
            mean=tuple(spec.mean),
            std=tuple(spec.std),
        )

    def from_bytes(self, data: bytes, rng: random.Random) -> torch.Tensor:
        """Decode with PIL and augment (see :class:`TrainTransform`)."""
        with Image.open(io.BytesIO(data)) as image:
            return self(image, rng)

    def __call__(self, image: Image.Image, rng: random.Random) -> torch.Tensor:
        image = image.convert("RGB")
        left, top, width, height = random_resized_crop_box(image.size, self.scale, self.ratio, rng)
        image = image.resize((self.size, self.size), Image.BILINEAR, box=(left, top, left + width, top + height))
        if rng.random() < self.flip:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        if self.jitter:
            image = self._jitter(image, rng)
        return to_normalized_tensor(image, self.mean, self.std)

    def _jitter(self, image: Image.Image, rng: random.Random) -> Image.Image:
        steps = [
            lambda im: ImageEnhance.Brightness(im).enhance(
                rng.uniform(max(0, 1 - self.brightness), 1 + self.brightness)
            ),
            lambda im: ImageEnhance.Contrast(im).enhance(rng.uniform(max(0, 1 - self.contrast), 1 + self.contrast)),
            lambda im: ImageEnhance.Color(im).enhance(rng.uniform(max(0, 1 - self.saturation), 1 + self.saturation)),
            lambda im: _shift_hue(im, rng.uniform(-self.hue, self.hue)),
        ]
        rng.shuffle(steps)  # torchvision applies the four in a random order
        for step in steps:
            image = step(image)
        return image


def to_normalized_tensor(
    image: Image.Image, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> torch.Tensor:
    """HWC uint8 PIL image -> CHW float32 tensor normalised with ``mean`` and ``std`` (0..1 scale, ImageNet's by default)."""
    array = np.asarray(image, dtype=np.float32) / 255.0
    array = (array - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


def random_resized_crop_box(
    size: tuple[int, int], scale: Sequence[float], ratio: Sequence[float], rng: random.Random
) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``: ten tries, then a centre crop."""
    width, height = size
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _shift_hue(image: Image.Image, factor: float) -> Image.Image:
    """torchvision's PIL ``adjust_hue``: rotate the H channel in HSV by ``factor`` of the circle."""
    h, s, v = image.convert("HSV").split()
    hue = np.asarray(h, dtype=np.uint8)
    with np.errstate(over="ignore"):
        hue = hue + np.uint8(int(factor * 255) % 256)
    return Image.merge("HSV", (Image.fromarray(hue, "L"), s, v)).convert("RGB")


class _AugmentedDataset(torch.utils.data.Dataset):
    """Shared by both baselines: decode, transform, return ``(image, label)``."""

    def __init__(self, transform: TrainTransform, seed: int) -> None:
        self.transform = transform
        self.seed = seed

    def _encoded(self, index: int) -> tuple[bytes, int]:
        raise NotImplementedError

    def __getitem__(self, index: int):
        data, label = self._encoded(index)
        # A per-sample generator keeps the augmentation reproducible whatever the worker count.
        rng = random.Random(self.seed * 1_000_003 + index)
        return self.transform.from_bytes(data, rng), label


class StoreImageDataset(_AugmentedDataset):
    """A map-style dataset over a converted store (the same shards as the DALI loader)."""

    def __init__(self, path: str | os.PathLike, transform: TrainTransform = PilTrainTransform(), seed: int = 0) -> None:
        super().__init__(transform, seed)
        self.store: Store = open_store(path)

    def __len__(self) -> int:
        return len(self.store)

    def _encoded(self, index: int) -> tuple[bytes, int]:
        sample = self.store[index]
        return sample["image"], int(sample.get("label", -1))


class FileImageDataset(_AugmentedDataset):
    """A map-style dataset over the original image files (what a training script reads today)."""

    def __init__(
        self, files: Sequence[tuple[Path, int]], transform: TrainTransform = PilTrainTransform(), seed: int = 0
    ) -> None:
        super().__init__(transform, seed)
        self.files = list(files)

    def __len__(self) -> int:
        return len(self.files)

    def _encoded(self, index: int) -> tuple[bytes, int]:
        path, label = self.files[index]
        return Path(path).read_bytes(), label


def imagefolder_files(root: str | os.PathLike) -> list[tuple[Path, int]]:
    """``(path, label)`` of every image under ``ROOT/CLASS/``, labels by sorted class name.

    Images are told by content, as the conversion tells them: other files (which the
    conversion leaves out and lists) are not read by the baselines either.
    """
    from converters.image_formats import HEAD_BYTES, image_format
    from converters.sources.imagefolder import ImageFolderSource

    def is_image(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                return image_format(f.read(HEAD_BYTES)) is not None
        except OSError:
            return False

    items = ImageFolderSource(root).items()
    return [(Path(item.name), int(item.data[1])) for item in items if is_image(Path(item.name))]


def pil_dataloader(
    dataset: torch.utils.data.Dataset, *, batch_size: int, num_workers: int, shuffle: bool = True, timeout: float = 0
) -> torch.utils.data.DataLoader:
    """The ``DataLoader`` configuration of a typical training script (persistent workers, pinned when CUDA is there).

    ``timeout``: seconds to wait for a worker's batch before raising (0: for ever, torch's default).
    """
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        drop_last=False,
        timeout=timeout if num_workers > 0 else 0,
    )
