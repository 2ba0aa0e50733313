"""The anchor row: DALI's own ``fn.readers.file`` over the original image files.

It runs the graph of the pipeline spec (``spec.build``), fed by DALI's native
file reader instead of this package's store source, with DALI's own operators:
DALI's default GPU decoder load where ours chooses one, and DALI's ``fn.resize``
on the CPU where ours has a faster one (:mod:`~dali_pipes.pipelines.cpu_resize`).
So it is the pipeline a DALI user writes, and the difference from the
``dali-pipes`` rows is what the shards, the sampling, the Python external source
and this package's choices cost or save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from dali_pipes.bench.runner import Skipped, Target, delivered, require_cuda
from dali_pipes.pipelines import cpu_resize
from dali_pipes.pipelines.config import DALI_HW_DECODER_LOAD


@contextlib.contextmanager
def file_reader_stream(
    files: Sequence[tuple[Path, int]], spec: Any, *, target: Target, **options: Any
) -> Iterator[Iterator[int]]:
    """:func:`file_reader_batches` (its keyword ``options``), delivered to ``target``."""
    with file_reader_batches(files, spec, **options) as pairs:
        yield delivered(pairs, target)


@contextlib.contextmanager
def file_reader_batches(
    files: Sequence[tuple[Path, int]],
    spec: Any,
    *,
    batch_size: int,
    device: str,
    num_threads: int,
    seed: int = 0,
) -> Iterator[Iterator[tuple[Any, Any]]]:
    """``(image, label)`` torch batches from ``fn.readers.file`` + ``spec``'s graph, shuffled, epoch after epoch."""
    import torch
    from nvidia.dali import fn, pipeline_def
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    if device == "gpu":
        require_cuda()
    if not files:
        raise Skipped("no image files")
    spec = as_plain_dali(spec)
    paths = [os.fspath(path) for path, _ in files]
    labels = [int(label) for _, label in files]

    @pipeline_def(enable_conditionals=bool(getattr(spec, "needs_conditionals", False)))
    def define():
        encoded, label = fn.readers.file(files=paths, labels=labels, random_shuffle=True, name="Reader")
        outputs = spec.build({"image": encoded, "label": label}, device=device)
        return outputs["image"], outputs["label"]

    with cpu_resize.dali_resize_only():  # DALI's own operators, as a plain DALI pipeline has them
        pipe = define(
            batch_size=batch_size,
            num_threads=num_threads,
            device_id=torch.cuda.current_device() if device == "gpu" else None,
            seed=seed + 1,
        )
        pipe.build()
    # FILL keeps every batch full across epoch ends, as a training loop over many epochs sees it.
    iterator = DALIGenericIterator(
        [pipe], ["image", "label"], reader_name="Reader", auto_reset=True, last_batch_policy=LastBatchPolicy.FILL
    )

    def pairs() -> Iterator[tuple[Any, Any]]:
        # next() rather than a for loop: iter() on an auto-resetting DALI iterator asks it to
        # reset again, which it refuses mid-epoch with a warning.
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                continue  # auto_reset has already started the next epoch
            yield batch[0]["image"], batch[0]["label"]

    yield pairs()


def as_plain_dali(spec: Any) -> Any:
    """``spec`` with the GPU decoder load a plain DALI pipeline gets: DALI's default where ours chooses one.

    A user writing the pipeline by hand gets DALI's 0.65 unless they set it; this
    package chooses one for the machine (``DecoderHints.hw_decoder_load=None``),
    and the anchor must show what that choice is worth, not share it.
    """
    decoder = getattr(spec, "decoder", None)
    if decoder is None or decoder.hw_decoder_load is not None:
        return spec
    return dataclasses.replace(spec, decoder=dataclasses.replace(decoder, hw_decoder_load=DALI_HW_DECODER_LOAD))
