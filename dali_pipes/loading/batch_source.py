"""The batch-mode external source: one Python call per batch instead of one per sample.

:class:`BatchStoreSource` is what the loader gives DALI's
``fn.external_source(batch=True, batch_info=True)``: for ``BatchInfo(iteration,
epoch_idx)`` it reads the whole batch ``iteration`` of this rank's order with one
:meth:`Store.read_batch <dali_pipes.stores.Store.read_batch>` (each shard's
samples sorted and read together) and returns every output as a batch: a fixed
array field as one ``(B, *shape)`` array, bytes fields as lists of ``uint8``
arrays, then ``is_pad`` and ``index`` as ``(B,)`` arrays.

Everything else is :class:`~dali_pipes.loading.sources.StoreSource`'s: the epoch plan
(shared by the loader, see :mod:`dali_pipes.loading.epoch_plan`), the padding to whole
batches, the end of an epoch and cancellation by ``StopIteration``. Batch
``iteration`` holds exactly the samples ``iteration * B .. (iteration + 1) * B - 1``
the per-sample source would have returned, in the same order. A read error
names the sample (:meth:`Store.read_batch` reads a failing shard again sample
by sample to find it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dali_pipes.loading.sources import _CANCELLED, _DALI_EPOCH, StoreSource
from dali_pipes.stores import StoreError

__all__ = ["BatchStoreSource"]


class BatchStoreSource(StoreSource):
    """A picklable batch-mode ``fn.external_source`` callable: ``BatchInfo`` -> one batch of every output."""

    def __call__(self, batch_info: Any) -> tuple[Any, ...]:
        dali_epoch = batch_info.epoch_idx
        if dali_epoch != self._dali_epoch:
            self._load_plan(dali_epoch)
        values = self._values
        lo = batch_info.iteration * self.batch_size
        if lo >= len(self._indices) or values[_CANCELLED] or values[_DALI_EPOCH] != dali_epoch:
            raise StopIteration
        indices = np.array(self._indices[lo : lo + self.batch_size], dtype=np.int64)
        batch = self._read(indices)
        out: list[Any] = []
        for name, convert in self._converters:
            value = batch[name]
            out.append(value if isinstance(value, np.ndarray) else [convert(v) for v in value])
        out.append(np.array(self._is_pad[lo : lo + self.batch_size], dtype=bool))
        if self.with_index:
            out.append(indices)
        if self.batch_inputs is not None:
            out.extend(self._batch_inputs(batch_info.iteration))
        return tuple(out)

    def _read(self, indices: np.ndarray) -> dict[str, Any]:
        try:
            return self.store.read_batch(indices, self.fields)
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
