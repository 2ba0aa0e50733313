"""``DALILoader(..., data=DataOptions(cache="ram"))``: the shards a rank reads, held in shared memory within a budget.

The shards this rank will read are copied, before DALI's worker processes
start, into a private folder on a tmpfs (``/dev/shm``), and the loader's store
reads those copies instead of the originals. A tmpfs file lives in the page
cache once: the loader and every worker read (or, for LMDB, memory-map) the
same pages, whether the workers were forked or spawned, so the memory is paid
once per rank and not once per worker.

The budget (``cache_bytes``) is never exceeded: shards are taken in order, each
one that still fits, and the rest are read from where they are. The budget is
also capped by the free space of the tmpfs and by the memory the machine (or its
cgroup) has available, less a reserve, so that caching ends in a disk fallback and
never in an out-of-memory kill. The ranks of a node share its memory: the default
budget (half the available memory) is split between the node's ranks
(``LOCAL_WORLD_SIZE``, else the world size), and the room left is measured again
before each shard is copied, since the other ranks are filling it at the same
time; when a shard would not leave the reserve free, caching stops there. The folder is removed when the loader closes or the process
exits; one left by a process that was killed (its lock file is free) is removed
by the next cache made on the machine.

What is cached: with ``shuffle=True`` every rank reads from every shard, so all
shards are candidates; without shuffling, only the shards holding this rank's
samples. A merged HDF5 file made of virtual datasets is read from disk (its
sources are found relative to its own folder).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from dali_pipes.dataset.manifest import Manifest, human_bytes, resolve_inside
from dali_pipes.dataset.progress import bar_disabled, tqdm
from dali_pipes.sampling import EpochRules, rank_indices
from dali_pipes.staging.stage import StageError, StageItem, copy_checked
from dali_pipes.staging.tmpfs import TMPFS, OwnedFolder, writable_tmpfs
from dali_pipes.stores import Store, StoreError
from dali_pipes.stores.base import SampleDict

log = logging.getLogger(__name__)

#: The values :class:`~dali_pipes.DataOptions` ``.cache`` accepts.
CACHE_KINDS = (None, "ram")
#: Prefix of the cache folders in the tmpfs: ``dali-pipes-cache-<pid>-<random>``.
FOLDER_PREFIX = "dali-pipes-cache-"
#: The share of the available memory a cache may take when no ``cache_bytes`` is given.
DEFAULT_SHARE = 0.5
#: Memory always left free: this share of the room measured, and at least :data:`RESERVE_MIN` bytes.
RESERVE_SHARE = 0.1
RESERVE_MIN = 256 << 20


class CachedStore(Store):
    """A :class:`~dali_pipes.stores.Store` whose shards in ``copies`` are read from their cached copies.

    Messages name the dataset and its shard files, not the copies (the error
    they wrap, chained, names the copy); picklable like any store (the copies
    are files, which a worker process opens by path).
    """

    def __init__(self, root: str | os.PathLike, manifest: Manifest, copies: dict[int, Path]) -> None:
        super().__init__(root, manifest)
        self.copies = dict(copies)
        for number, path in self.copies.items():
            original = self._shards[number]
            self._shards[number] = type(original)(
                path,
                original.fields,
                original.num_samples,
                original.index_path,
                expected_bytes=original.expected_bytes,
                record_crc=original.record_crc,  # the copy's records are checked like the original's
            )

    def read(self, index: int, fields: Iterable[str] | None = None) -> SampleDict:
        """As :meth:`Store.read`; an error names the dataset's shard file, not its copy in the tmpfs."""
        try:
            return super().read(index, fields)
        except StoreError as exc:
            message = str(exc)
            for number, copy in self.copies.items():
                message = message.replace(str(copy), str(resolve_inside(self.root, self.manifest.shards[number].path)))
            raise StoreError(message) from exc


@dataclass
class RamCache:
    """The cache folder of one loader: which shards it holds, and the budget it kept to."""

    folder: Path
    budget: int
    room: int = 0  # memory and tmpfs space free when the budget was set
    copies: dict[int, Path] = field(default_factory=dict)
    bytes: int = 0
    on_disk: list[int] = field(default_factory=list)  # shards read from where they are
    owner: OwnedFolder | None = field(default=None, repr=False)  # removes the folder

    def close(self) -> None:
        """Remove the cached copies (readers that still have them open keep their pages until they close)."""
        if self.owner is not None:
            self.owner.close()


def cache_in_ram(
    store: Store,
    shards: Iterable[int],
    *,
    cache_bytes: int | None = None,
    progress: bool = True,
    sharers: int = 1,
) -> tuple[Store, RamCache]:
    """Copy ``shards`` of ``store`` into a tmpfs folder within the budget; return the store reading them.

    ``sharers`` is how many processes on this machine cache at the same time (the
    node's ranks): the default budget is split between them. ``store`` is closed
    and replaced by a :class:`CachedStore` (also when nothing fits).
    """
    if cache_bytes is not None and (isinstance(cache_bytes, bool) or int(cache_bytes) < 0):
        raise ValueError(f"cache_bytes must be a non-negative number of bytes, got {cache_bytes!r}")
    try:
        _check_tmpfs()
        owner = OwnedFolder(FOLDER_PREFIX)  # removes the folders of killed loaders first
    except BaseException:
        store.close()
        raise
    folder = owner.path
    room = _room(folder)
    cache = RamCache(folder, _budget(cache_bytes, room, max(1, sharers)), room, owner=owner)
    try:
        _fill(store, shards, cache, progress)
    except BaseException:  # a damaged shard: the caller gets the error, and no store or copy outlives it
        store.close()
        cache.close()
        raise
    root, manifest = store.root, store.manifest
    store.close()
    log.info(
        "cache in RAM: %d of %d shard(s), %s of a %s budget, in %s; %d shard(s) read from disk",
        len(cache.copies),
        len(manifest.shards),
        human_bytes(cache.bytes),
        human_bytes(cache.budget),
        folder,
        len(cache.on_disk),
    )
    return CachedStore(root, manifest, cache.copies), cache


def _fill(store: Store, shards: Iterable[int], cache: RamCache, progress: bool) -> None:
    """Copy the shards that fit the budget, in order, into ``cache``; record the others as read from disk."""
    manifest = store.manifest
    wanted = [n for n in sorted(set(shards)) if not _is_virtual_merge(store, n)]
    chosen, total = [], 0
    for number in wanted:
        size = manifest.shards[number].bytes
        if total + size <= cache.budget:
            chosen.append(number)
            total += size
    cache.on_disk = [n for n in range(len(manifest.shards)) if n not in chosen]
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="cache in RAM", disable=bar_disabled(progress and bool(chosen))
    ) as bar:
        for number in chosen:
            if not _copy_shard(store, number, cache, bar.update):
                cache.on_disk = sorted(set(cache.on_disk) | (set(chosen) - set(cache.copies)))
                break


def shards_for_rank(manifest: Manifest, indices: np.ndarray | None) -> list[int]:
    """The shard numbers holding ``indices`` (every shard for ``None``: a shuffled rank reads them all)."""
    if indices is None:
        return list(range(len(manifest.shards)))
    offsets = np.asarray(manifest.shard_offsets[1:], dtype=np.int64)
    return sorted(set(np.searchsorted(offsets, np.asarray(indices, dtype=np.int64), side="right").tolist()))


def _copy_shard(store: Store, number: int, cache: RamCache, advance) -> bool:
    """Copy one shard (hash-checked) into the cache; ``False`` when the tmpfs filled up (the rest stays on disk)."""
    shard = store.manifest.shards[number]
    source = resolve_inside(store.root, shard.path)
    target = cache.folder / f"{number:06d}-{source.name}"
    room = _room(cache.folder)  # again: the node's other ranks are caching too
    if shard.bytes > room - _reserve(room):
        log.warning(
            "cache in RAM: %s free is too little to cache %s (%s) and keep a reserve; the remaining shards are "
            "read from disk",
            human_bytes(room),
            shard.path,
            human_bytes(shard.bytes),
        )
        return False
    try:
        copy_checked(StageItem(shard.path, source, shard.bytes, shard.sha256 or None), target, advance)
    except StageError as exc:
        if not isinstance(exc.__cause__, OSError):
            raise  # a damaged source shard: the same error reading it would give
        log.warning("cache in RAM: %s; the remaining shards are read from disk", exc)
        return False
    cache.copies[number] = target
    cache.bytes += shard.bytes
    return True


def _is_virtual_merge(store: Store, number: int) -> bool:
    if store.manifest.format != "hdf5":
        return False
    from dali_pipes.stores.hdf5 import open_file

    with open_file(resolve_inside(store.root, store.manifest.shards[number].path)) as f:
        virtual = bool(f.attrs.get("virtual", False))
    if virtual:
        log.info("cache in RAM: %s is a virtual merge; read from its sources on disk", store.root)
    return virtual


def _budget(cache_bytes: int | None, room: int, sharers: int) -> int:
    """The bytes the cache may take: ``cache_bytes``, by default half the room split between ``sharers``.

    Never more than ``room`` (free memory and tmpfs space) less the reserve.
    """
    most = max(0, room - _reserve(room))
    if cache_bytes is None:
        return min(most, int(room * DEFAULT_SHARE / sharers))
    if cache_bytes > most:
        log.warning(
            "cache in RAM: cache_bytes=%s is more than the %s of memory free (less a reserve); caching at most %s",
            human_bytes(cache_bytes),
            human_bytes(room),
            human_bytes(most),
        )
        return most
    return int(cache_bytes)


def _room(folder: Path) -> int:
    """Bytes a cache in ``folder`` could take now: the tmpfs's free space or the available memory, the less."""
    return min(shutil.disk_usage(folder).free, available_memory())


def _reserve(room: int) -> int:
    """Memory a cache always leaves free, out of ``room``."""
    return max(RESERVE_MIN, int(room * RESERVE_SHARE))


def available_memory() -> int:
    """Bytes of memory this process may still use: ``MemAvailable``, or less if its cgroup's limit says so."""
    available = _meminfo_available()
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            available = min(available, max(0, int(limit) - usage))
        break
    return available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0  # unknown: cache nothing rather than risk the machine's memory


def _check_tmpfs() -> None:
    if writable_tmpfs() is None:
        raise ValueError(
            f"cache='ram' needs a writable tmpfs at {TMPFS}, which this machine lacks; "
            "leave cache unset (the OS page cache still keeps recently read shards in memory)"
        )


def cache_for_loader(store: Store, cache_bytes: int | None, rules: EpochRules) -> tuple[Store, RamCache]:
    """:func:`cache_in_ram` of the shards this rank of a loader reads (all of them when shuffling)."""
    world, indices = rules.world, None
    if not rules.shuffle:  # the same samples every epoch: only their shards
        indices, _ = rank_indices(
            len(store), rules.batch_size, world.rank, world.world_size, 0, rules.seed, shuffle=False,
            last_batch=rules.last_batch,
        )  # fmt: skip
    return cache_in_ram(
        store, shards_for_rank(store.manifest, indices), cache_bytes=cache_bytes, sharers=local_world_size(world)
    )


def local_world_size(world) -> int:
    """The ranks on this node: ``LOCAL_WORLD_SIZE`` (set by torchrun), else the whole world (the safe guess)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        local = 0
    return local if 1 <= local <= world.world_size else world.world_size
