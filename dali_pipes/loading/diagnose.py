"""Name the sample behind a DALI pipeline failure.

DALI reports a failed decode as an operator error of the whole batch
(``nvImageCodec failure``) without saying which sample it was. When a loader's
pipeline fails, it asks :func:`first_undecodable` to decode the candidates one at
a time in a separate one-sample CPU pipeline and report the first that fails.
This is the error path only: nothing here runs while training goes well.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from dali_pipes.loading.errors import LoaderError, ShardReadError
from dali_pipes.remote.fs import RemoteError
from dali_pipes.sampling import World
from dali_pipes.staging.cache_folder import CacheError
from dali_pipes.stores import Store, StoreError
from dali_pipes.stores.errors import error_chain

logger = logging.getLogger(__name__)


def first_undecodable(store: Store, fields: Sequence[str], indices: Iterable[int]) -> tuple[int, str, str] | None:
    """The first ``(index, field, error)`` among ``indices`` whose image field DALI cannot decode.

    ``fields`` are the fields to check (only image fields are decoded). Returns
    ``None`` when every candidate decodes.
    """
    image_fields = [name for name in fields if store.fields[name].is_image]
    if not image_fields:
        return None
    seen: set[int] = set()
    pipe = None
    for index in indices:
        index = int(index)
        if index in seen:
            continue
        seen.add(index)
        sample = store.read(index, image_fields)
        for name in image_fields:
            if pipe is None:
                pipe = _decoder_pipeline()
            try:
                pipe.feed_input("encoded", [np.frombuffer(sample[name], dtype=np.uint8)])
                pipe.run()
            except Exception as exc:  # noqa: BLE001 - any failure is the answer
                return index, name, _first_line(exc)
    return None


def _decoder_pipeline():
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    pipe = Pipeline(
        batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1, exec_async=False, exec_pipelined=False
    )
    with pipe:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
        pipe.set_outputs(fn.decoders.image(encoded, device="cpu", output_type=types.RGB))
    pipe.build()
    return pipe


def _first_line(exc: BaseException) -> str:
    # DALI's messages repeat the pipeline traceback; the cause is the last non-empty line.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    meaningful = [line for line in lines if "no longer valid" not in line]
    return (meaningful or lines or [type(exc).__name__])[-1]


def worker_died_message(store: Store, world: World, dead: str, current: Any) -> str:
    """What a :class:`~dali_pipes.loading.errors.WorkerDiedError` says: which worker, where in the epoch, what to do."""
    where = f"rank {world.rank}"
    if current is not None:
        where = f"epoch {current.epoch}, batch {current.handed} on {where}"
    return (
        f"{store.root}: {dead} ({where}); the DALI pipeline cannot continue. Create a new DALILoader "
        "and resume from the last state_dict(); if the kernel killed it for memory, use fewer "
        "py_num_workers, a smaller prefetch or a smaller batch."
    )


def explain_failure(
    exc: BaseException,
    store: Store,
    fields: Sequence[str],
    world: World,
    current: Any,
    candidates: Callable[[], Sequence[int]],
) -> BaseException:
    """An exception naming the dataset and, when it can be found, the sample behind the pipeline error ``exc``.

    ``current`` is the loader's pass (``epoch``, ``handed``); ``candidates()`` the
    sample indices of the batch that failed and of those DALI was preparing ahead of it.
    """
    # The store's message names the shard and sample and says what to do.
    context = f" [rank {world.rank}, epoch {current.epoch}, batch {current.handed} or later]"
    error = store_error_in(exc)
    if error is not None:
        return ShardReadError(f"{error}{context}")
    try:
        found = first_undecodable(store, fields, candidates())
    except StoreError as error:  # DALI lost the worker's error, but reading it again tells
        return ShardReadError(f"{error}{context}")
    except (RemoteError, CacheError) as error:  # a streamed shard whose download failed: read again, it says so
        return LoaderError(f"{error}{context}")
    where = f"epoch {current.epoch}, batch {current.handed} on rank {world.rank}"
    if found is None:
        return LoaderError(f"{store.root}: the DALI pipeline failed ({where}): {exc}")
    index, field, reason = found
    shard_no, record = store.manifest.locate(index)
    shard = store.manifest.shards[shard_no].path
    return LoaderError(
        f"{store.root}: sample {index} (field {field!r}, shard {shard}, record {record}) cannot be "
        f"decoded ({where}): {reason}. Run 'dali-pipes verify --decode {store.root}' to list every "
        "damaged sample, and re-convert the dataset with --on-error skip to leave them out."
    )


def store_error_in(exc: BaseException) -> StoreError | None:
    """The :class:`StoreError` behind ``exc``, if any: DALI wraps a source's error once or twice."""
    return next((error for error in error_chain(exc) if isinstance(error, StoreError)), None)
