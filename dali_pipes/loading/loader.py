"""``DALILoader``: a converted dataset in, batches of torch tensors out, one loader per DDP rank.

The loader joins the pieces: the store (:mod:`dali_pipes.stores`), this rank's
share of each epoch (:mod:`dali_pipes.sampling`), the external source that reads
it inside DALI's workers (:mod:`dali_pipes.loading.sources`) and the user's pipeline spec
(:mod:`dali_pipes.pipelines`), and wraps DALI's ``DALIGenericIterator`` so that it
behaves like a PyTorch ``DataLoader`` with a ``DistributedSampler``.

Passes and epochs: each ``iter(loader)`` is one pass. A pass covers the epoch set
by :meth:`DALILoader.set_epoch` (or restored by :meth:`DALILoader.load_state_dict`);
without either, the next pass after a complete one (or after one left part-way)
covers the next epoch, so the order changes every epoch even if ``set_epoch`` is
never called. Passes of consecutive epochs are read by one DALI epoch, without a
pipeline refill between them (:mod:`dali_pipes.loading.epoch_chain`).

Failures while iterating: :mod:`dali_pipes.loading.errors`, named by :mod:`dali_pipes.loading.diagnose`.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, TypeVar

from dali_pipes.dataset.outputs import RESERVED_OUTPUTS
from dali_pipes.loading import lifetime
from dali_pipes.loading.batch_source import BatchStoreSource
from dali_pipes.loading.compat import BatchFormat, DataLoaderSurface
from dali_pipes.loading.config import DataOptions, RunOptions
from dali_pipes.loading.diagnose import explain_failure, worker_died_message
from dali_pipes.loading.direct import DirectIterator, runs_without_dali
from dali_pipes.loading.epoch_chain import EpochChain, read_ahead
from dali_pipes.loading.epoch_size import EpochSizes
from dali_pipes.loading.errors import LoaderError, ShardReadError, WorkerDiedError
from dali_pipes.loading.options import check_options, choose_counts, device_description, resolve_counts
from dali_pipes.loading.pipeline_build import bind_spec as _bind
from dali_pipes.loading.pipeline_build import build_pipeline, dali_iterator, output_casts, pipeline_seed, source_options
from dali_pipes.loading.pipeline_build import required_fields as _required_fields
from dali_pipes.loading.sources import EpochControl, StoreSource
from dali_pipes.loading.start_method import choose_start_method, main_hidden_from_spawn
from dali_pipes.loading.state import Pass as _Pass
from dali_pipes.loading.state import SavedPosition
from dali_pipes.loading.store_setup import epoch_sampling, prepare_store
from dali_pipes.loading.workers import WATCH_INTERVAL, Caller, Workers, close_worker_pool, on_stream_of_this_thread
from dali_pipes.loading.world import detect_world, resolve_device
from dali_pipes.sampling import WeightedSampling, num_batches, samples_consumed, samples_per_rank

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

_T = TypeVar("_T")


class DALILoader(DataLoaderSurface, SavedPosition):
    """Batches of a converted dataset through a DALI pipeline, for this DDP rank.

    ``path`` is a dataset folder written by ``dali-pipes convert``; ``pipeline``
    a spec such as :class:`~dali_pipes.pipelines.ClassificationTrain`. Iterating
    yields dicts of torch tensors on the pipeline's device: the spec's outputs
    (``image``, ``label``, ...), ``is_pad`` (true on the wrap-around filler of the
    last batch with ``last_batch="pad"``), and with ``with_index=True`` the global
    sample ``index``. ``shuffle`` defaults to the spec's ``shuffle_by_default`` (training
    specs shuffle each epoch, ``ClassificationVal`` and ``DetectionVal`` read in order;
    a spec without the attribute shuffles).

    Rank and world size come from ``torch.distributed`` when it is initialised,
    else from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, else 0 of 1; explicit
    values must agree with an initialised ``torch.distributed``. ``device="auto"``
    runs on this rank's GPU (``LOCAL_RANK``) when CUDA is available, else on the
    CPU. ``num_threads`` are DALI's CPU threads (by default this rank's share of the cores,
    ``cores_per_rank``, where the GPU decodes images, else 4 or that share if fewer:
    ``default_num_threads``; an INFO line says what was chosen and why), ``py_num_workers`` the Python
    processes reading the store (0: read in the main process; by default 0 for LMDB and HDF5,
    whose batches are copied straight out of the mapped shards, but one per 4 cores of the rank (2 to 8)
    where the GPU decodes images with 8 cores or more per rank, a few for other formats:
    ``default_py_num_workers``), ``prefetch`` the
    batches DALI prepares ahead, ``py_start_method`` how the workers start
    (``"fork"``, or ``"spawn"``; by default fork, or spawn once the CUDA driver is
    initialised in this process, which DALI cannot fork: ``torch.cuda.is_available()``
    does that, so spawn is the default on a CUDA machine, and spawn needs the
    script's code under ``if __name__ == "__main__":``). ``settings`` is a file written by
    ``dali-pipes tune``: its thread, worker and prefetch counts fill in the
    arguments left unset, and its decoder hints go to the spec. ``batch_reads``
    (default) reads each batch with one call into the store, sorted and coalesced
    per shard (:mod:`dali_pipes.loading.batch_source`); ``False`` reads sample by sample,
    the same samples in the same order.

    ``stage_to`` copies the dataset to a local folder (a local disk, or a tmpfs such
    as ``/dev/shm/NAME``) before the first epoch and reads it there: one process
    per folder copies, the others on the node wait for it, and a complete copy
    is reused (:mod:`dali_pipes.staging.stage`). ``cache="ram"`` holds the shards this
    rank reads in shared memory, within ``cache_bytes`` (default: half the free
    memory, split between the node's ranks), the rest read from disk (:mod:`dali_pipes.staging.ramcache`).
    ``path`` may be a URL of object storage (``s3://bucket/ds``, ``gs://``, ``az://``, ``hf://``): it is
    staged into ``stage_to``, or without it into a cache folder (``$DALI_PIPES_CACHE``, else
    ``~/.cache/dali-pipes``), its room checked first; ``storage_options`` go to the fsspec backend
    (credentials, ``endpoint_url``) and are never logged.

    Every rank yields ``len(loader)`` batches per pass; with ``"pad"`` every
    sample is seen exactly once per epoch across the ranks; the last batch may
    be shorter than ``batch_size``. :meth:`state_dict` records the epoch and the
    global samples consumed, so a run resumes mid-epoch, on any world size.

    For scripts written for a ``DataLoader``: ``batch_format=BatchFormat(keys=("image", "label"))``
    yields ``(image, label)`` tuples (``drop_padding=True`` for evaluation that counts rows: never an empty batch,
    refused where the last step has fewer samples than ranks), and ``dataset``,
    ``sampler.set_epoch``, ``batch_size`` and ``drop_last`` are there (:mod:`dali_pipes.loading.compat`).
    ``sampling=WeightedSampling(weights, num_samples=...)`` draws each epoch with weights
    instead of permuting the dataset (:mod:`dali_pipes.sampling.weighted`), with the same guarantees.
    ``path=Mixture({"a": path_a, "b": path_b}, proportions={"a": 0.7, "b": 0.3})`` reads several
    datasets as one, each its share of every epoch (:mod:`dali_pipes.loading.mixture`).
    """

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
        run = run or RunOptions()
        data = data or DataOptions()
        pipeline, threads, workers, prefetch = resolve_counts(pipeline, run)
        check_options(batch_size, seed, last_batch)
        self.world, local_rank = detect_world(run.rank, run.world_size)
        self.device, device_id = resolve_device(run.device, local_rank)
        # Chosen after resolve_device: torch.cuda.is_available() initialises the CUDA driver.
        # Checked before anything is staged or cached, so that a bad value copies nothing.
        py_start_method = choose_start_method(run.py_start_method)
        self.batch_size = int(batch_size)
        # By default as the spec says: training specs shuffle, evaluation specs (*Val) read in order.
        self.shuffle = bool(getattr(pipeline, "shuffle_by_default", True) if shuffle is None else shuffle)
        self._shuffle_default = pipeline if shuffle is None else None  # named if a weighted draw refuses it
        self.seed = int(seed)
        self.last_batch = last_batch
        self.batch_format = batch_format or BatchFormat()  # the dict of outputs, or a tuple (loading/compat.py)
        self.with_index = self.batch_format.with_index
        self.batch_format.check_spec(pipeline)
        self._open_store(path, data)
        try:
            pipeline = _bind(pipeline, self.store)
            self.pipeline = pipeline
            self._casts = output_casts(pipeline)
            fields = _required_fields(pipeline, self.store)
            self._fields = fields
            self._prefetch = prefetch
            self._control = EpochControl()
            self._sizes = EpochSizes(pipeline)
            self._source = self._make_source(fields, run.batch_reads, sampling)
            self.batch_format.check_steps(self.epoch_length, self.batch_size, self.world.world_size, self.last_batch)
            self.py_start_method = py_start_method
            with main_hidden_from_spawn(py_start_method):  # spawned workers never re-run the user's script
                self._pipe, self.output_names = self._build(pipeline, device_id, threads, workers, py_start_method)
        except BaseException:
            self.store.close()  # and the RAM cache's copies: nothing outlives a loader that failed to start
            if self.cache is not None:
                self.cache.close()
            raise
        self._start(device_id)

        self._position = (0, 0)  # (epoch, global samples consumed) after the batches handed so far
        self._pending: tuple[int, int] | None = None  # set by set_epoch / load_state_dict
        self._pass: _Pass | None = None
        self._failure: str | None = None
        logger.info(
            "DALILoader: %s: rank %d of %d on %s; %d samples, batch %d, %d batches per rank per epoch",
            self.store.root,
            self.world.rank,
            self.world.world_size,
            device_description(run.device, device_id),
            len(self.store),
            self.batch_size,
            self.batches_per_epoch,
        )

    def _make_source(self, fields: tuple[str, ...], batch_reads: bool, sampling: Any) -> StoreSource:
        """The external source of this rank: one Python call per batch (sorted, coalesced shard reads), or per sample."""
        self._batch_reads = bool(batch_reads)
        # A weighted draw per epoch (sampling/weighted.py), a mixture's (sampling/mixture.py), else a permutation.
        self.sampling = epoch_sampling(self.store, sampling, shuffle=self.shuffle, spec=self._shuffle_default)
        if self.sampling is not None:  # one weight per sample, checked before anything starts
            self.sampling.epoch_length(len(self.store))
        return (BatchStoreSource if self._batch_reads else StoreSource)(
            self.store,
            fields,
            batch_size=self.batch_size,
            world=self.world,
            seed=self.seed,
            shuffle=self.shuffle,
            last_batch=self.last_batch,
            control=self._control,
            with_index=self.with_index,
            batch_inputs=getattr(self.pipeline, "batch_inputs", None),
            sampling=self.sampling,
        )

    def _start(self, device_id: int | None) -> None:
        """Watch the built pipeline's workers and make its iterator (the last step of construction)."""
        if self._pipe is not None:
            lifetime.track(self._pipe)  # a process forked from this one must never shut it down
        self._device_id = device_id
        self._workers = Workers(self._pipe)
        # Calls into DALI go through a helper thread only when there are workers that can die.
        self._caller = Caller(f"dali-pipes-loader-{self.world.rank}") if self._workers.processes else None
        # A spec with no DALI work has no pipeline: the batch source's arrays, as tensors (loading/direct.py).
        if self._pipe is None:
            self._iterator = DirectIterator(self._source, self.output_names, device_id)
            ahead = 0  # the source is read only when a batch is asked for
        else:
            self._iterator = dali_iterator(self._pipe, self.output_names)
            depth = source_options(self._batch_reads, self._prefetch, self.py_num_workers)
            ahead = read_ahead(self._prefetch, depth.get("prefetch_queue_depth", self._prefetch))
        # Training epochs read on in one DALI epoch, without a refill between them (loading/epoch_chain.py).
        self._chain = EpochChain(self._control, self._source, self._sizes, self.batches_per_epoch, ahead)
        # DALI stops its Python workers only when the pipeline is garbage collected or
        # at interpreter exit. A process started by multiprocessing (torch's mp.spawn)
        # joins its children *before* that, so live workers would hang its exit; this
        # finalizer runs first (exitpriority >= 0), and also when the loader is dropped.
        self._stop_workers = multiprocessing.util.Finalize(
            self, close_worker_pool, args=(getattr(self._pipe, "_py_pool", None), self._caller), exitpriority=10
        )

    def _open_store(self, path: Any, data: DataOptions) -> None:
        """``store``, ``staged`` (what staging did) and ``cache`` (the RAM cache): see :func:`prepare_store`."""
        self.store, self.staged, self.cache = prepare_store(
            path,
            stage_to=data.stage_to,
            cache=data.cache,
            cache_bytes=data.cache_bytes,
            storage_options=data.storage_options,
            world=self.world,
            batch_size=self.batch_size,
            seed=self.seed,
            shuffle=self.shuffle,
            last_batch=self.last_batch,
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of DALI's Python workers reading the store (empty with ``py_num_workers=0``)."""
        return self._workers.pids

    # --- construction -------------------------------------------------------------------------

    def _build(
        self, spec: "PipelineSpec", device_id: int | None, threads: int | None, workers: int | None, start_method: str
    ):
        #: DALI's threads and Python reader processes: as asked, else the defaults for the format, device and cores.
        gpu_images = self.device == "gpu" and any(self.store.fields[name].is_image for name in self._fields)
        fmt = self.store.manifest.format
        self.num_threads, self.py_num_workers = choose_counts(threads, workers, fmt, self._batch_reads, gpu_images)
        if runs_without_dali(spec, batch_reads=self._batch_reads, workers=self.py_num_workers):
            return None, (*self._fields, *RESERVED_OUTPUTS[: 1 + int(self.with_index)])  # loading/direct.py
        return build_pipeline(
            spec,
            self._source,
            self._fields,
            self.store,
            device=self.device,
            device_id=device_id,
            batch_size=self.batch_size,
            batch_reads=self._batch_reads,
            with_index=self.with_index,
            prefetch=self._prefetch,
            threads=self.num_threads,
            workers=self.py_num_workers,
            start_method=start_method,
            seed=pipeline_seed(self.seed, self.world.rank),
        )

    # --- epochs and state ---------------------------------------------------------------------

    def _remaining_batches(self, start: int) -> int:
        return num_batches(self.epoch_length, self.batch_size, self.world.world_size, self.last_batch, start)

    @property
    def batches_per_epoch(self) -> int:
        """Batches per rank in a whole epoch (from its start)."""
        return self._remaining_batches(0)

    def __len__(self) -> int:
        """Batches this rank yields in the current pass, or in the next one if none is under way.

        A whole epoch's count, except after :meth:`load_state_dict` restored a
        position part-way through an epoch: then the batches left in it.
        """
        if self._pass is not None and self._pass.handed < self._pass.batches:
            return self._pass.batches
        epoch, start = self._next_pass()
        return self._remaining_batches(start)

    @property
    def epoch(self) -> int:
        """The epoch of the pass under way, or of the next pass."""
        if self._pass is not None and self._pass.handed < self._pass.batches:
            return self._pass.epoch
        return self._next_pass()[0]

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._iterator is None:
            raise LoaderError(f"{self.store.root}: this loader was closed")
        if self._failure is not None:
            raise LoaderError(f"{self.store.root}: this loader failed earlier and cannot continue: {self._failure}")
        epoch, start = self._next_pass()
        # A pass resumed part-way has its own last step: refused here, before anything changes, if it leaves a rank none.
        self.batch_format.check_steps(self.epoch_length, self.batch_size, self.world.world_size, self.last_batch, start)
        self._pending = None
        continues = self._chain.continues(epoch, start, after=self._pass)
        if not continues:
            self._finish_pass()
        batches = self._remaining_batches(start)
        per_rank = samples_per_rank(self.epoch_length, self.batch_size, self.world.world_size, self.last_batch, start)
        self._pass = current = _Pass(epoch, start, batches, samples=per_rank)
        self._position = (epoch, start)
        if batches == 0:
            self._position = (epoch + 1, 0)
            return iter(())
        if continues:
            current.drained = False  # DALI is reading this epoch already, whatever happens next
            self._chain.advance()  # publish the one after it
            return self._batches(current)
        self._start_dali_epoch(epoch, start)
        current.drained = False
        return self._batches(current)

    def _start_dali_epoch(self, epoch: int, start: int) -> None:
        # Publish first (with this rank's order and a schedule's size for the epoch): resetting the
        # iterator is what makes DALI schedule the new epoch's samples.
        if self._chain.open(epoch, start) > 0:
            current = self._pass
            try:
                # The reset schedules the new epoch's first tasks on the workers: a DALI call like next().
                self._call_dali(self._iterator.reset, current)
            except Exception as exc:  # noqa: BLE001 - every failure is explained and re-raised
                self._fail(self._explain(exc, current), exc)

    def _batches(self, current: _Pass) -> Iterator[Any]:
        n = self.epoch_length
        last_size = current.samples - (current.batches - 1) * self.batch_size
        while current.handed < current.batches:
            if self._pass is not current:
                return  # an iterator of an earlier pass, superseded by a newer iter(loader)
            batch = self._next_batch(current)
            if batch is None:
                raise LoaderError(
                    f"{self.store.root}: DALI ended epoch {current.epoch} after {current.handed} of "
                    f"{current.batches} batches on rank {self.world.rank}; this is a bug in dali-pipes"
                )
            current.handed += 1
            if current.handed == current.batches:
                self._position = (current.epoch + 1, 0)
                if last_size < self.batch_size:
                    batch = {name: value[:last_size] for name, value in batch.items()}
            else:
                self._position = (
                    current.epoch,
                    samples_consumed(
                        n, self.batch_size, self.world.world_size, current.handed, self.last_batch, current.start
                    ),
                )
            for name, dtype in self._casts.items():  # a dtype DALI lacks (bfloat16): cast on the output's device
                batch[name] = batch[name].to(dtype)
            yield self.batch_format.apply(
                batch, last=current.handed == current.batches, layout=getattr(self.pipeline, "layout", "NCHW")
            )
        if self._chain.follows:
            return  # DALI reads on into the next epoch (loading/epoch_chain.py)
        # Collect DALI's end of epoch now, so that the next pass can reset at once.
        if self._next_batch(current) is not None:
            raise LoaderError(f"{self.store.root}: DALI yielded more batches than planned; this is a bug in dali-pipes")

    def _next_batch(self, current: _Pass) -> dict[str, Any] | None:
        """The next batch from DALI, or ``None`` at the end of its epoch."""
        if current.drained:
            return None
        try:
            return self._call_dali(self._iterator.__next__, current)[0]
        except StopIteration:
            current.drained = True
            return None
        except Exception as exc:
            self._fail(self._explain(exc, current), exc)

    def _fail(self, error: BaseException, cause: BaseException) -> None:
        """Mark the loader failed, stop DALI's workers and raise ``error``."""
        # Keep the message only: the exception's frames hold the pipeline in a reference cycle.
        self._failure = str(error)
        if isinstance(error, WorkerDiedError):
            # DALI cannot recover its pool; its survivors may wait on the dead one's locks.
            self._workers.kill_all()
            if self._caller is not None:
                self._caller.pool_lost = True
        self._stop_workers()  # the pipeline is dead; do not leave its workers waiting
        try:
            raise error from (None if error is cause else cause)
        finally:
            del error, cause  # else this frame (and the loader) is in a cycle with the traceback

    def _call_dali(self, call: Callable[[], _T], current: _Pass | None) -> _T:
        """``call()`` (a DALI iterator call), raising :class:`WorkerDiedError` instead of hanging on a dead worker."""
        if self._caller is None:
            return call()

        def check() -> None:
            dead = self._workers.dead()
            if dead is not None:
                raise WorkerDiedError(worker_died_message(self.store, self.world, dead, current))

        check()
        if self.device == "gpu":
            call = on_stream_of_this_thread(call, self._device_id)
        return self._caller.call(call, check, WATCH_INTERVAL)

    def _finish_pass(self) -> None:
        """Bring DALI to the end of its epoch, cutting short a pass the user left part-way or one read on from."""
        self._chain.end()
        current = self._pass
        if current is None or current.drained:
            return
        self._control.cancel()  # the samples DALI has not read yet end its epoch
        while self._next_batch(current) is not None:
            pass

    def _explain(self, exc: BaseException, current: _Pass) -> BaseException:
        """An exception naming the dataset and, when it can be found, the sample behind ``exc``."""
        if isinstance(exc, LoaderError):
            return exc
        dead = self._workers.dead()
        if dead is not None:  # DALI's own report of it is "Worker data receiving interrupted" at best
            return WorkerDiedError(worker_died_message(self.store, self.world, dead, current))

        def candidates() -> Any:
            # The failed batch is the next one or one DALI was preparing ahead of it.
            indices = self._source.indices(current.epoch, current.start)[0]
            lo, ahead = current.handed * self.batch_size, (self._prefetch + 2) * self.batch_size
            return [*indices[lo : lo + ahead].tolist(), *self._chain.following_indices(ahead)]

        return explain_failure(exc, self.store, self._fields, self.world, current, candidates)

    def close(self) -> None:
        """Stop DALI's workers and release the store; the loader cannot be used afterwards."""
        self._stop_workers()
        self._iterator = None
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
        return (
            f"DALILoader({str(self.store.root)!r}, batch_size={self.batch_size}, rank={self.world.rank}, "
            f"world_size={self.world.world_size}, device={self.device!r}, epoch={self.epoch})"
        )


# --- helpers -------------------------------------------------------------------------------------
