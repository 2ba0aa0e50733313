"""Who may pin what in a streaming cache folder, and what a refusal says.

The shards pinned on a node never need more than the cache's limit, so that every download of a pinned
shard finds room. Several holders share that room: the ranks of a job, and also a training and an
evaluation loader that one thread reads in turn, the jobs of a sweep, a loader re-made after ``close()``.
Each may size its pins up to its whole share, so together they may ask for more than the limit. Pins are
therefore of two kinds:

- *needed* (:meth:`~dali_pipes.staging.stream_cache.ShardCache.pin`): the window being read, a guarded
  read. Counted; never taken away.
- *ahead* (:meth:`~dali_pipes.staging.stream_cache.ShardCache.set_ahead`): shards fetched ahead of the
  window. Taken only from room no other pin uses, and given up (the shard merely unpinned, perhaps evicted
  later) when a needed pin of any holder of the node would not fit otherwise: the furthest ahead first,
  never one being downloaded. Its streamer asks for it again (and downloads it, if it was evicted) when
  its window reaches it.

A needed pin is refused only when the needed pins (and the downloads under way) alone pass the limit.
Pure functions over the node's :class:`~dali_pipes.staging.cache_folder.CacheState` (no I/O): the
:class:`~dali_pipes.staging.stream_cache.ShardCache` calls them under the folder's lock, and decides
whether to wait (for other processes' windows to move on) or to refuse at once (when only holders of its
own process stand in the way: they cannot move while it waits).
"""

from __future__ import annotations

import os
from itertools import zip_longest
from pathlib import Path
from typing import Iterable, Mapping

from dali_pipes.dataset.manifest import human_bytes
from dali_pipes.staging.cache_folder import CacheState


def _bytes(keys: Iterable[str], sizes: Mapping[str, int]) -> int:
    return sum(sizes.get(key, 0) for key in keys)


def pin_needed(state: CacheState, holder: str, keys: list[str], sizes: Mapping[str, int], limit: int) -> int:
    """Pin ``keys`` for ``holder`` to read them, giving up ahead pins as needed; the bytes the needed pins
    and the downloads under way take with them when that is more than ``limit`` (nothing pinned then), else 0."""
    floor = state.needed() | set(keys) | (state.pinned() & set(state.reserved))
    if _bytes(floor, sizes) > limit:
        return _bytes(floor, sizes)
    excess = _bytes(state.pinned() | set(keys), sizes) - limit
    if excess > 0:
        _give_up_ahead(state, excess, floor, sizes)
    mine = state.pins.setdefault(holder, {})
    for key in keys:
        mine[key] = mine.get(key, 0) + 1
    return 0


def _give_up_ahead(state: CacheState, excess: int, kept: set[str], sizes: Mapping[str, int]) -> None:
    """Unpin ahead pins until ``excess`` bytes are free: each holder's furthest first, in turn; never those in ``kept``."""
    lists = [[(holder, key) for key in reversed(keys)] for holder, keys in state.ahead.items()]
    for holder, key in [pair for turn in zip_longest(*lists) for pair in turn if pair is not None]:
        if excess <= 0:
            break
        if key in kept:
            continue
        state.ahead[holder].remove(key)
        if not state.ahead[holder]:
            del state.ahead[holder]
        if key not in state.pinned():
            excess -= sizes.get(key, 0)


def set_ahead(state: CacheState, holder: str, keys: list[str], sizes: Mapping[str, int], limit: int) -> list[str]:
    """Make ``holder``'s ahead pins the first of ``keys`` (in reading order) that fit in the room no other pin
    uses; return them. Takes nothing from another holder."""
    state.ahead.pop(holder, None)
    union = state.pinned()
    total, kept = _bytes(union, sizes), []
    for key in keys:
        if key not in union:
            if total + sizes.get(key, 0) > limit:
                break
            union.add(key)
            total += sizes.get(key, 0)
        kept.append(key)
    if kept:
        state.ahead[holder] = kept
    return kept


def others_may_move(state: CacheState) -> bool:
    """True when what stands in the way of a needed pin may go while this process waits: another process's
    needed pins (its window moves on), or a download under way (it ends)."""
    me = f"{os.getpid()}-"
    return bool(state.reserved) or any(
        not holder.startswith(me) and any(n > 0 for n in keys.values()) for holder, keys in state.pins.items()
    )


def holders(state: CacheState, sizes: Mapping[str, int]) -> str:
    """Who pins what on the node, for an error: each holder's process, and its needed and ahead shards."""
    me = f"{os.getpid()}-"
    parts = []
    for holder in sorted(set(state.pins) | set(state.ahead)):
        needed = [key for key, count in state.pins.get(holder, {}).items() if count > 0]
        ahead = state.ahead.get(holder, [])
        who = f"pid {holder.split('-')[0]}" + (" (this process)" if holder.startswith(me) else "")
        parts.append(
            f"{who}: {len(needed)} shard(s) being read ({human_bytes(_bytes(needed, sizes))})"
            + (f", {len(ahead)} ahead ({human_bytes(_bytes(ahead, sizes))})" if ahead else "")
        )
    return "; ".join(parts) or "nobody"


def over_limit(folder: Path, limit: int, need: int, union: set[str], asked: list[str], held: str = "") -> str:
    """The refusal of a pin: the shards pinned on the node, ``asked`` among them, would need ``need`` bytes;
    ``held``: who holds them (:func:`holders`) and what to do, said after the limit."""
    names = ", ".join(asked[:4]) + (", ..." if len(asked) > 4 else "")
    return (
        f"{folder}: the shards pinned on this node would need {human_bytes(need)} ({need} bytes, "
        f"{len(union)} shard(s), these among them: {names}), more than the cache's limit of "
        f"{human_bytes(limit)} ({limit} bytes){held}; raise the limit to at least {need} bytes, "
        "or pin fewer shards at once (a smaller window, fewer batches ahead)"
    )


def no_room(folder: Path, limit: int, held: int, key: str, size: int) -> str:
    """The refusal of a download: the shards pinned or downloaded hold ``held`` bytes, ``key`` needs ``size`` more."""
    need = held + size
    return (
        f"{folder}: no room for shard {key} ({human_bytes(size)}): the shards pinned or being "
        f"downloaded on this node hold {human_bytes(held)} of the cache's limit of "
        f"{human_bytes(limit)} ({limit} bytes); raise the limit to at least {need} bytes, "
        "or pin fewer shards at once"
    )


__all__ = ["holders", "no_room", "others_may_move", "over_limit", "pin_needed", "set_ahead"]
