"""Stream factories for the benchmark rows: this package's loader, the ``DataLoader`` baselines, raw reads.

Each is a context manager that yields an endless iterator of delivered image
counts (see :mod:`dali_pipes.bench.runner`) and shuts its pipeline or workers
down on exit. The DALI anchor lives in :mod:`~dali_pipes.bench.anchor` and the
decode ceiling in :mod:`~dali_pipes.bench.decode`.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from dali_pipes.bench.runner import Skipped, Target, cycle, delivered

#: Seconds a DataLoader row waits for one batch before it fails.
BATCH_TIMEOUT = 300.0


def require_cuda() -> None:
    """Raise :class:`Skipped` when there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise Skipped("no CUDA device here (torch.cuda.is_available() is False)")


def dali_in_flight(settings: Mapping[str, int]) -> int:
    """Batches a ``DALILoader`` holds ready ahead of its consumer: DALI's pipeline queue,
    the parallel source's own queue of the same depth, and the one being handed over."""
    return 2 * settings.get("prefetch", 2) + 1


@contextlib.contextmanager
def dali_loader_stream(
    dataset: str | os.PathLike,
    spec: Any,
    *,
    batch_size: int,
    device: str,
    target: Target,
    settings: Mapping[str, int] | None = None,
) -> Iterator[Iterator[int]]:
    """:class:`~dali_pipes.DALILoader` over the shards, shuffled, epoch after epoch."""
    from dali_pipes.loading.loader import DALILoader

    if device == "gpu":
        require_cuda()
    loader = DALILoader(
        dataset, spec, batch_size=batch_size, shuffle=True, seed=0, device=device, **dict(settings or {})
    )
    try:
        yield delivered(((batch["image"], *targets(batch)) for batch in cycle(loader)), target)
    finally:
        loader.close()


def targets(batch: Mapping[str, Any]) -> list[Any]:
    """What a training step reads besides the image: the label, or a segmentation batch's boxes and masks."""
    if "label" in batch:
        return [batch["label"]]
    return [value for name, value in batch.items() if name not in ("image", "is_pad")]


@contextlib.contextmanager
def dataloader_stream(dataset: Any, *, batch_size: int, num_workers: int, target: Target) -> Iterator[Iterator[int]]:
    """The baseline ``DataLoader`` (:func:`~dali_pipes.bench.baselines.pil_dataloader`) over ``dataset``."""
    from dali_pipes.bench.baselines import pil_dataloader

    # A worker that hangs (a library deadlocked by fork) becomes a failed row, not a stuck benchmark.
    loader = pil_dataloader(dataset, batch_size=batch_size, num_workers=num_workers, timeout=BATCH_TIMEOUT)
    batches = cycle(loader)
    try:
        yield delivered(batches, target)
    finally:
        batches.close()
        shutdown_workers(loader)


def shutdown_workers(loader: Any) -> None:
    """Stop a ``DataLoader``'s persistent workers now.

    They live as long as the loader's iterator; stopped here rather than when the
    garbage collector gets to it, so rows do not overlap.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


@contextlib.contextmanager
def store_read_stream(dataset: str | os.PathLike, *, batch_size: int) -> Iterator[Iterator[int]]:
    """Raw reads of the encoded images in shuffled order, one process: what the format itself costs."""
    from dali_pipes.stores import open_store

    store = open_store(dataset)
    if len(store) < batch_size:
        raise ValueError(f"{dataset}: {len(store)} samples is less than one batch of {batch_size}")

    def counts() -> Iterator[int]:
        order = list(range(len(store)))
        rng = random.Random(0)
        while True:
            rng.shuffle(order)
            for start in range(0, len(order) - batch_size + 1, batch_size):
                for index in order[start : start + batch_size]:
                    store.read(index, ("image",))  # the image alone, as the loader's source reads it
                yield batch_size

    try:
        yield counts()
    finally:
        store.close()


@contextlib.contextmanager
def file_read_stream(files: Sequence[tuple[Path, int]], *, batch_size: int) -> Iterator[Iterator[int]]:
    """Raw reads of the original image files in shuffled order, one process."""
    if not files:
        raise Skipped("no image files")
    if len(files) < batch_size:
        raise ValueError(f"{len(files)} image files is less than one batch of {batch_size}")

    def counts() -> Iterator[int]:
        order = [path for path, _ in files]
        rng = random.Random(0)
        while True:
            rng.shuffle(order)
            for start in range(0, len(order) - batch_size + 1, batch_size):
                for path in order[start : start + batch_size]:
                    Path(path).read_bytes()
                yield batch_size

    yield counts()
