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

import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from converters.base import ConversionError, Item, Source
from dali_pipes.dataset.sample_order import ORDER_KINDS, SOURCE_ORDER, SampleOrder

#: ``convert(order=...)``: ``auto`` shuffles a class-ordered source and keeps any other's order.
ORDER_CHOICES = ("auto", *ORDER_KINDS)
_MASK64 = (1 << 64) - 1
#: Items buffered by :func:`spill_items` before they are appended to their shards' files.
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


def _mix(x: int) -> int:
    """SplitMix64's finaliser: 64 bits in, 64 well-mixed bits out."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Permutation:
    """A seeded bijection of ``range(n)``: a balanced Feistel network over the smallest power of four covering
    ``n``, walked until it lands inside ``range(n)`` (cycle walking: at most four steps on average).

    Pure integer arithmetic written here (no library's random stream, which may change between versions), so the
    order of a dataset depends on ``(seed, n)`` alone, for good; O(1) memory, whatever ``n``.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation of {n} items")
        self.n = n
        self._half = (max(1, (n - 1).bit_length()) + 1) // 2
        self._mask = (1 << self._half) - 1
        self._keys = [_mix((seed * self.ROUNDS + r) & _MASK64) for r in range(self.ROUNDS)]

    def __call__(self, index: int) -> int:
        """Where item ``index`` goes."""
        if not 0 <= index < self.n:
            raise IndexError(f"{index} is outside range({self.n})")
        x = self._encrypt(index)
        while x >= self.n:
            x = self._encrypt(x)
        return x

    def _encrypt(self, x: int) -> int:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right


def spill_items(
    items: Iterable[Item], permutation: Permutation, per_shard: int, shards: Iterable[int], folder: Path
) -> int:
    """Append each item, with its output position, to the file of the output shard it goes to (:func:`spill_path`),
    for the shards numbered in ``shards`` only (the others are written already); returns the items walked."""
    wanted = set(shards)
    buffers: dict[int, list[tuple[int, Item]]] = {}
    buffered = walked = 0
    for index, item in enumerate(items):
        walked = index + 1
        position = permutation(index)
        number = position // per_shard
        if number not in wanted:
            continue
        buffers.setdefault(number, []).append((position, item))
        buffered += 1
        if buffered >= SPILL_BUFFER:
            _flush(buffers, folder)
            buffered = 0
    _flush(buffers, folder)
    return walked


def _flush(buffers: dict[int, list[tuple[int, Item]]], folder: Path) -> None:
    for number, entries in buffers.items():
        with open(spill_path(folder, number), "ab") as file:
            pickle.dump(entries, file, protocol=pickle.HIGHEST_PROTOCOL)
    buffers.clear()


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
    """The items of one output shard, read in its task from the file :func:`spill_items` wrote, in output order."""

    path: str
    count: int

    def __iter__(self) -> Iterator[Item]:
        entries: list[tuple[int, Item]] = []
        if os.path.exists(self.path):  # a shard whose items all went elsewhere cannot be: each holds one at least
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
