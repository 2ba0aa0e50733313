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
    cache = ShardCache(url, folder, limit, storage_options=options, tuning=CacheTuning(workers=workers))
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
