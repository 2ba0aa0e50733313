"""What :class:`~dali_pipes.DALILoader` raises while training, apart so that its diagnosis can raise it too.

Failures while iterating
------------------------
Every failure while iterating raises a :class:`LoaderError` that names the
dataset and, where it can be found, the shard and sample: a shard that is
missing, truncated or swapped (:class:`ShardReadError`, also a
:class:`~dali_pipes.stores.StoreError`), an image DALI cannot decode, or a
Python worker process that died (:class:`WorkerDiedError`).

A dead worker needs watching from outside DALI, or the training thread can
wait for ever on it: with ``py_num_workers > 0`` every call into DALI goes
through :mod:`dali_pipes.loading.workers`, which checks the workers every
:data:`~dali_pipes.loading.workers.WATCH_INTERVAL` seconds and gives up on the call when one died.
"""

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
