"""The torchvision GPU row: batched nvJPEG decoding and ``transforms.v2`` on the GPU, without DALI.

What a PyTorch user who wants GPU augmentation writes without DALI: a
``DataLoader`` hands out the encoded bytes (reading is cheap, so its workers only
read), the training process decodes the whole batch on the GPU in one call
(``torchvision.io.decode_jpeg`` on a list, nvJPEG underneath), applies
``transforms.v2`` image by image (each image its own random crop, flip and
jitter, as the spec asks) and normalises the batch. JPEG only, as
``decode_jpeg``; other formats fail the row, saying so.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

from dali_pipes.bench.backends import require
from dali_pipes.bench.runner import Target, cycle, delivered, require_cuda
from dali_pipes.bench.streams import BATCH_TIMEOUT, shutdown_workers
from dali_pipes.stores import open_store


class EncodedDataset(torch.utils.data.Dataset):
    """``(encoded bytes as a uint8 tensor, label)`` of every sample of a converted store."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.store = open_store(path)

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        sample = self.store.read(index, ("image", "label"))
        return torch.frombuffer(bytearray(sample["image"]), dtype=torch.uint8), int(sample.get("label", -1))


def collate_encoded(batch: list[tuple[torch.Tensor, int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Keep the encoded images a list (their lengths differ); stack the labels."""
    return [data for data, _ in batch], torch.tensor([label for _, label in batch], dtype=torch.int64)


def per_image_transform(spec: Any) -> Any:
    """The spec's random-resized crop, flip and colour jitter as ``transforms.v2`` (one image at a time)."""
    v2 = require("torchvision.transforms.v2")
    steps = [
        v2.RandomResizedCrop(spec.size, scale=spec.scale, ratio=spec.ratio, antialias=spec.antialias),
        v2.RandomHorizontalFlip(spec.flip),
    ]
    jitter = spec.jitter
    if jitter is not None and not jitter.is_identity:
        steps.append(v2.ColorJitter(jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue))
    return v2.Compose(steps)


@contextlib.contextmanager
def torchvision_gpu_stream(
    dataset: str | os.PathLike, spec: Any, *, batch_size: int, num_workers: int, target: Target
) -> Iterator[Iterator[int]]:
    """A stream of delivered image counts: bytes from a ``DataLoader``, decoded and augmented on ``target``'s GPU."""
    require_cuda()
    io = require("torchvision.io")
    transform = per_image_transform(spec)
    device = torch.device(target.device)
    mean = torch.tensor(spec.mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, device=device).view(1, 3, 1, 1)
    dtype = getattr(torch, spec.dtype if spec.dtype != "uint8" else "float32")
    loader = torch.utils.data.DataLoader(
        EncodedDataset(dataset),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        collate_fn=collate_encoded,
        persistent_workers=num_workers > 0,
        timeout=BATCH_TIMEOUT if num_workers > 0 else 0,
    )

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for encoded, labels in cycle(loader):
            decoded = io.decode_jpeg(encoded, mode=io.ImageReadMode.RGB, device=device)
            images = torch.stack([transform(image) for image in decoded])
            yield ((images.float() / 255 - mean) / std).to(dtype), labels

    stream = batches()
    try:
        yield delivered(stream, target)
    finally:
        stream.close()
        shutdown_workers(loader)
