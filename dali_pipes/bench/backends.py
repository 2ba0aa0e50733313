"""Optional augmentation backends for the ``DataLoader`` baselines: torchvision and Albumentations.

Each is imported only when its row runs; where it does not import, the row is
skipped with the reason (:class:`~dali_pipes.bench.runner.Skipped`). Both do
the augmentation of :class:`~dali_pipes.pipelines.ClassificationTrain` with the
backend's own operators, the way a training script written for that library
would: torchvision on PIL images, Albumentations on OpenCV-decoded arrays.
``pip install "dali-pipes[bench]"`` installs Albumentations (torchvision comes with
the CUDA build of torch the user installs).
"""

from __future__ import annotations

import importlib
import io
import os
import random
from typing import Any

import numpy as np
import torch

from dali_pipes.bench.runner import Skipped


def require(module: str, extra: str = "bench") -> Any:
    """Import ``module`` or raise :class:`Skipped` saying why and how to get it."""
    if module == "albumentations":
        # Albumentations looks for a newer release online on import; a benchmark must not.
        os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = (
            "install the torchvision build that matches your torch (none exists for this CPU build)"
            if module.startswith("torchvision")
            else f'pip install "dali-pipes[{extra}]"'
        )
        raise Skipped(f"{module} does not import ({exc}); {hint}") from None


class _LazyCompose:
    """A transform over a spec whose backend pipeline is built on first use in each process.

    Only the spec is pickled: a ``DataLoader`` worker (forked or spawned) builds
    its own backend objects, so nothing unpicklable crosses a process boundary.
    """

    module: str = ""

    def __init__(self, spec: Any) -> None:
        require(self.module)  # fail (skip the row) now, not in a worker
        self.spec = spec
        self._compose: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.spec = state["spec"]
        self._compose = None

    def _jitter(self) -> Any:
        jitter = self.spec.jitter
        return None if jitter is None or jitter.is_identity else jitter

    def compose(self) -> Any:
        if self._compose is None:
            self._compose = self._build()
        return self._compose

    def _build(self) -> Any:
        raise NotImplementedError


class TorchvisionTrainTransform(_LazyCompose):
    """torchvision's ``RandomResizedCrop``, ``RandomHorizontalFlip``, ``ColorJitter``, ``ToTensor``, ``Normalize`` on PIL."""

    module = "torchvision"

    def _build(self) -> Any:
        transforms = require("torchvision.transforms")
        spec = self.spec
        steps = [
            transforms.RandomResizedCrop(spec.size, scale=spec.scale, ratio=spec.ratio, antialias=spec.antialias),
            transforms.RandomHorizontalFlip(spec.flip),
        ]
        if (j := self._jitter()) is not None:
            steps.append(transforms.ColorJitter(j.brightness, j.contrast, j.saturation, j.hue))
        steps += [transforms.ToTensor(), transforms.Normalize(spec.mean, spec.std)]
        return transforms.Compose(steps)

    def from_bytes(self, data: bytes, rng: random.Random) -> torch.Tensor:
        """Decode with PIL and augment with torchvision (its own random state, not ``rng``)."""
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            return self.compose()(image.convert("RGB"))


class AlbumentationsTrainTransform(_LazyCompose):
    """Albumentations' ``RandomResizedCrop``, ``HorizontalFlip``, ``ColorJitter``, ``Normalize`` on OpenCV-decoded RGB."""

    module = "albumentations"

    def _build(self) -> Any:
        albumentations = require("albumentations")
        cv2 = require("cv2")
        # One OpenCV thread, set before OpenCV's first use in this process: the DataLoader
        # workers are the parallelism (OpenCV's pool would oversubscribe the cores), the
        # in-process row (num_workers=0) is then per-core like PIL, and no pool threads
        # exist when workers are forked (a worker forked while that pool runs can deadlock
        # in its first resize).
        cv2.setNumThreads(1)
        spec = self.spec
        steps = [
            albumentations.RandomResizedCrop(
                size=(spec.size, spec.size), scale=spec.scale, ratio=spec.ratio, interpolation=self.interpolation(cv2)
            ),
            albumentations.HorizontalFlip(p=spec.flip),
        ]
        if (j := self._jitter()) is not None:
            steps.append(albumentations.ColorJitter(j.brightness, j.contrast, j.saturation, j.hue, p=1.0))
        steps.append(albumentations.Normalize(mean=spec.mean, std=spec.std))
        return albumentations.Compose(steps)

    def interpolation(self, cv2: Any) -> int:
        """The OpenCV resize of the same quality as the spec's: ``INTER_AREA`` (antialiased when shrinking,
        bilinear when enlarging) for ``antialias=True``, else ``INTER_LINEAR`` (Albumentations' default)."""
        return cv2.INTER_AREA if self.spec.antialias else cv2.INTER_LINEAR

    def from_bytes(self, data: bytes, rng: random.Random) -> torch.Tensor:
        """Decode with OpenCV and augment with Albumentations (its own random state, not ``rng``)."""
        cv2 = require("cv2")
        compose = self.compose()
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if image is None:
            raise ValueError("OpenCV could not decode an image")
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
        out = compose(image=image)["image"]  # HWC float32, normalised
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1)))
