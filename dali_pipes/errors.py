"""What :class:`~dali_pipes.DALILoader` raises while training, apart so that its diagnosis can raise it too."""

from __future__ import annotations

from dali_pipes.stores.errors import StoreError

__all__ = ["LoaderError", "ShardReadError", "WorkerDiedError"]


class LoaderError(RuntimeError):
    """The DALI pipeline failed while training; the message names the dataset and, when found, the sample."""


class ShardReadError(LoaderError, StoreError):
    """A shard could not be read while training: missing, truncated, damaged or swapped after conversion.

    Both a :class:`LoaderError` (every failure of the loader is one) and a
    :class:`~dali_pipes.stores.StoreError` (what the store raised). The message
    names the shard and the sample and says to run ``dali-pipes verify``.
    """


class WorkerDiedError(LoaderError):
    """A DALI Python worker process of the loader died (killed, crashed); the pipeline cannot go on."""
