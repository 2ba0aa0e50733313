"""How a :class:`~dali_pipes.staging.stream_cache.ShardCache` checks, downloads and waits."""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass

#: Shards a fetch downloads at once by default.
DEFAULT_DOWNLOADS = 4


@dataclass(frozen=True)
class CacheTuning:
    """How a :class:`~dali_pipes.staging.stream_cache.ShardCache` checks, downloads and waits; the defaults suit
    training."""

    #: Re-hash the complete shards found when the folder is opened (once per run of the node), not only size them.
    verify: bool = False
    #: Shards one :meth:`~dali_pipes.staging.stream_cache.ShardCache.fetch` downloads at once (the name of
    #: :class:`~dali_pipes.StreamOptions`' count of downloads too).
    downloads: int = DEFAULT_DOWNLOADS
    #: Seconds to wait for a shard another process downloads before giving up, counted from its last progress.
    wait_s: float = 600.0
    #: A progress bar in bytes while a fetch downloads (shown on a terminal only).
    progress: bool = False
    #: Seconds a pin that finds no room waits for other processes' windows to move on before it is refused.
    pin_wait_s: float = 60.0
    #: The old name of ``downloads`` (before 0.5.0): still taken, with a ``DeprecationWarning``.
    workers: InitVar[int | None] = None

    def __post_init__(self, workers: int | None) -> None:
        if workers is not None:
            if workers != self.downloads and self.downloads != DEFAULT_DOWNLOADS:  # both given
                raise ValueError(
                    f"CacheTuning: downloads={self.downloads} and workers={workers}, its old name: give one"
                )
            warnings.warn(
                "CacheTuning(workers=...) is now CacheTuning(downloads=...), the name StreamOptions uses",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "downloads", workers)
        if isinstance(self.downloads, bool) or not isinstance(self.downloads, int) or self.downloads < 1:
            raise ValueError(f"CacheTuning(downloads=...) must be a whole number >= 1, got {self.downloads!r}")


def _workers(tuning: CacheTuning) -> int:
    warnings.warn("CacheTuning.workers is now CacheTuning.downloads", DeprecationWarning, stacklevel=2)
    return tuning.downloads


# The old name read as an attribute too (the InitVar's default, None, would answer otherwise); __init__'s default for
# it was fixed when the class was made.
CacheTuning.workers = property(_workers)  # type: ignore[assignment,method-assign]

__all__ = ["CacheTuning"]
