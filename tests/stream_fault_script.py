"""One streaming run in a process of its own, for tests/test_streaming_faults.py (Ctrl-C, a full disk).

Reads its settings as JSON from stdin (so that the credentials are in no command line nor file):
``url``, ``storage`` (the storage_options), ``cache_limit``, ``folder`` (the cache folder),
``seed``, ``batch_size``, and optionally ``partitions`` and ``loaders`` (``StreamOptions``'), ``fsize`` (the most bytes any file it writes may take:
``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored, a disk that fills as the cache's writes see it) and
``state`` (a ``state_dict()`` to resume from). Streams one epoch, printing ``batch N`` after each
batch and writing ``out`` (JSON, replaced whole after each batch): the batches (indices, is_pad) and
the loader's state after the last of them; on an error, ``error`` and ``type`` too, and exits 1.
A ``KeyboardInterrupt`` is left to end the process as Python ends it, once the loader is closed: the time
(``time.time()``) the close ended is then in ``out`` + ``.closed``.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _write(path: str, report: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def _limit_file_size(size: int) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def main() -> int:
    settings = json.loads(sys.stdin.read())
    from dali_pipes import BatchFormat, DALILoader, DataOptions, RunOptions, StreamOptions

    from loader_helpers import TinySpec, quiet_dali_logs

    quiet_dali_logs()
    stream = StreamOptions(
        cache_limit=settings["cache_limit"],
        folder=settings["folder"],
        partitions=settings.get("partitions"),
        loaders=settings.get("loaders", 2),
    )
    data = DataOptions(stream=stream, storage_options=settings["storage"])
    run = RunOptions(device="cpu", py_num_workers=0)
    report: dict = {"batches": [], "state": None}
    if settings.get("fsize"):
        _limit_file_size(settings["fsize"])
    try:
        with DALILoader(
            settings["url"],
            TinySpec(),
            batch_size=settings["batch_size"],
            seed=settings["seed"],
            batch_format=BatchFormat(with_index=True),
            run=run,
            data=data,
        ) as loader:
            if settings.get("state"):
                loader.load_state_dict(settings["state"])
            for batch in loader:
                report["batches"].append([batch["index"].tolist(), batch["is_pad"].tolist()])
                report["state"] = loader.state_dict()
                _write(settings["out"], report)
                print(f"batch {len(report['batches'])}", flush=True)
    except KeyboardInterrupt:
        with open(f"{settings['out']}.closed", "w") as f:
            f.write(repr(time.time()))
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks the message
        _write(settings["out"], {**report, "error": str(exc), "type": type(exc).__name__})
        return 1
    _write(settings["out"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
