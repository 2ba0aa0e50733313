"""One rank of the scale-out suite (:mod:`dali_pipes.bench.scale_out`), a process of its own as torchrun starts one.

``python -m dali_pipes.bench.scale_out_rank CONFIG.json`` with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set: it joins a gloo process group,
reads ``epochs`` epochs of this package's streaming loader (``DALILoader`` with ``StreamOptions``, the
CPU device, ``ClassificationVal`` at a small size, ``BatchFormat(with_index=True)``) and writes what it saw to
``CONFIG["out"]`` as JSON (:func:`record_epochs`): per epoch the sample indices it read (padding left out),
the distinct labels of each full batch, its images and seconds and, on a node's first rank, the bytes the
node's latency proxy forwarded so far (:func:`~dali_pipes.bench.latency_proxy.read_count`; one proxy per
simulated node, so these are the node's downloads). All ranks meet at a barrier after each epoch, so the
counter is read when the whole job has finished the epoch (downloads fetched ahead of the next epoch before
then count in this one). The MosaicML Streaming rank (``python -m dali_pipes.bench.scale_out_mds rank
CONFIG.json``) uses the same loop with its own batches.

Nothing heavy is imported at module level: the MosaicML rank imports this module from its own environment.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

#: What a batch gives the loop: the sample indices read and their labels (padding left out), and whether the
#: batch was full (only full batches count for the classes a batch).
Batch = tuple[np.ndarray, np.ndarray, bool]
#: The cache's log line of a completed download (:mod:`dali_pipes.staging.stream_cache`), counted as a second meter.
DOWNLOADED = "cache %s: downloaded %s (%s)"


def init_group(config: dict[str, Any]) -> Any:
    """The gloo process group of ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``; ``torch.distributed``.

    A rank still running at ``config["dump_at"]`` (a ``time.time()``, shortly before the suite ends the row) writes
    every thread's stack to its log: a hang says where it hangs."""
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(max(1.0, config["dump_at"] - time.time()))

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=300))
    return dist


def node_leader() -> bool:
    """Whether this rank is its node's first (``LOCAL_RANK`` 0): it reads the node's proxy counter."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


class DownloadLog(logging.Handler):
    """Counts the shards this process's stream cache downloaded, from the cache's own log line."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.shards = 0
        logger = logging.getLogger("dali_pipes.staging.stream_cache")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        logger.propagate = False  # counted, not printed

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == DOWNLOADED:
            self.shards += 1


def record_epochs(
    config: dict[str, Any],
    epochs: Iterable[Iterator[Batch]],
    dist: Any,
    extra: Callable[[], dict[str, Any]] = dict,
    shards: Callable[[], int | None] = lambda: None,
) -> dict[str, Any]:
    """Read each epoch of ``epochs`` to its end, between barriers; what was read, per epoch (module docstring).

    ``shards()`` counts the shards downloaded so far by this process (``None``: not known; an epoch's figure is
    what it adds between the barriers); ``extra()`` adds
    the rank's figures once all epochs are read (the cache's peak and limit)."""
    counter = config["count_file"] if node_leader() else None
    dist.barrier()
    before, shards_before = _count(counter), shards()
    out: list[dict[str, Any]] = []
    for epoch, batches in enumerate(epochs):
        indices: list[np.ndarray] = []
        classes: list[int] = []
        start = time.perf_counter()
        for index, labels, full in batches:
            indices.append(np.asarray(index, dtype=np.int64))
            if full:
                classes.append(len(np.unique(labels)))
        seconds = time.perf_counter() - start
        dist.barrier()
        after, shards_after = _count(counter), shards()
        read = np.concatenate(indices) if indices else np.zeros(0, np.int64)
        out.append(
            {
                "epoch": epoch,
                "indices": read.tolist(),
                "classes": classes,
                "images": int(len(read)),
                "seconds": seconds,
                "bytes": None if counter is None else after[0] - before[0],
                "answers": None if counter is None else after[1] - before[1],
                "shards": None if shards_after is None else shards_after - (shards_before or 0),
            }
        )
        before, shards_before = after, shards_after
    return {"rank": dist.get_rank(), "node": int(os.environ["GROUP_RANK"]), "epochs": out, **extra()}


def _count(path: str | None) -> tuple[int, int]:
    if path is None:
        return 0, 0
    from dali_pipes.bench.latency_proxy import read_count

    return read_count(path)


def write_result(config: dict[str, Any], result: dict[str, Any]) -> None:
    """Write the rank's ``result`` where the suite reads it (whole: a temporary name, then renamed)."""
    out = Path(config["out"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


# --- this package's loader ------------------------------------------------------------------


def loader_epochs(loader: Any, epochs: int) -> Iterator[Iterator[Batch]]:
    """``epochs`` passes of ``loader`` as the loop's batches."""
    for _ in range(epochs):
        yield (_batch(batch, loader.batch_size) for batch in loader)


def _batch(batch: dict[str, Any], size: int) -> Batch:
    real = ~batch["is_pad"].numpy().astype(bool).reshape(-1)
    index = batch["index"].numpy().reshape(-1)[real]
    return index, batch["label"].numpy().reshape(-1)[real], bool(real.all()) and len(index) == size


def run_ours(config: dict[str, Any]) -> dict[str, Any]:
    """This package's streaming loader over ``config["url"]`` (see the module docstring)."""
    from dali_pipes import BatchFormat, ClassificationVal, DALILoader, DataOptions, RunOptions, StreamOptions

    dist = init_group(config)
    log = DownloadLog()
    stream = StreamOptions(cache_limit=config["cache_limit"], folder=config["folder"])
    data = DataOptions(stream=stream, storage_options=config["storage_options"])
    spec = ClassificationVal(size=config["out_size"], resize=config["out_size"])
    run = RunOptions(device="cpu", num_threads=1, py_num_workers=0)
    with DALILoader(
        config["url"],
        spec,
        batch_size=config["batch_size"],
        shuffle=True,
        seed=config["seed"],
        batch_format=BatchFormat(with_index=True),
        run=run,
        data=data,
    ) as loader:
        result = record_epochs(
            config, loader_epochs(loader, config["epochs"]), dist, lambda: _cache_figures(loader), lambda: log.shards
        )
    dist.barrier()
    dist.destroy_process_group()
    return result


def _cache_figures(loader: Any) -> dict[str, Any]:
    """The node's cache peak and limit (bytes) and the window, as the loader's stream cache tells them."""
    cache = getattr(loader, "cache", None)
    sampling = getattr(cache, "sampling", None)
    return {
        "peak": getattr(cache, "peak_bytes", None),
        "limit": getattr(cache, "limit_bytes", None),
        "window": getattr(sampling, "window", None),
    }


def main(argv: list[str]) -> int:
    """``CONFIG.json``: run the rank of this package's loader it describes and write its result."""
    config = json.loads(Path(argv[0]).read_text())
    write_result(config, run_ours(config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
