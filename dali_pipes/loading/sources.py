"""DALI external-source callables over a store: ``SampleInfo`` -> one sample's arrays.

:class:`StoreSource` is the per-sample callable a DALI ``fn.external_source``
runs, in the main process or in DALI's parallel Python workers (fork or spawn).
It reads sample ``i`` of this rank's order for the current epoch from the store
and returns its fields (an encoded image as a 1-D ``uint8`` array), then
``is_pad`` and the global sample ``index``.

How the epoch reaches the workers
---------------------------------
DALI pickles the callable into each worker once, when the pipeline is built,
and afterwards only sends ``SampleInfo`` (``idx_in_epoch``, ``iteration``,
``epoch_idx``), where ``epoch_idx`` counts pipeline resets. The training epoch
and the resume offset are chosen later, by ``set_epoch`` and
``load_state_dict``. They travel through an :class:`EpochControl`: a 56-byte
file in ``/dev/shm`` (memory-mapped by every process that uses it; a pickled
control carries only the path) holding ``(dali_epoch, epoch, start,
cancelled, size, first, chained)`` (``size``: the epoch's output size, for specs whose size
follows a schedule, 0 otherwise; ``first`` and ``chained``: below). The loader writes it *before* it resets the pipeline, and DALI
schedules the tasks of a new ``epoch_idx`` only in that reset, so a worker always
finds the plan of the epoch it is asked for. The loader computes this rank's
order once per epoch and shares it in a file beside the control block
(:mod:`dali_pipes.loading.epoch_plan`); a worker maps it once per ``epoch_idx``, and per
sample only checks two integers.

``cancelled`` ends an epoch early: a loader whose user stopped iterating
mid-epoch sets it, every later sample raises ``StopIteration``, and the loader
only has to drain the few batches DALI had already prefetched.

One DALI epoch can read several training epochs in a row, so that DALI never
stops to refill its pipeline between them (:mod:`dali_pipes.loading.epoch_chain`):
the control block then also holds the samples of the first plan (segment 0) and
of each later one (``chained``, each a whole epoch); sample ``i`` past segment 0
is in segment ``1 + (i - first) // chained``, whose plan file the loader wrote
before DALI could ask for it. A segment not written ends the DALI epoch.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from dali_pipes.dataset.outputs import DALI_TYPE_NAMES
from dali_pipes.loading.epoch_plan import Plan, plan_path, read_plan, remove_file, remove_plan, segment_path, write_plan
from dali_pipes.sampling import EpochRules, rank_indices, split_order
from dali_pipes.staging.tmpfs import OwnedFolder, writable_tmpfs
from dali_pipes.stores import Store, StoreError, select_fields

__all__ = ["EpochControl", "StoreSource", "dali_output_types"]

_DALI_EPOCH, _EPOCH, _START, _CANCELLED, _SIZE, _FIRST, _CHAINED = range(7)
_SLOTS = 7
#: The DALI epoch slot while a new epoch's plan is being written: no task's epoch, so every task stops.
_NO_DALI_EPOCH = -1


#: Prefix of the tmpfs folder that holds a loader's control block and epoch plan.
CONTROL_PREFIX = "dali-pipes-epoch-"


def _unlink(path: str, owner_pid: int) -> None:
    # A forked child inherits the owner object; only the creating process deletes the file.
    if os.getpid() != owner_pid:
        return
    remove_plan(plan_path(path))
    remove_file(path)


class EpochControl:
    """The epoch plan shared between the loader and the source in DALI's workers.

    Created by the loader (which owns and finally deletes the file); a pickled
    copy attaches to the same file in the worker process.
    """

    def __init__(self) -> None:
        if writable_tmpfs() is not None:
            # A tmpfs keeps the block and the plan (9 bytes a sample) off the disk, in a folder
            # that a loader killed with SIGKILL does not leave behind for good: the next one removes it.
            self._folder: OwnedFolder | None = OwnedFolder(CONTROL_PREFIX)
            path = str(self._folder.path / "control")
            self._finalizer = None
        else:
            self._folder = None
            fd, path = tempfile.mkstemp(prefix=CONTROL_PREFIX)
            os.close(fd)
            self._finalizer = weakref.finalize(self, _unlink, path, os.getpid())
        with open(path, "wb") as f:
            f.write(np.array([-1] + [0] * (_SLOTS - 1), dtype=np.int64).tobytes())
        self.path = path
        self._view: np.ndarray | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._view = None
        self._pid = None
        self._folder = self._finalizer = None  # an attached copy never deletes the owner's file

    @property
    def values(self) -> np.ndarray:
        """The live ``int64[7]`` view ``(dali_epoch, epoch, start, cancelled, size, first, chained)``."""
        if self._view is None or self._pid != os.getpid():
            with open(self.path, "r+b") as f:
                mapped = mmap.mmap(f.fileno(), _SLOTS * 8)
            self._view = np.frombuffer(mapped, dtype=np.int64, count=_SLOTS)
            self._pid = os.getpid()
        return self._view

    def publish(
        self,
        dali_epoch: int,
        epoch: int,
        start: int,
        plan: tuple[np.ndarray, np.ndarray] | None = None,
        size: int = 0,
        chained: int = 0,
    ) -> None:
        """Announce that DALI epoch ``dali_epoch`` covers ``epoch`` from global sample ``start``.

        ``plan``: this rank's ``(indices, is_pad)`` for it, written first to the
        shared plan file (:mod:`dali_pipes.loading.epoch_plan`) so that the workers map it
        instead of each computing the epoch order again. ``size``: the epoch's output
        size, read by the per-batch inputs of the spec (0 when it has none). ``chained``:
        the samples of each later segment of this DALI epoch (:meth:`publish_segment`),
        0 when it reads this one epoch only.
        """
        values = self.values
        # First no DALI epoch at all: a task of the old one still running (DALI schedules ahead) that finds the
        # plan file already replaced must see that its epoch is over, not read on without the plan.
        values[_DALI_EPOCH] = _NO_DALI_EPOCH
        if plan is not None:
            write_plan(plan_path(self.path), dali_epoch, *plan, epoch=epoch, start=start, size=size)
        # The DALI epoch goes last: a worker that sees it also sees the rest.
        values[_EPOCH] = epoch
        values[_START] = start
        values[_CANCELLED] = 0
        values[_SIZE] = size
        values[_FIRST] = 0 if plan is None else len(plan[0])
        values[_CHAINED] = chained
        values[_DALI_EPOCH] = dali_epoch

    def publish_segment(
        self, dali_epoch: int, segment: int, epoch: int, plan: tuple[np.ndarray, np.ndarray], size: int = 0
    ) -> None:
        """Let DALI epoch ``dali_epoch`` read on into the whole of ``epoch`` as its segment ``segment`` (>= 1)."""
        write_plan(segment_path(self.path, segment), dali_epoch, *plan, epoch=epoch, size=size)

    def drop_segment(self, segment: int) -> None:
        """Delete a segment's plan file that no reader needs any more (a worker mapping it keeps its copy)."""
        remove_file(segment_path(self.path, segment))

    def cancel(self) -> None:
        """End the current DALI epoch early: every sample not yet read raises ``StopIteration``."""
        self.values[_CANCELLED] = 1

    def close(self) -> None:
        """Delete the file (owner only); attached copies keep their mapping until they exit."""
        self._view = None
        if self._folder is not None:
            self._folder.close()
        if self._finalizer is not None:
            self._finalizer()


@dataclass(frozen=True)
class _Segment:
    """A plan of the current DALI epoch and where it starts in it (a multiple of the batch size)."""

    first: int
    plan: Plan

    def holds(self, i: int) -> bool:
        return self.first <= i < self.first + len(self.plan.indices)


class StoreSource:
    """A picklable per-sample ``fn.external_source`` callable over ``store`` for one rank.

    ``rules`` are the loader's batch size, rank and world, seed, shuffle and last-batch
    policy. Returns, for ``SampleInfo.idx_in_epoch = i``, the ``fields`` of this rank's
    ``i``-th sample (bytes fields as 1-D ``uint8`` arrays, array fields as stored),
    read with :meth:`Store.read <dali_pipes.stores.Store.read>`, so the dataset's
    other fields are never read,
    then ``is_pad`` (``bool``) and, with ``with_index``, ``index`` (``int64``, the
    global sample index), then the spec's per-batch inputs (``batch_inputs``, a
    :class:`~dali_pipes.pipelines.batch_inputs.BatchInputs`: a size schedule's size,
    MixUp/CutMix and RandomErasing draws) when it has them.
    The rank's samples are padded by wrap-around to a whole number of batches,
    because DALI drops a partial last batch; the loader trims that padding off.
    Past the end (and in a cancelled epoch) it raises ``StopIteration``.
    """

    def __init__(
        self,
        store: Store,
        fields: Sequence[str],
        rules: EpochRules,
        *,
        control: EpochControl,
        with_index: bool = True,
        batch_inputs: Any = None,
        sampling: Any = None,
    ) -> None:
        select_fields(store.fields, fields, str(store.root))  # the stores' one check: names a missing field
        self.store = store
        self.fields = tuple(fields)
        # Copied out of the rules as plain attributes: read at every sample or batch, in DALI's reader processes too.
        self.batch_size, self.world, self.seed = int(rules.batch_size), rules.world, int(rules.seed)
        self.shuffle, self.last_batch = bool(rules.shuffle), rules.last_batch
        self.control = control
        self.with_index = bool(with_index)
        self.batch_inputs = batch_inputs
        self.sampling = sampling  # a weighted draw or a mixture's (its order()) instead of a permutation
        self._owner_pid = os.getpid()  # the loader's process; any other process running us is a DALI worker
        self._converters: tuple[tuple[str, Callable[[Any], np.ndarray]], ...] = tuple(
            (name, _as_uint8 if store.fields[name].kind == "bytes" else np.asarray) for name in self.fields
        )
        self._reset_cache()

    def _reset_cache(self) -> None:
        self._made: tuple[tuple[int, int], list[np.ndarray]] | None = None  # the last batch's per-batch inputs
        self._dali_epoch = -1
        self._segment: _Segment | None = None  # the plan last read from
        self._values: np.ndarray | None = None  # this process's view of the control block

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Workers map the control block and the plans themselves; never ship either. Nor the sampling: a
        # worker reads the orders the loader computed (epoch_plan.py), and a WeightedSampling holds 8 bytes
        # a sample (80 MB at 10M samples, once per spawned worker). Only a permutation, which costs nothing
        # to send, is still computed where no plan was written (a source used without a loader).
        state.update(_dali_epoch=-1, _segment=None, _values=None, _made=None)
        if self.sampling is not None:
            state["sampling"] = _LeftBehind(type(self.sampling).__name__)
        return state

    def _batch_inputs(self, iteration: int, segment: _Segment) -> list[np.ndarray]:
        """The spec's per-batch inputs of batch ``iteration`` of the current DALI epoch (each ``[B, ...]``)."""
        key = (self._dali_epoch, iteration)
        if self._made is None or self._made[0] != key:
            plan = segment.plan
            in_segment = iteration - segment.first // self.batch_size
            # The batch's number in the epoch, counted from the epoch's start: a resumed epoch draws as the whole one.
            batch = plan.start // (self.batch_size * self.world.world_size) + in_segment
            lo = in_segment * self.batch_size
            arrays = self.batch_inputs.make(
                seed=self.seed,
                rank=self.world.rank,
                epoch=plan.epoch,
                batch=batch,
                size=plan.size,
                is_pad=plan.is_pad[lo : lo + self.batch_size],
            )
            self._made = (key, arrays)
        return self._made[1]

    def indices(self, epoch: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's ``(indices, is_pad)`` for ``epoch`` from ``start``, padded to whole batches."""
        if hasattr(self.sampling, "rank_indices"):  # a streamed order: each node reads its own partitions
            return self._padded(*self.sampling.rank_indices(epoch, start), "end")
        if self.sampling is not None:
            order = self.sampling.order(len(self.store), epoch, self.seed)
            pad_from = getattr(self.sampling, "pad_from", "start")
            indices, is_pad = split_order(
                order, self.batch_size, self.world.rank, self.world.world_size, self.last_batch, start, pad_from
            )
            return self._padded(indices, is_pad, pad_from)
        indices, is_pad = rank_indices(
            len(self.store),
            self.batch_size,
            self.world.rank,
            self.world.world_size,
            epoch,
            self.seed,
            shuffle=self.shuffle,
            last_batch=self.last_batch,
            start=start,
        )
        return self._padded(indices, is_pad)

    def _padded(
        self, indices: np.ndarray, is_pad: np.ndarray, pad_from: str = "start"
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, is_pad)`` padded to whole batches (DALI drops a partial last batch; the loader trims it):
        with this rank's first samples, or with ``pad_from="end"`` its last ones (a stream's cache holds them)."""
        short = -len(indices) % self.batch_size
        if short:
            indices = np.concatenate([indices, np.resize(indices if pad_from == "start" else indices[::-1], short)])
            is_pad = np.concatenate([is_pad, np.ones(short, dtype=bool)])
        return indices, is_pad

    def _load_plan(self, dali_epoch: int) -> None:
        # Called in the process that reads (a worker, or the main process without
        # workers), so the view it keeps is that process's own mapping.
        if os.getpid() != self._owner_pid:
            _forget_foreign_exception_reducers()
        self._values = values = self.control.values
        if values[_DALI_EPOCH] != dali_epoch:
            # A task of an epoch the loader already left; DALI discards its result.
            raise StopIteration
        self._segment = _Segment(0, self._first_plan(dali_epoch))
        self._dali_epoch = dali_epoch

    def _first_plan(self, dali_epoch: int) -> Plan:
        # The loader's plan for this epoch when it wrote one; computed here only without a loader.
        plan = read_plan(plan_path(self.control.path), dali_epoch)
        if plan is not None:
            return plan
        values = self._values
        if values[_DALI_EPOCH] != dali_epoch:
            raise StopIteration  # the loader published a newer epoch meanwhile: this task's result is discarded
        epoch, start = int(values[_EPOCH]), int(values[_START])
        return Plan(*self.indices(epoch, start), epoch, start, int(values[_SIZE]))

    def _locate(self, dali_epoch: int, i: int) -> _Segment:
        """The segment that holds sample ``i`` of DALI epoch ``dali_epoch``; ``StopIteration`` past the end."""
        if dali_epoch != self._dali_epoch:
            self._load_plan(dali_epoch)
        values = self._values
        if values[_CANCELLED] or values[_DALI_EPOCH] != dali_epoch:
            raise StopIteration
        segment = self._segment
        if segment.holds(i):
            return segment
        first, chained = int(values[_FIRST]), int(values[_CHAINED])
        if i < first:  # back in the first plan (a worker that has read on already does not come back)
            self._load_plan(dali_epoch)
            return self._segment
        if not chained:
            raise StopIteration  # past the end of the one epoch this DALI epoch reads
        number = 1 + (i - first) // chained
        plan = read_plan(segment_path(self.control.path, number), dali_epoch)
        if plan is None or len(plan.indices) != chained:
            raise StopIteration  # not written: the loader ended the chain before this segment
        self._segment = _Segment(first + (number - 1) * chained, plan)
        return self._segment

    def __call__(self, sample_info: Any) -> tuple[np.ndarray, ...]:
        i = sample_info.idx_in_epoch
        segment = self._locate(sample_info.epoch_idx, i)
        j = i - segment.first
        index = int(segment.plan.indices[j])
        try:
            # Only the fields the pipeline takes: the others are neither read nor decoded.
            sample = self.store.read(index, self.fields)
        except StoreError:
            raise  # already names the dataset, shard and sample
        except Exception as exc:  # noqa: BLE001 - a worker error must name its sample
            raise StoreError(f"{self.store.root}: sample {index}: cannot be read: {exc!r}") from exc
        out = [convert(sample[name]) for name, convert in self._converters]
        out.append(np.array(segment.plan.is_pad[j]))
        if self.with_index:
            out.append(np.array(index, dtype=np.int64))
        if self.batch_inputs is not None:
            row = sample_info.idx_in_batch
            inputs = self._batch_inputs(sample_info.iteration, segment)
            out.extend(np.array(a[row]) for a in inputs)  # copies, 0-d stays 0-d
        return tuple(out)


@dataclass(frozen=True)
class _LeftBehind:
    """What a pickled :class:`StoreSource` carries instead of its sampling: the name, to say what is missing."""

    kind: str

    def order(self, *args: Any) -> np.ndarray:
        raise RuntimeError(
            f"this copy of the source was sent to a reader process without its {self.kind} (the orders come from "
            "the plan files the loader writes, loading/epoch_plan.py), and no plan was published for this epoch: "
            "publish it with EpochControl.publish(..., plan=source.indices(epoch, start)) before reading"
        )


def _forget_foreign_exception_reducers() -> None:
    """In a DALI worker, undo libraries' global pickling hooks for exceptions.

    ``distributed`` (Dask) installs tblib's reducers for every exception class at
    import; a worker forked from such a process would then pickle even the
    ``StopIteration`` that ends an epoch through tblib, and DALI's restricted
    unpickler refuses that, failing the epoch. Workers only ever send plain
    exceptions, so dropping those reducers in the worker is safe.
    """
    import copyreg

    for cls, reducer in list(copyreg.dispatch_table.items()):
        if (
            isinstance(cls, type)
            and issubclass(cls, BaseException)
            and getattr(reducer, "__module__", "").startswith("tblib")
        ):
            del copyreg.dispatch_table[cls]


def _as_uint8(value: bytes) -> np.ndarray:
    return np.frombuffer(value, dtype=np.uint8)


def dali_output_types(
    store: Store, fields: Sequence[str], with_index: bool = True, batch_inputs: Any = None
) -> tuple[list[Any], list[int]]:
    """``(dtypes, ndims)`` of a :class:`StoreSource`'s outputs, for ``fn.external_source``."""
    from nvidia.dali import types

    dtypes: list[Any] = []
    ndims: list[int] = []
    for name in fields:
        spec = store.fields[name]
        if spec.kind == "bytes":
            dtypes.append(types.UINT8)
            ndims.append(1)
        else:
            dtypes.append(getattr(types, DALI_TYPE_NAMES[spec.dtype]))
            ndims.append(len(spec.shape or ()))
    dtypes.append(types.BOOL)
    ndims.append(0)
    if with_index:
        dtypes.append(types.INT64)
        ndims.append(0)
    for _, dtype, ndim in batch_inputs.outputs if batch_inputs is not None else ():
        dtypes.append(getattr(types, DALI_TYPE_NAMES[dtype]))
        ndims.append(ndim)
    return dtypes, ndims
