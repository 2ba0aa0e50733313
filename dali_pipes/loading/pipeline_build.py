"""The DALI pipeline a :class:`~dali_pipes.DALILoader` runs: the store's external source into the user's spec.

:func:`bind_spec` and :func:`required_fields` fit the spec to the dataset (with
an error naming the spec that would fit); :func:`build_pipeline` wires the
external source into ``spec.build`` and appends the loader's own outputs
(:data:`~dali_pipes.dataset.outputs.RESERVED_OUTPUTS`). DALI is imported when a pipeline is built.
"""

from __future__ import annotations

import gc
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from dali_pipes.dataset.outputs import RESERVED_OUTPUTS
from dali_pipes.loading.sources import dali_output_types
from dali_pipes.stores import Store

if TYPE_CHECKING:  # the pipelines import DALI, which `import dali_pipes` must not
    from dali_pipes.loading.config import RunOptions
    from dali_pipes.pipelines import PipelineSpec

__all__ = [
    "bind_spec",
    "build_pipeline",
    "fitting_spec",
    "pipeline_seed",
    "required_fields",
]


def build_pipeline(
    spec: "PipelineSpec",
    source: Any,
    fields: Sequence[str],
    store: Store,
    *,
    run: "RunOptions",
    device_id: int | None,
    batch_size: int,
    with_index: bool,
    seed: int,
) -> tuple[Any, tuple[str, ...]]:
    """The built DALI pipeline (``source`` into ``spec.build``, then ``is_pad``/``index``) and its output names.

    ``run`` is the loader's, resolved: ``device`` ``"gpu"`` or ``"cpu"``, every count and the start method set.

    The spec's per-batch inputs (``spec.batch_inputs``), which the source appends to
    its outputs, go to ``spec.build`` by name beside the fields.
    """
    from nvidia.dali import pipeline_def

    names: list[str] = []
    define = _graph(spec, source, fields, store, run=run, with_index=with_index, names=names)
    extra: dict[str, Any] = {}
    if run.py_num_workers > 0:
        extra = dict(py_num_workers=run.py_num_workers, py_start_method=run.py_start_method)
        if hasattr(store, "serve_readers"):  # a streamed store: its board before the processes start (forked ones)
            store.serve_readers(max(run.prefetch, run.py_num_workers))  # the batches they read at once
        if run.py_start_method == "fork":
            # A forked worker inherits the parent's uncollected garbage; if its own GC
            # then finalizes an old DALI pipeline, the C++ destructor waits for executor
            # threads that do not exist in the child and the worker hangs for ever.
            gc.collect()
    pipe = pipeline_def(define, enable_conditionals=bool(getattr(spec, "needs_conditionals", False)))(
        batch_size=batch_size,
        num_threads=run.num_threads,
        device_id=device_id,
        prefetch_queue_depth=run.prefetch,
        seed=seed,
        **extra,
    )
    with warnings.catch_warnings():
        # DALI's spawn pool (nvidia/dali/_multiproc/pool.py, 2.4) never closes the parent's end of each worker's
        # setup socket: it is collected inside Process.start with a ResourceWarning. Where warnings are errors
        # (pytest -W error), that warning's traceback keeps every frame of this build alive, the loader's among
        # them, so a dropped loader would wait for the end of the test instead of being freed at once.
        warnings.simplefilter("ignore", ResourceWarning)
        pipe.build()
    return pipe, tuple(names)


def _graph(
    spec: "PipelineSpec", source: Any, fields: Sequence[str], store: Store, *, run: "RunOptions", with_index: bool,
    names: list[str],
) -> Callable[[], tuple[Any, ...]]:  # fmt: skip
    """The pipeline's definition: the external source's outputs into ``spec.build``, then ``is_pad``/``index``;
    ``names`` receives the output names when it is traced."""
    from nvidia.dali import fn

    batch_inputs = getattr(spec, "batch_inputs", None)
    dtypes, ndims = dali_output_types(store, fields, with_index, batch_inputs)
    reserved = len(fields) + 1 + int(with_index)  # the fields, is_pad, and index if asked for
    parallel = source_options(run.batch_reads, run.prefetch, run.py_num_workers)

    def define() -> tuple[Any, ...]:
        nodes = fn.external_source(
            source,
            num_outputs=len(dtypes),
            batch=run.batch_reads,
            batch_info=run.batch_reads,
            dtype=dtypes,
            ndim=ndims,
            **parallel,
        )
        inputs = dict(zip(fields, nodes[: len(fields)]))
        inputs.update(zip(batch_inputs.names if batch_inputs is not None else (), nodes[reserved:]))
        outputs = dict(spec.build(inputs, device=run.device))
        clash = [name for name in RESERVED_OUTPUTS if name in outputs]
        if clash:
            raise ValueError(f"{type(spec).__name__}.build returned {clash[0]!r}, a name the loader adds itself")
        extra = dict(zip(RESERVED_OUTPUTS, nodes[len(fields) : reserved]))  # is_pad, and index if asked for
        outputs.update({name: node.gpu() if run.device == "gpu" else node for name, node in extra.items()})
        names.extend(outputs)
        return tuple(outputs.values())

    return define


def source_options(batch_reads: bool, prefetch: int, workers: int) -> dict[str, Any]:
    """``fn.external_source``'s options for the loader's source: parallel with ``workers``, else ``no_copy``.

    DALI accepts a source prefetch depth only for parallel sources (which never copy what they are given). It
    is also how many batches DALI hands its reader processes at once, and a batch-mode source's batch goes to
    one process: with a depth below the processes, some of them idle. So one batch in flight per process; the
    pipeline's own prefetch stays as asked (the bench README has the measured gain). The cost is shared memory:
    DALI keeps a chunk per batch in flight (plus ``prefetch`` kept alive), each as large as a batch of encoded
    bytes, so each process beyond ``prefetch`` holds one batch more. In the loader's process, a batch
    source hands DALI buffers it copied the records into: ``no_copy``, and DALI's tensors keep them alive
    while it uses them (``loading/batch_source.py``).
    """
    if workers == 0:
        return dict(no_copy=batch_reads)
    return dict(parallel=True, prefetch_queue_depth=max(prefetch, workers) if batch_reads else prefetch)


def output_casts(spec: Any) -> dict[str, Any]:
    """The spec's ``output_casts`` (output name to a torch dtype's name) as torch dtypes; none for most specs.

    For a dtype DALI has no type for (``bfloat16``): the graph makes another, and the loader casts.
    """
    import torch

    casts = {}
    for name, dtype in dict(getattr(spec, "output_casts", None) or {}).items():
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"{type(spec).__name__}.output_casts[{name!r}]: {dtype!r} is not a torch dtype")
        casts[name] = getattr(torch, dtype)
    return casts


def bind_spec(spec: Any, store: Store) -> Any:
    """The spec specialised to this dataset: ``spec.bind(manifest)`` for specs that read it (detection labels)."""
    bind = getattr(spec, "bind", None)
    return bind(store.manifest) if callable(bind) else spec


def required_fields(spec: Any, store: Store) -> tuple[str, ...]:
    """The fields ``spec`` reads, checked against the dataset's; TypeError for what is not a spec."""
    fields = getattr(spec, "required_fields", None)
    if fields is None or not callable(getattr(spec, "build", None)):
        raise TypeError(
            f"pipeline must be a pipeline spec (with required_fields and build()), such as "
            f"dali_pipes.ClassificationTrain(), got {spec!r}"
        )
    fields = tuple(fields)
    missing = [name for name in fields if name not in store.fields]
    if missing:
        raise ValueError(
            f"{store.root}: {type(spec).__name__} needs the field(s) {', '.join(map(repr, missing))}, but the dataset "
            f"has only {', '.join(map(repr, store.fields))}; {fitting_spec(store.fields)}"
        )
    return fields


def fitting_spec(fields: Any) -> str:
    """Which spec reads a dataset of these fields (a :class:`~dali_pipes.dataset.manifest.Field` by name), in words."""
    images = [name for name, f in fields.items() if f.is_image]
    if not images:
        arrays = tuple(name for name, f in fields.items() if f.kind == "array")
        return f"for feature arrays use dali_pipes.Features(fields={arrays!r})"
    if {"masks", "mask_code"} <= set(fields):
        return "for images with boxes and masks use dali_pipes.InstanceSegmentation() (or InstanceSegmentationVal())"
    if {"boxes", "category_id"} <= set(fields):
        return (
            "for images with boxes use dali_pipes.Detection() (or DetectionVal()); for masks too, convert with "
            "'dali-pipes convert coco --masks'"
        )
    if "mask" in fields:
        return "for images with label maps use dali_pipes.SemanticSegmentation() (or SemanticSegmentationVal())"
    return "for labelled images use dali_pipes.ClassificationTrain() (or ClassificationVal())"


def pipeline_seed(seed: int, rank: int) -> int:
    """The DALI pipeline's seed for the loader's ``seed`` on ``rank``."""
    # Augmentation randomness: reproducible for a seed, different on every rank.
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0] & 0x7FFFFFFF)
