"""The order a conversion writes its samples in: the source's, or a seeded permutation of it.

A class-ordered input (an image folder, a list file: :attr:`~converters.base.Source.class_ordered`) written in its
own order gives shards of one or two classes each, and a streamed window of a few shards then gives batches of a
few classes. So such an input is written shuffled by default: input sample ``i`` (in the source's order) becomes
output sample :class:`Permutation` ``(i)``, a pure function of the seed and the input's sample count, the same for
any worker count and on a resumed run.

The parent never holds the input: it walks it once more and appends each item, with its output position, to its
output shard's file in the job folder (:func:`spill_items`; a few thousand items buffered at most); each shard task
reads its own file (:class:`SpilledItems`) and writes those items in output order.
"""

from __future__ import annotations

import itertools
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from converters.base import ConversionError, Item, Source
from dali_pipes.dataset.sample_order import ORDER_KINDS, SOURCE_ORDER, SampleOrder

#: ``convert(order=...)``: ``auto`` shuffles a class-ordered source and keeps any other's order.
ORDER_CHOICES = ("auto", *ORDER_KINDS)
#: Items placed at once by :func:`spill_items` before they are appended to their shards' files.
SPILL_BUFFER = 4096


def choose_order(source: Source, order: str = "auto", seed: int = 0) -> SampleOrder:
    """The order ``source`` is written in: ``order`` (one of :data:`ORDER_CHOICES`), ``auto`` meaning shuffled
    for a class-ordered source (:attr:`Source.class_ordered`) and the source's order for any other."""
    if order not in ORDER_CHOICES:
        raise ConversionError(f"unknown --order {order!r}; choose one of {', '.join(ORDER_CHOICES)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConversionError(f"--order-seed must be a non-negative integer, got {seed!r}")
    if order == "shuffled" or (order == "auto" and source.class_ordered):
        return SampleOrder("shuffled", seed)
    return SOURCE_ORDER


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on ``uint64`` values (which wrap as the 64-bit arithmetic it is written for)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A seeded bijection of ``range(n)``: an alternating Feistel network over the smallest power of two covering
    ``n`` (each round XORs one half of the bits with a keyed hash of the other), walked until it lands inside
    ``range(n)`` (cycle walking: fewer than two steps on average).

    Integer arithmetic written here (no library's random stream, which may change between versions), so the order
    of a dataset depends on ``(seed, n)`` alone, for good; O(1) memory, whatever ``n``. Computed a batch at a
    time (:meth:`positions`): about a microsecond an item.
    """

    ROUNDS = 4  # pairs of rounds, one for each half

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation of {n} items")
        self.n = n
        bits = max(1, (n - 1).bit_length())
        self._low = np.uint64(bits // 2)
        self._low_mask = np.uint64((1 << (bits // 2)) - 1)
        self._high_mask = np.uint64((1 << (bits - bits // 2)) - 1)
        keys = _mix(np.arange(2 * self.ROUNDS, dtype=np.uint64) + np.uint64(seed * 2 * self.ROUNDS % 2**64))
        self._keys = keys.reshape(self.ROUNDS, 2)

    def __call__(self, index: int) -> int:
        """Where item ``index`` goes."""
        return int(self.positions([index])[0])

    def positions(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Where each of ``indices`` goes (``int64``)."""
        x = np.asarray(indices, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"an index outside range({self.n})")
        x = self._encrypt(x.astype(np.uint64))
        outside = x >= np.uint64(self.n)
        while outside.any():
            x[outside] = self._encrypt(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        high, low = x >> self._low, x & self._low_mask
        for low_key, high_key in self._keys:
            low = low ^ (_mix(high ^ low_key) & self._low_mask)
            high = high ^ (_mix(low ^ high_key) & self._high_mask)
        return (high << self._low) | low


def spill_items(
    items: Iterable[Item], permutation: Permutation, per_shard: int, shards: Iterable[int], folder: Path
) -> None:
    """Append each item, with its output position, to the file of the output shard it goes to (:func:`spill_path`),
    for the shards numbered in ``shards`` only (the others are written already); :data:`SPILL_BUFFER` at a time."""
    wanted = set(shards)
    numbered = enumerate(items)
    while chunk := list(itertools.islice(numbered, SPILL_BUFFER)):
        buffers: dict[int, list[tuple[int, Item]]] = {}
        for (_, item), position in zip(chunk, permutation.positions([index for index, _ in chunk]).tolist()):
            if position // per_shard in wanted:
                buffers.setdefault(position // per_shard, []).append((position, item))
        _flush(buffers, folder)


def _flush(buffers: dict[int, list[tuple[int, Item]]], folder: Path) -> None:
    for number, entries in buffers.items():
        with open(spill_path(folder, number), "ab") as file:
            pickle.dump(entries, file, protocol=pickle.HIGHEST_PROTOCOL)


def spill_path(folder: Path, number: int) -> Path:
    """The file holding the items of output shard ``number``."""
    return folder / f"shard-{number:05d}.items"


def fresh_folder(folder: Path) -> Path:
    """``folder``, emptied: a run that died while spilling left part of it, and the walk appends."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


@dataclass(frozen=True)
class SpilledItems:
    """The items of one output shard, read in its task from the file :func:`spill_items` wrote, in output order.

    The file is the job's own (in its job folder, written under the output's lock), so it is read with ``pickle``
    as a task's items are sent to it."""

    path: str
    count: int

    def __iter__(self) -> Iterator[Item]:
        entries: list[tuple[int, Item]] = []
        if os.path.exists(self.path):  # a missing file is a shard of no items, refused below: none is empty
            with open(self.path, "rb") as file:
                while True:
                    try:
                        entries.extend(pickle.load(file))
                    except EOFError:
                        break
        if len(entries) != self.count:
            raise ConversionError(
                f"{self.path}: {len(entries)} planned inputs where {self.count} were expected (the job folder was "
                "changed meanwhile); run the same command again"
            )
        entries.sort(key=lambda entry: entry[0])
        return (item for _, item in entries)
