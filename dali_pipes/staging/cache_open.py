"""How a :class:`~dali_pipes.staging.stream_cache.ShardCache` opens its folder: claims it for its dataset, and
either starts the node's run (what is half-written removed, the complete shards kept) or joins the live
processes using it (same limit, same manifest).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dali_pipes.dataset.fileio import atomic_write_bytes
from dali_pipes.dataset.manifest import human_bytes
from dali_pipes.staging.cache_folder import MANIFEST_COPY, SOURCE_NAME, CacheError, CacheState
from dali_pipes.staging.cache_plan import kept_entries, read_bytes, read_manifest, whole

if TYPE_CHECKING:
    from dali_pipes.staging.cache_folder import CacheFolder

log = logging.getLogger("dali_pipes.staging.stream_cache")


class FolderOpening:
    """The opening of a cache folder, as a part of :class:`~dali_pipes.staging.stream_cache.ShardCache`."""

    _state: "CacheFolder"

    def _open(self, manifest_bytes: bytes) -> None:
        """Claim the folder and join the node's processes using it (the first of a run checks what it holds)."""
        with self._state.locked():
            self._claim()
            state = self._state.load()
            if not self._state.live_holders():
                state = self._fresh(state, manifest_bytes)
            else:
                state = self._load()  # the state saved below: what joining reaps or evicts is kept
                self._join(state, manifest_bytes)
            self._state.register()
            self._save(state)

    def _claim(self) -> None:
        record = self._state.meta / SOURCE_NAME
        try:
            recorded = record.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            atomic_write_bytes(record, (self.source + "\n").encode())
            return
        if recorded != self.source:
            raise CacheError(
                f"{self.folder}: already caches {recorded}, not {self.source}; give {self.source} another folder "
                f"(or delete {self.folder} if the cache of {recorded} is no longer used)"
            )

    def _fresh(self, old: CacheState | None, manifest_bytes: bytes) -> CacheState:
        """The state of a folder no live process uses: what is half-written removed, the complete shards kept."""
        previous = read_manifest(self._state.meta / MANIFEST_COPY)
        entries = [self._entries[key] for key in self._order]
        state = CacheState(limit=self.limit_bytes, clock=old.clock if old else 0, verified=self.tuning.verify)
        for entry in kept_entries(self.folder, entries, previous, self.tuning.verify):
            state.present[entry.key] = entry.bytes
            state.used[entry.key] = old.used.get(entry.key, 0) if old else 0
        for key in sorted(state.present, key=lambda k: state.used[k]):  # a smaller limit than the last run's
            if state.held <= self.limit_bytes:
                break
            self._evict(state, key)
        state.peak = state.held
        atomic_write_bytes(self._state.meta / MANIFEST_COPY, manifest_bytes)
        if state.present:
            log.info(
                "cache %s: %d shard(s) kept from an earlier run (%s)",
                self.folder,
                len(state.present),
                human_bytes(state.held),
            )
        return state

    def _join(self, state: CacheState, manifest_bytes: bytes) -> None:
        """Join the live processes using the folder: same limit, same manifest; hashes checked once if asked."""
        if state.limit != self.limit_bytes:
            raise CacheError(
                f"{self.folder}: other processes of this node use it with a limit of {state.limit} bytes, not "
                f"{self.limit_bytes}; give every process of the node the same limit"
            )
        if read_bytes(self._state.meta / MANIFEST_COPY) != manifest_bytes:
            raise CacheError(
                f"{self.folder}: other processes of this node cache another version of {self.source} (its index.json "
                "changed since they started); let them finish, then start again"
            )
        self._state.reap(state, self._files_of)
        if self.tuning.verify and not state.verified:
            for key in [k for k in state.present if k in self._entries]:
                if not whole(self.folder, self._entries[key], hashed=True):
                    self._evict(state, key)
            state.verified = True


__all__ = ["FolderOpening"]
