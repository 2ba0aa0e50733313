"""The storage suite's object-storage rows: staging a dataset from an S3 server on this machine.

A real S3-protocol server (moto's, ``python -m moto.server``, in a process of its own so that it
does not share this one's interpreter lock) is started on 127.0.0.1 and the dataset's files are
uploaded to it. Then the same files are brought back through a proxy that gives every answer the
first-byte latency of a real S3 region (:data:`LATENCY_MS`, 30 ms by default) and, optionally, each
connection a bandwidth cap (:data:`CONNECTION_MB_S`; none by default), since a server on the loopback
interface answers at once and parallel downloads gain nothing against it
(:mod:`dali_pipes.bench.latency_proxy`; ``DALI_PIPES_BENCH_S3_LATENCY_MS`` and
``DALI_PIPES_BENCH_S3_MB_S`` set them; 0 turns either off):

- ``s3fs get``: one file after another with s3fs's ``get_file``, as a script without dali-pipes would;
- ``s3 stage workers=N``: ``dali-pipes stage s3://... DEST`` with N parallel downloads (ranged reads,
  each file hash-checked against the manifest as it arrives).

Each row reports ``MB_s`` (the dataset's bytes over the seconds of the whole copy), the
``latency_ms`` and ``connection_MB_s`` it ran with, and, as its ``images/s``, the samples copied per second. The rows are skipped, saying why, without ``moto[server]``
and ``s3fs`` (the test extra), or for a merged ``.h5`` file (staged from a local path only).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from dali_pipes.bench.runner import Row, Timing

GET = "s3fs get"
WORKERS = (1, 4, 16)
#: First-byte latency added to every answer (ms), and the cap on one connection's MB/s (0: none).
LATENCY_MS = float(os.environ.get("DALI_PIPES_BENCH_S3_LATENCY_MS", "30"))
CONNECTION_MB_S = float(os.environ.get("DALI_PIPES_BENCH_S3_MB_S", "0"))
_KEYS = {"key": "bench-key", "secret": "bench-secret", "client_kwargs": {"region_name": "eu-west-1"}}


def row_names() -> list[str]:
    return [GET] + [f"s3 stage workers={n}" for n in WORKERS]


def s3_stage_rows(dataset: Path, num_samples: int, repeats: int = 1) -> list[Row]:
    """One row per way of bringing the dataset back from a local S3 server (see the module docstring)."""
    via = f", each answer's first byte {LATENCY_MS:g} ms late" + (
        f", {CONNECTION_MB_S:g} MB/s per connection" if CONNECTION_MB_S else ""
    )
    rows = [Row(GET, f"s3fs get_file of each file, one after another{via}")]
    rows += [
        Row(f"s3 stage workers={n}", f"dali-pipes stage s3://... with {n} parallel download(s){via}") for n in WORKERS
    ]
    why = missing(dataset)
    if why:
        for row in rows:
            row.skipped = why
        return rows
    try:
        with local_s3(dataset) as (url, size, options):
            for row in rows:
                seconds = [_time(row.name, url, options) for _ in range(repeats)]
                row.timing = Timing(tuple(num_samples / s for s in seconds), num_samples * repeats, sum(seconds))
                row.extra.update(
                    MB_s=round(size / 1e6 / min(seconds), 1), latency_ms=LATENCY_MS, connection_MB_s=CONNECTION_MB_S
                )
    except Exception as exc:  # noqa: BLE001 - a failing row is shown, the others still run
        for row in rows:
            if row.timing is None:
                row.error = f"{type(exc).__name__}: {exc}"
    return rows


def missing(dataset: Path) -> str | None:
    """Why the S3 rows cannot run here (the test extra missing, or a merged ``.h5`` file); ``None`` when they can."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return 'needs moto[server] and s3fs: pip install -e ".[test]"'
    if not dataset.is_dir():
        return "a merged .h5 file is staged from a local path only"
    return None


@contextlib.contextmanager
def local_s3(dataset: Path) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """``(url, bytes, storage_options)``: ``dataset`` uploaded to a local S3 server, read back through the latency proxy.

    The server and the proxy run while the block does; ``bytes`` is the dataset's size, and the
    ``storage_options`` (no secret of any account: the server takes any key) reach it through the proxy."""
    with s3_server() as port, latency_proxy(port) as proxy_port:
        url, size = upload(dataset, server_options(port))
        yield url, size, server_options(proxy_port)


def server_options(port: int) -> dict[str, Any]:
    """s3fs storage options for the local server (or a proxy) on ``port``: any key does, none is a secret."""
    return {"endpoint_url": f"http://127.0.0.1:{port}", "skip_instance_cache": True, **_KEYS}


@contextlib.contextmanager
def latency_proxy(upstream: int, count_file: str | os.PathLike | None = None) -> Iterator[int]:
    """The latency proxy (a process of its own) in front of ``127.0.0.1:upstream``; the port it listens on.

    With ``count_file`` the proxy keeps the bytes it forwarded to clients there
    (:func:`~dali_pipes.bench.latency_proxy.read_count`)."""
    args = [str(upstream), str(LATENCY_MS), str(CONNECTION_MB_S)] + ([str(count_file)] if count_file else [])
    process = subprocess.Popen(
        [sys.executable, "-m", "dali_pipes.bench.latency_proxy", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        if not line.strip().isdigit():
            raise RuntimeError("the latency proxy did not start")
        yield int(line)
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextlib.contextmanager
def s3_server() -> Iterator[int]:
    """``python -m moto.server`` on a free loopback port; the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the local S3 server (moto) did not start") from None
                time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def upload(dataset: Path, options: dict[str, Any], name: str = "ds") -> tuple[str, int]:
    """Put ``dataset``'s files into ``name/`` of the bucket ``bench`` of the server ``options`` name: ``(its URL, its
    bytes)``."""
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    if not fs.exists("bench"):
        fs.mkdir("bench")
    fs.put(f"{dataset}/", f"bench/{name}/", recursive=True)
    size = sum(p.stat().st_size for p in dataset.rglob("*") if p.is_file() and not p.name.startswith("."))
    return f"s3://bench/{name}", size


def _time(name: str, url: str, options: dict[str, Any]) -> float:
    """Seconds to bring the dataset at ``url`` into a new temporary folder the way row ``name`` does."""
    import s3fs

    from dali_pipes.staging.stage import stage_dataset

    dest = Path(tempfile.mkdtemp(prefix="dali-pipes-bench-s3-"))
    try:
        start = time.perf_counter()
        if name == GET:
            fs = s3fs.S3FileSystem(**options)
            for path in sorted(fs.find(url.removeprefix("s3://"))):
                fs.get_file(path, str(dest / Path(path).name))
        else:
            stage_dataset(url, dest, workers=int(name.rsplit("=", 1)[1]), storage_options=options, progress=False)
        return time.perf_counter() - start
    finally:
        shutil.rmtree(dest, ignore_errors=True)


__all__ = [
    "CONNECTION_MB_S",
    "GET",
    "LATENCY_MS",
    "WORKERS",
    "latency_proxy",
    "local_s3",
    "missing",
    "row_names",
    "s3_server",
    "server_options",
    "s3_stage_rows",
    "upload",
]
