"""Who may pin what in a streaming cache folder, and what a refusal says.

Pure functions over the node's :class:`~dali_pipes.staging.cache_folder.CacheState` (no I/O): the
:class:`~dali_pipes.staging.stream_cache.ShardCache` calls them under the folder's lock.
"""

from __future__ import annotations

from pathlib import Path

from dali_pipes.dataset.manifest import human_bytes


def over_limit(folder: Path, limit: int, need: int, union: set[str], asked: list[str]) -> str:
    """The refusal of a pin: the shards pinned on the node, ``asked`` among them, would need ``need`` bytes."""
    names = ", ".join(asked[:4]) + (", ..." if len(asked) > 4 else "")
    return (
        f"{folder}: the shards pinned on this node would need {human_bytes(need)} ({need} bytes, "
        f"{len(union)} shard(s), these among them: {names}), more than the cache's limit of "
        f"{human_bytes(limit)} ({limit} bytes); raise the limit to at least {need} bytes, "
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


__all__ = ["no_room", "over_limit"]
