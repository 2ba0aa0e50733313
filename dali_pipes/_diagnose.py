"""Name the sample behind a DALI pipeline failure.

DALI reports a failed decode as an operator error of the whole batch
(``nvImageCodec failure``) without saying which sample it was. When a loader's
pipeline fails, it asks :func:`first_undecodable` to decode the candidates one at
a time in a separate one-sample CPU pipeline and report the first that fails.
This is the error path only: nothing here runs while training goes well.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

import numpy as np

from dali_pipes.stores import Store

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
