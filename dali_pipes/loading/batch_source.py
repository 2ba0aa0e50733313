"""The batch-mode external source: one Python call per batch instead of one per sample.

:class:`BatchStoreSource` is what the loader gives DALI's
``fn.external_source(batch=True, batch_info=True)``: for ``BatchInfo(iteration,
epoch_idx)`` it reads the whole batch ``iteration`` of this rank's order with one
:meth:`Store.read_batch <dali_pipes.stores.Store.read_batch>` (each shard's
samples sorted and read together) and returns every output as a batch: a fixed
array field as one ``(B, *shape)`` array, bytes fields as lists of ``uint8``
arrays, then ``is_pad`` and ``index`` as ``(B,)`` arrays.

Each encoded image is copied once on its way to DALI, and no Python object is
made per sample: per-sample copies and objects were most of the feed's CPU cost. The store
copies a shard's records of the batch out of its memory map in one pass, into
one buffer (``read_batch(arrays=True)``, :func:`~dali_pipes.stores.base.packed`),
after checking them against their CRCs. Read in the loader's process, the
records go to DALI as a ``TensorListCPU`` of slices of those buffers, which the
external source takes with ``no_copy=True``; read in a DALI worker process, they
are copied into the shared memory that carries them to the loader's process.
Why not hand DALI views of the map and copy nothing: DALI reads a batch in its
own threads up to ``prefetch`` batches later, and a shard truncated meanwhile
would kill the process with SIGBUS where the store now raises its error
(``tests/test_store_faults.py``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dali_pipes.loading.sources import StoreSource
from dali_pipes.stores import StoreError

__all__ = ["BatchStoreSource"]


class BatchStoreSource(StoreSource):
    """A picklable batch-mode ``fn.external_source`` callable: ``BatchInfo`` -> one batch of every output."""

    def __call__(self, batch_info: Any) -> tuple[Any, ...]:
        lo = batch_info.iteration * self.batch_size
        segment = self._locate(batch_info.epoch_idx, lo)  # StopIteration past the end
        j = lo - segment.first  # a segment holds whole batches
        indices = np.array(segment.plan.indices[j : j + self.batch_size], dtype=np.int64)
        is_pad = segment.plan.is_pad[j : j + self.batch_size]
        if hasattr(self.store, "before_batch"):  # a streamed mixture: where in the plan (loading/mixture_stream.py)
            self.store.before_batch(segment.plan.epoch, segment.plan.start, j, indices, is_pad)
        elif hasattr(self.store, "before_read"):  # a streamed store pins the windows the batch reads (streaming.py)
            self.store.before_read(segment.plan.epoch, indices, is_pad)
        try:
            batch = self._read(indices)
        finally:
            if hasattr(self.store, "after_read"):  # a streamed store in a reader process is done with its shards
                self.store.after_read()
        out: list[Any] = []
        in_process = os.getpid() == self._owner_pid
        for name in self.fields:
            value = batch[name]
            if isinstance(value, np.ndarray):
                out.append(value)
            elif in_process and self.store.fields[name].kind == "bytes":
                from nvidia.dali.tensors import TensorListCPU  # imported when DALI runs: `import dali_pipes` must not

                # Slices of the buffers the store copied into: DALI takes them as they are (no_copy), and its
                # tensors keep them alive until it is done with them.
                out.append(TensorListCPU(value, "", False))
            else:
                out.append([np.asarray(v) for v in value])  # a DALI worker copies them into shared memory
        out.append(np.array(is_pad, dtype=bool))
        if self.with_index:
            out.append(indices)
        if self.batch_inputs is not None:
            out.extend(self._batch_inputs(batch_info.iteration, segment))
        return tuple(out)

    def _read(self, indices: np.ndarray) -> dict[str, Any]:
        try:
            return self.store.read_batch(indices, self.fields, arrays=True)
        except StoreError:
            raise  # already names the dataset, shard and sample
        except Exception as exc:  # noqa: BLE001 - a worker error must name its sample
            for index in indices.tolist():  # find the sample, as the per-sample source would name it
                try:
                    self.store.read(index, self.fields)
                except StoreError:
                    raise
                except Exception as sample_exc:  # noqa: BLE001
                    raise StoreError(f"{self.store.root}: sample {index}: cannot be read: {sample_exc!r}") from exc
            raise StoreError(f"{self.store.root}: samples {indices.tolist()}: cannot be read: {exc!r}") from exc
