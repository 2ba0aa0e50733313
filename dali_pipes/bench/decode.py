"""Decode-only throughput of the dataset's own JPEGs on the same cores: the practical CPU ceiling.

``cores`` processes each hold the encoded bytes of the same sample of images in
memory (loaded before timing) and decode them with PIL, nothing else: no
reading, no augmentation, no batching. Two modes:

- ``full``: every pixel of every image, as a plain PIL ``DataLoader`` decodes it;
- ``reduced``: PIL's ``draft`` asks libjpeg for the smallest DCT scale (1/2,
  1/4, 1/8) at which the random-resized-crop window is still at least the output
  size, which is all a training crop needs. It shows how much a decoder that
  skips detail could gain on this data; on ImageNet-sized images most crops
  need full scale, so it is often close to ``full``.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import random
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Iterator

from dali_pipes.bench.runner import Skipped

#: Images each process keeps in memory (a cycle over them is timed).
SAMPLE = 256
#: Seconds a worker waits for the others to be ready before giving up.
_READY_TIMEOUT = 300

MODES = ("full", "reduced")

_images: list[bytes] = []
_crop: tuple[int, tuple[float, float], tuple[float, float]] | None = None


def _load(dataset: str, count: int, crop: tuple[int, tuple[float, float], tuple[float, float]], ready: Any) -> None:
    """Pool initializer: keep the encoded bytes of the first ``count`` images in this process."""
    global _crop
    from dali_pipes.stores import open_store

    store = open_store(dataset)
    _images[:] = [bytes(store[i]["image"]) for i in range(min(count, len(store)))]
    store.close()
    _crop = crop
    # Start decoding only when every process is ready, so that no process takes the
    # first tasks alone while the others are still starting (that would be warm-up).
    ready.wait(_READY_TIMEOUT)


def reduction(
    image_size: tuple[int, int], crop: tuple[int, tuple[float, float], tuple[float, float]], seed: int
) -> int:
    """The DCT scale divisor (1, 2, 4 or 8) a random-resized crop of an image of ``image_size`` allows."""
    from dali_pipes.bench.baselines import random_resized_crop_box

    size, scale, ratio = crop
    _, _, w, h = random_resized_crop_box(image_size, scale, ratio, random.Random(seed))
    factor = 1
    while factor < 8 and min(w, h) // (factor * 2) >= size:
        factor *= 2
    return factor


def _decode_chunk(task: tuple[int, int, str]) -> int:
    from PIL import Image

    start, chunk, mode = task
    for k in range(chunk):
        index = (start + k) % len(_images)
        with Image.open(io.BytesIO(_images[index])) as image:
            if mode == "reduced" and _crop is not None:
                factor = reduction(image.size, _crop, start + k)
                if factor > 1:
                    image.draft("RGB", (-(-image.size[0] // factor), -(-image.size[1] // factor)))
            image.load()
    return chunk


def reducible_fraction(dataset: str, spec: Any, count: int = SAMPLE) -> float:
    """The fraction of random-resized crops of the first ``count`` images that allow a reduced decode.

    Reads only the image headers. 0 on ImageNet-sized images (500x375 never has a
    crop of 448 px a side); it grows with the image size.
    """
    from PIL import Image

    from dali_pipes.stores import open_store

    crop = (int(spec.size), tuple(spec.scale), tuple(spec.ratio))
    store = open_store(dataset)
    try:
        n = min(count, len(store))
        reducible = 0
        for i in range(n):
            with Image.open(io.BytesIO(bytes(store[i]["image"]))) as image:
                reducible += reduction(image.size, crop, i) > 1
    finally:
        store.close()
    return reducible / n if n else 0.0


@contextlib.contextmanager
def decode_stream(dataset: str, *, mode: str, workers: int, chunk: int, spec: Any) -> Iterator[Iterator[int]]:
    """A stream of decoded-image counts, ``chunk`` images a step, from ``workers`` processes (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"decode mode must be one of {MODES}, got {mode!r}")
    from dali_pipes.stores import open_store

    store = open_store(dataset)
    try:
        if "image" not in store.fields or not store.fields["image"].is_image:
            raise Skipped(f"{dataset}: the dataset has no encoded 'image' field to decode")
        count = min(SAMPLE, len(store))
    finally:
        store.close()
    crop = (int(spec.size), tuple(spec.scale), tuple(spec.ratio))
    # spawn: a clean process per core, whatever threads (torch, DALI) this one runs.
    context = mp.get_context("spawn")
    ready = context.Barrier(workers)
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_load, initargs=(str(dataset), count, crop, ready)
    )

    def counts() -> Iterator[int]:
        # A bounded window of tasks in flight keeps every process busy without queueing forever.
        start = 0
        pending: deque = deque()
        while True:
            while len(pending) < 2 * workers:
                pending.append(pool.submit(_decode_chunk, (start, chunk, mode)))
                start += chunk
            yield pending.popleft().result()

    try:
        yield counts()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
