"""The error every shard reader raises, apart so that the readers' helpers can raise it too."""

from __future__ import annotations

__all__ = ["StoreError"]


class StoreError(Exception):
    """A shard that cannot be read: missing, truncated, altered or not of its format.

    The message names the dataset, the shard and, where known, the sample.
    """
