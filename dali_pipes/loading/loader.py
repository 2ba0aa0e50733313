"""``DALILoader``: a converted dataset in, batches of torch tensors out, one loader per DDP rank.

The loader joins the pieces: the store (:mod:`dali_pipes.stores`), this rank's
share of each epoch (:mod:`dali_pipes.sampling`), the external source that reads
it inside DALI's workers (:mod:`dali_pipes.loading.sources`) and the user's pipeline spec
(:mod:`dali_pipes.pipelines`), and asks a batch stream (:mod:`dali_pipes.loading.streams`:
DALI's ``DALIGenericIterator``, or the direct path of :mod:`dali_pipes.loading.direct`)
for batches, so that it behaves like a PyTorch ``DataLoader`` with a ``DistributedSampler``.

Passes and epochs: each ``iter(loader)`` is one pass. A pass covers the epoch set
by :meth:`DALILoader.set_epoch` (or restored by :meth:`DALILoader.load_state_dict`);
without either, the next pass after a complete one (or after one left part-way)
covers the next epoch, so the order changes every epoch even if ``set_epoch`` is
never called. One object keeps that state, :class:`~dali_pipes.loading.passes.EpochState`;
passes of consecutive epochs are read by one stream epoch, without a pipeline refill
between them (:mod:`dali_pipes.loading.epoch_chain`).

Failures while iterating: :mod:`dali_pipes.loading.errors`, named by :mod:`dali_pipes.loading.guard`.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.util
import os
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from dali_pipes.dataset.outputs import RESERVED_OUTPUTS
from dali_pipes.loading import lifetime, options
from dali_pipes.loading.batch_source import BatchStoreSource
from dali_pipes.loading.compat import BatchFormat, DataLoaderSurface
from dali_pipes.loading.config import DataOptions, RunOptions
from dali_pipes.loading.direct import DirectStream, runs_without_dali
from dali_pipes.loading.epoch_chain import EpochChain, read_ahead
from dali_pipes.loading.epoch_size import EpochSizes
from dali_pipes.loading.errors import LoaderError, ShardReadError, WorkerDiedError
from dali_pipes.loading.guard import Diagnosis, GuardedStream
from dali_pipes.loading.passes import EpochState, EpochSteps, Pass
from dali_pipes.loading.pipeline_build import (
    bind_spec,
    build_pipeline,
    output_casts,
    pipeline_seed,
    required_fields,
    source_options,
)
from dali_pipes.loading.sources import EpochControl, StoreSource
from dali_pipes.loading.start_method import choose_start_method, main_hidden_from_spawn
from dali_pipes.loading.state import loader_state, restored_position, restored_stream, stream_record
from dali_pipes.loading.store_setup import epoch_sampling, prepare_store
from dali_pipes.loading.stream_setup import streaming_run
from dali_pipes.loading.streams import DaliStream
from dali_pipes.loading.workers import WATCH_INTERVAL, Caller, Workers, close_worker_pool
from dali_pipes.loading.world import detect_world, resolve_device
from dali_pipes.sampling import EpochRules, WeightedSampling

if TYPE_CHECKING:  # the pipelines import DALI, which `import dali_pipes` must not
    from dali_pipes.loading.mixture import Mixture
    from dali_pipes.pipelines import PipelineSpec

logger = logging.getLogger(__name__)

__all__ = [
    "WATCH_INTERVAL",
    "DALILoader",
    "LoaderError",
    "ShardReadError",
    "WorkerDiedError",
    "detect_world",
    "resolve_device",
]


class DALILoader(DataLoaderSurface):
    """Batches of a converted dataset through a DALI pipeline, for this DDP rank.

    ``path`` is a dataset folder written by ``dali-pipes convert`` (or a URL of one, or a
    :class:`~dali_pipes.Mixture` of several); ``pipeline`` a spec such as
    :class:`~dali_pipes.pipelines.ClassificationTrain`. Iterating yields dicts of torch
    tensors on the pipeline's device: the spec's outputs (``image``, ``label``, ...),
    ``is_pad`` (true on the wrap-around filler of the last batch with ``last_batch="pad"``),
    and with ``BatchFormat(with_index=True)`` the global sample ``index``. ``shuffle``
    defaults to the spec's ``shuffle_by_default`` (training specs shuffle each epoch,
    ``ClassificationVal`` and ``DetectionVal`` read in order; a spec without it shuffles).

    ``run``: where the loader runs and how hard it works (:class:`~dali_pipes.RunOptions`:
    device, rank, world size, DALI threads, reader processes, prefetch, start method,
    batch reads, a ``dali-pipes tune`` settings file). ``data``: where it reads the data
    from (:class:`~dali_pipes.DataOptions`: a staged copy, a RAM cache, object storage's
    options). Both default to what suits this machine; an INFO line says what was chosen. Under ``torch.distributed``
    every rank builds its streaming loaders (``DataOptions(stream=...)``) at the same point, in the same order: the ranks
    agree on each one's window (through the process group's store).

    Every rank yields ``len(loader)`` batches per pass; with ``"pad"`` every
    sample is seen exactly once per epoch across the ranks; the last batch may
    be shorter than ``batch_size``. :meth:`state_dict` records the epoch and the
    global samples consumed, so a run resumes mid-epoch, on any world size.

    For scripts written for a ``DataLoader``: ``batch_format=BatchFormat(keys=("image", "label"))``
    yields ``(image, label)`` tuples (``drop_padding=True`` for evaluation that counts rows),
    and ``dataset``, ``sampler.set_epoch``, ``batch_size`` and ``drop_last`` are there
    (:mod:`dali_pipes.loading.compat`). ``sampling=WeightedSampling(weights, num_samples=...)``
    draws each epoch with weights instead of permuting the dataset (:mod:`dali_pipes.sampling.weighted`),
    with the same guarantees.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "DALILoader":
        options.refuse_former_keywords(kwargs)  # device=, stage_to=, ...: their new homes named (loading/options.py)
        return super().__new__(cls)

    def __init__(
        self,
        path: "str | os.PathLike | Mixture",
        pipeline: "PipelineSpec",
        *,
        batch_size: int,
        shuffle: bool | None = None,
        seed: int = 0,
        last_batch: str = "pad",
        batch_format: BatchFormat | None = None,
        sampling: WeightedSampling | None = None,
        run: RunOptions | None = None,
        data: DataOptions | None = None,
    ) -> None:
        # Imported where no frame holds this loader: a first import may leave a reference cycle.
        lifetime.import_in_thread("torch.distributed", "nvidia.dali.fn", "nvidia.dali.plugin.pytorch")
        data = data or DataOptions()
        run = streaming_run(run or RunOptions(), data)  # streaming reads whole batches (loading/streaming.py)
        pipeline, run = options.resolve_counts(pipeline, run)
        options.check_options(batch_size, seed, last_batch, path)
        self.world, local_rank = detect_world(run.rank, run.world_size)
        self.device, device_id = resolve_device(run.device, local_rank)
        # Chosen after resolve_device (torch.cuda.is_available() initialises the CUDA driver), and
        # before anything is staged or cached, so that a bad value copies nothing.
        self.py_start_method = choose_start_method(run.py_start_method)
        self.batch_size, self.seed, self.last_batch = int(batch_size), int(seed), last_batch
        # By default as the spec says: training specs shuffle, evaluation specs (*Val) read in order.
        self.shuffle = bool(getattr(pipeline, "shuffle_by_default", True) if shuffle is None else shuffle)
        self.batch_format = batch_format or BatchFormat()  # the dict of outputs, or a tuple (loading/compat.py)
        self.with_index = self.batch_format.with_index
        self.batch_format.check_spec(pipeline)
        self._rules = EpochRules(self.batch_size, self.world, self.seed, self.shuffle, self.last_batch)
        self.store, self.staged, self.cache = prepare_store(path, data, self._rules)
        try:
            self.pipeline = bind_spec(pipeline, self.store)
            self._fields = required_fields(self.pipeline, self.store)
            self.sampling = epoch_sampling(
                self.store, sampling, shuffle=self.shuffle, spec=pipeline if shuffle is None else None
            )
            self._source = self._make_source(run.batch_reads)
            # epoch_length checks a weighted draw (one weight per sample) before anything starts.
            self.batch_format.check_steps(self.epoch_length, self.batch_size, self.world.world_size, self.last_batch)
            with main_hidden_from_spawn(self.py_start_method):  # spawned workers never re-run the user's script
                self._start(run, device_id)
        except BaseException:
            getattr(self, "_stop_workers", lambda: None)()  # a pipeline built before the failure: its processes
            self.store.close()  # and the RAM cache's copies: nothing outlives a loader that failed to start
            if self.cache is not None:
                self.cache.close()
            raise
        logger.info(
            "DALILoader: %s: rank %d of %d on %s; %d samples, batch %d, %d batches per rank per epoch",
            options.source_description(path, self.store.root, data),
            *(self.world.rank, self.world.world_size, options.device_description(run.device, device_id)),
            *(len(self.store), self.batch_size, self.batches_per_epoch),
        )

    def _make_source(self, batch_reads: bool) -> StoreSource:
        """The external source of this rank: one Python call per batch (sorted, coalesced shard reads), or per sample."""
        self._control = EpochControl()
        self._sizes = EpochSizes(self.pipeline)
        return (BatchStoreSource if batch_reads else StoreSource)(
            self.store,
            self._fields,
            self._rules,
            control=self._control,
            with_index=self.with_index,
            batch_inputs=getattr(self.pipeline, "batch_inputs", None),
            sampling=self.sampling,
        )

    def _start(self, run: RunOptions, device_id: int | None) -> None:
        """Build the pipeline (or the direct path), watch its workers, and make the epoch state over its stream."""
        gpu_images = self.device == "gpu" and any(self.store.fields[name].is_image for name in self._fields)
        refusal = getattr(self.store, "readers_refusal", None)  # a streamed store: do reader processes fit its cache?
        self.num_threads, self.py_num_workers = options.choose_counts(
            run.num_threads, run.py_num_workers, self.store.manifest.format, run.batch_reads, gpu_images,
            refusal=refusal and (lambda workers: refusal(max(run.prefetch, workers))),
        )  # fmt: skip
        run = dataclasses.replace(
            run, device=self.device, num_threads=self.num_threads, py_num_workers=self.py_num_workers,
            py_start_method=self.py_start_method,
        )  # fmt: skip
        self._casts = output_casts(self.pipeline)
        self._pipe, stream, ahead = None, None, 0  # the direct path's source is read only when a batch is asked for
        if runs_without_dali(self.pipeline, batch_reads=run.batch_reads, workers=self.py_num_workers):
            self.output_names = (*self._fields, *RESERVED_OUTPUTS[: 1 + int(self.with_index)])
            stream = DirectStream(self._source, self.output_names, device_id)
            logger.info("DALILoader: %s reads batches without a DALI graph (loading/direct.py)", self.store.root)
        else:
            seed = pipeline_seed(self.seed, self.world.rank)
            self._pipe, self.output_names = build_pipeline(
                self.pipeline, self._source, self._fields, self.store, run=run, device_id=device_id,
                batch_size=self.batch_size, with_index=self.with_index, seed=seed,
            )  # fmt: skip
            lifetime.track(self._pipe)  # a process forked from this one must never shut it down
            stream = DaliStream(self._pipe, self.output_names)
            depth = source_options(run.batch_reads, run.prefetch, self.py_num_workers)
            ahead = read_ahead(run.prefetch, depth.get("prefetch_queue_depth", run.prefetch))
        self._workers = Workers(self._pipe)
        # Calls into DALI go through a helper thread only when there are workers that can die.
        caller = Caller(f"dali-pipes-loader-{self.world.rank}") if self._workers.processes else None
        # DALI stops its Python workers only when the pipeline is garbage collected or
        # at interpreter exit. A process started by multiprocessing (torch's mp.spawn)
        # joins its children *before* that, so live workers would hang its exit; this
        # finalizer runs first (exitpriority >= 0), and also when the loader is dropped.
        self._stop_workers = multiprocessing.util.Finalize(
            self, close_worker_pool, args=(getattr(self._pipe, "_py_pool", None), caller), exitpriority=10
        )
        diagnosis = Diagnosis(
            self.store, self._fields, self.world, self._workers, self._source, self.batch_size, run.prefetch
        )
        self._stream = GuardedStream(stream, diagnosis, caller, device_id, self._stop_workers)
        streamed_order = self.sampling if hasattr(self.sampling, "rank_indices") else None
        steps = EpochSteps(self.epoch_length, self._rules, streamed_order)
        # Training epochs read on in one stream epoch, without a refill between them (loading/epoch_chain.py).
        chain = EpochChain(self._control, self._source, self._sizes, steps.batches(0), ahead)
        where = f"{self.store.root} (rank {self.world.rank})"
        self._epochs = EpochState(self._stream, chain, self._control, steps, where)
        diagnosis.watch(self._epochs)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of DALI's Python workers reading the store (empty with ``py_num_workers=0``)."""
        return self._workers.pids

    @property
    def refills(self) -> int:
        """How many times the pipeline has started an epoch from empty (1 from the first ``iter(loader)``);
        consecutive training epochs read on without one (:mod:`dali_pipes.loading.epoch_chain`)."""
        return self._epochs.refills

    # --- epochs and state ---------------------------------------------------------------------

    @property
    def batches_per_epoch(self) -> int:
        """Batches per rank in a whole epoch (from its start)."""
        return self._epochs.steps.batches(0)

    def __len__(self) -> int:
        """Batches this rank yields in the current pass, or in the next one if none is under way.

        A whole epoch's count, except after :meth:`load_state_dict` restored a
        position part-way through an epoch: then the batches left in it.
        """
        current = self._epochs.pass_under_way()
        if current is not None:
            return current.batches
        epoch, start = self._epochs.next_pass()
        return self._epochs.steps.batches(start, epoch)

    @property
    def epoch(self) -> int:
        """The epoch of the pass under way, or of the next pass."""
        current = self._epochs.pass_under_way()
        return current.epoch if current is not None else self._epochs.next_pass()[0]

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass cover ``epoch`` (its order depends only on ``(seed, epoch)``).

        Setting the epoch that :meth:`load_state_dict` restored keeps its resume
        offset, so ``load_state_dict(...)`` followed by the usual
        ``for epoch in range(start, end): loader.set_epoch(epoch); ...`` resumes mid-epoch.
        """
        self._epochs.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: the epoch and the global samples of it consumed so far.

        Counts the batches handed to the user (not those DALI prefetched). The
        same on every rank of a job that steps in lockstep, and valid on another
        world size or batch size. A spec with ``size_at`` (``ClassificationTrain``)
        adds the epoch's output ``size``, which a resumed epoch keeps.
        """
        epoch, consumed = self._epochs.saved_position()
        state = loader_state(epoch, consumed, **self._state_identity())
        return self._sizes.record(stream_record(state, self._epochs.steps.order))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next pass covers the rest of the saved epoch."""
        position = restored_position(state, self.store.root, **self._state_identity())
        position = restored_stream(state, position, self._epochs.steps.order, self.store.root)
        self._epochs.restore(position)
        self._sizes.restore(state, position)

    def _state_identity(self) -> dict[str, Any]:
        # What a saved state must agree on to mean the same epoch order here.
        sampling = None if self.sampling is None else self.sampling.identity()
        return dict(
            num_samples=self.epoch_length, seed=self.seed, shuffle=self.shuffle, last_batch=self.last_batch,
            sampling=sampling,
        )  # fmt: skip

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._stream.closed:
            raise LoaderError(f"{self.store.root}: this loader was closed")
        if self._stream.failure is not None:
            raise LoaderError(
                f"{self.store.root}: this loader failed earlier and cannot continue: {self._stream.failure}"
            )
        # A pass resumed part-way has its own last step: refused here, before anything changes, if it leaves a rank none.
        start = self._epochs.next_pass()[1]
        self.batch_format.check_steps(self.epoch_length, self.batch_size, self.world.world_size, self.last_batch, start)
        current = self._epochs.begin()
        return self._batches(current) if current.batches else iter(())

    def _batches(self, current: Pass) -> Iterator[Any]:
        layout = getattr(self.pipeline, "layout", "NCHW")
        while (batch := self._epochs.next_batch(current)) is not None:
            for name, dtype in self._casts.items():  # a dtype DALI lacks (bfloat16): cast on the output's device
                batch[name] = batch[name].to(dtype)
            yield self.batch_format.apply(batch, last=not current.under_way, layout=layout)
        self._epochs.end_pass(current)

    def close(self) -> None:
        """Stop DALI's workers and release the store; the loader cannot be used afterwards."""
        self._stop_workers()
        self._stream.close()  # drops the pipeline
        self._pipe = None
        self._control.close()
        self.store.close()
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> "DALILoader":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        epoch = "closed" if self._stream.closed else self.epoch
        return (
            f"DALILoader({str(self.store.root)!r}, batch_size={self.batch_size}, rank={self.world.rank}, "
            f"world_size={self.world.world_size}, device={self.device!r}, epoch={epoch})"
        )
