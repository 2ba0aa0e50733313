"""Processes of one node sharing a :class:`~dali_pipes.staging.stream_cache.ShardCache` folder, for
tests/test_stream_cache.py: started with ``spawn``, as DDP ranks are, each opening its own cache."""

from __future__ import annotations

import json
import logging


class _Seen(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fetch_in_process(url, folder, limit, options, shards, out, start=None, pin=False, workers=4, fsize=None) -> None:
    """Open the cache, wait for ``start`` (a barrier), pin ``shards`` if asked, fetch them, and write to the file
    ``out`` what happened: ``{"error": message or None, "waited": whether it waited for another process's
    download, "log": the cache's log lines}``. ``fsize`` limits the size of any file this process writes
    (``RLIMIT_FSIZE``, ``SIGXFSZ`` ignored): a disk that fills, as writes see it."""
    from dali_pipes.staging.stream_cache import CacheTuning, ShardCache

    seen = _Seen()
    logger = logging.getLogger("dali_pipes.staging")
    logger.addHandler(seen)
    logger.setLevel(logging.INFO)
    result = {"error": None}
    cache = ShardCache(url, folder, limit, storage_options=options, tuning=CacheTuning(downloads=workers))
    if start is not None:
        start.wait(60)
    if fsize is not None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, limits[1]))
    try:
        if pin:
            cache.pin(shards)
        cache.fetch(shards)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks the message
        result["error"] = str(exc)
    if fsize is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    result["waited"] = any("another process is downloading" in line for line in seen.lines)
    result["log"] = seen.lines
    with open(out, "w") as f:
        json.dump(result, f)
    cache.close()


def fork_mid_download(url, folder, limit, options, shard, out) -> None:
    """Fetch ``shard`` in a thread and, once its download has begun (a temporary in ``folder``), fork a child that
    lives on (sleeping); write the child's pid to ``out``, then wait to be killed."""
    import os
    import threading
    import time
    from pathlib import Path

    from dali_pipes.staging.checked import TMP_PREFIX
    from dali_pipes.staging.stream_cache import ShardCache

    cache = ShardCache(url, folder, limit, storage_options=options)
    threading.Thread(target=cache.fetch, args=([shard],), daemon=True).start()
    deadline = time.monotonic() + 60
    while not list(Path(folder).glob(f"{TMP_PREFIX}*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    child = os.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    with open(f"{out}.tmp", "w") as f:
        f.write(str(child))
    os.replace(f"{out}.tmp", out)
    time.sleep(120)


def solo_stream(index: int, url: str, out_dir: str, options: dict) -> None:
    """A job of one rank (``world_size=1``: a sweep's single-GPU job) streaming one epoch of ``url`` with seed
    ``index`` from the node's cache folder (``DALI_PIPES_CACHE``, inherited); writes ``out_dir/job-INDEX.json``:
    the real indices read, and the cache's peak and limit."""
    import os

    from dali_pipes import BatchFormat, DALILoader, DataOptions, RunOptions, StreamOptions

    from loader_helpers import TinySpec, batch_rows, quiet_dali_logs

    quiet_dali_logs()
    data = DataOptions(stream=StreamOptions(**options["stream"]), storage_options=options["storage"])
    run = RunOptions(device="cpu", py_num_workers=0)
    with DALILoader(
        url, TinySpec(), batch_size=8, seed=index, batch_format=BatchFormat(with_index=True), run=run, data=data
    ) as loader:
        real = [row[0] for batch in loader for row in batch_rows(batch) if not row[2]]
        report = {"real": real, "peak": loader.cache.peak_bytes, "limit": loader.cache.limit_bytes}
    with open(os.path.join(out_dir, f"job-{index}.json"), "w") as f:
        json.dump(report, f)
