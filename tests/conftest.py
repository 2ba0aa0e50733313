"""Shared test fixtures: paths to the real sample photos (``dali_pipes/sample_data``), and skipping of GPU tests without CUDA.

``DALI_PIPES_TEST_DRIVER_INITIALISED=1 python -m pytest ...`` runs the tests as on a CUDA machine,
where every process has initialised the CUDA driver (``torch.cuda.is_available()`` does) and so
every loader's DALI workers spawn instead of forking: DALI's driver test says True in this
process and, through ``tests/driver_initialised/sitecustomize.py``, in every Python process the
tests start. CI reruns that way the tests marked ``driver_init`` (``-m driver_init``).
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import pytest

from dali_pipes import sample_data

DRIVER_INITIALISED = os.environ.get("DALI_PIPES_TEST_DRIVER_INITIALISED") == "1"

# DALI's own CPU resize in this process and every process the tests start, unless the environment chooses: the
# Numba resize compiles for about 5 CPU seconds per size in each process (each example, CLI run and DDP rank), which
# on tiny test data costs far more than it saves. The tests whose point is the Numba resize ask for it (the
# `numba_resize` fixture; tests/test_cpu_resize_ddp.py's scripts clear the variable). DALI_PIPES_CPU_RESIZE=numba
# runs the whole suite with it.
os.environ.setdefault("DALI_PIPES_CPU_RESIZE", "dali")
if DRIVER_INITIALISED:
    _site = str(Path(__file__).resolve().parent / "driver_initialised")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_site, os.environ.get("PYTHONPATH")) if p)
    import nvidia.dali.backend as _backend

    _backend.IsDriverInitialized = lambda: True


def pytest_report_header(config):
    if DRIVER_INITIALISED:
        return "DALI_PIPES_TEST_DRIVER_INITIALISED=1: DALI's driver test says True in every process (workers spawn)"
    return None


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_finish(session):
    """Everything imported by collection (every test module, torch, DALI) out of the garbage collector's sight.

    A full collection walks every tracked object: about 0.3 CPU seconds here once the test modules are imported,
    paid at every loader whose workers fork (``DALILoader`` collects before it forks them), every benchmark row
    and every ``gc.collect()`` of a test. Those objects live for the whole session anyway; what the tests create
    and drop is still collected. Garbage is collected first, so nothing unreachable is kept.
    """
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` on machines without CUDA, saying why."""
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA and a GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _package_log_level():
    """The package's log level as each test found it: one that quietens it (``quiet_dali_logs``) does not hide
    the records a later test of the same process checks."""
    logger = logging.getLogger("dali_pipes")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.fixture
def numba_resize(monkeypatch):
    """The CPU pipelines' Numba resize, the library's default, for a test about it (see the note at the top)."""
    monkeypatch.setenv("DALI_PIPES_CPU_RESIZE", "numba")


@pytest.fixture(scope="session")
def imagenet_mini() -> Path:
    """The 47 real ImageNet-style photos of the package's sample data (read-only)."""
    return sample_data.imagenet_mini()


@pytest.fixture(scope="session")
def coco_mini() -> Path:
    """The 61 real COCO-style photos with instances.json of the package's sample data (read-only)."""
    return sample_data.coco_mini()


# --- shard formats: real photo bytes and a dataset writer without the runner -------------


@pytest.fixture(scope="session")
def photo_bytes(imagenet_mini: Path, coco_mini: Path) -> list[bytes]:
    """A few real encoded photos: 8 ImageNet JPEGs, then 3 COCO PNGs (RGBA among them)."""
    jpegs = sorted(p for p in imagenet_mini.glob("*/*") if p.suffix.lower() in (".jpg", ".jpeg"))[:8]
    pngs = sorted((coco_mini / "images").glob("*.png"))[:3]
    if len(jpegs) < 8 or len(pngs) < 3:
        pytest.fail(f"sample data incomplete: {len(jpegs)} JPEGs in {imagenet_mini}, {len(pngs)} PNGs in {coco_mini}")
    return [p.read_bytes() for p in jpegs + pngs]


@pytest.fixture
def write_dataset():
    """A function ``(root, fmt, fields, samples, per_shard=...) -> root`` that writes a dataset folder.

    Shards go through the format's writer directly and ``index.json`` through
    :func:`~dali_pipes.dataset.manifest.write_manifest`, without the parallel runner.
    """
    from converters.writers import writer_class
    from dali_pipes.dataset.fileio import sha256_file
    from dali_pipes.dataset.manifest import Manifest, Shard, write_manifest

    def write(root: Path, fmt: str, fields, samples, per_shard: int = 4, classes=None) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        cls = writer_class(fmt)
        shards = []
        for number, start in enumerate(range(0, len(samples), per_shard)):
            path = root / f"shard-{number:05d}{cls.suffix}"
            with cls(path, fields) as writer:
                for sample in samples[start : start + per_shard]:
                    writer.write(sample)
            index = writer.index_path()
            shards.append(
                Shard(
                    path=path.name,
                    num_samples=writer.num_samples,
                    bytes=path.stat().st_size,
                    sha256=sha256_file(path),
                    index_path=index.name if index else None,
                    index_sha256=sha256_file(index) if index else None,
                )
            )
        manifest = Manifest(format=fmt, fields=fields, shards=shards, source={"kind": "test"}, classes=classes)
        write_manifest(root, manifest)
        return root

    return write


# --- object storage: a real S3-protocol server on the loopback interface -------------------


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a free port) behind a fault-injecting proxy (tests/s3_helpers.py)."""
    pytest.importorskip("moto.server", reason="the test extra's moto[server] is not installed")
    pytest.importorskip("s3fs", reason="the test extra's s3fs is not installed")
    from s3_helpers import S3Server

    server = S3Server()
    yield server
    server.close()


@pytest.fixture
def s3(s3_server):
    """The session's S3 server with no faults left from an earlier test."""
    s3_server.proxy.clear()
    yield s3_server
    s3_server.proxy.clear()


@pytest.fixture
def s3_env(s3, monkeypatch):
    """Credentials and endpoint where users keep theirs (the environment), inherited by the worker processes."""
    from s3_helpers import ACCESS_KEY

    for name, value in dict(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY="testsecret",
        AWS_DEFAULT_REGION="eu-west-1",
        AWS_ENDPOINT_URL=s3.proxy.url,
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
    ).items():
        monkeypatch.setenv(name, value)
    return s3
