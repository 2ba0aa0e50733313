"""Many processes read one dataset at once: nobody waits on anybody, nobody writes to the dataset.

Real shards of each format, four spawned reader processes and a DALILoader
(with a forked DALI worker) in the test process, all holding the same shards
open at the same moment (a barrier), reading every sample.

Why no reader takes a lock that another reader could wait on:

- LMDB shards are opened ``readonly=True, lock=False``: no lock file, no
  reader table, so no ``-lock`` file appears next to the shard and no reader
  slot can run out.
- HDF5 shards are opened with mode ``"r"`` and HDF5's default file locking *on*.
  For a read-only open HDF5 takes a *shared* ``flock`` (``LOCK_SH``), which any
  number of readers hold together; only a writer's exclusive lock conflicts,
  so a converter still writing a same-named file makes a reader fail at once
  instead of reading half a file. Turning locking off (``locking=False`` or
  ``HDF5_USE_FILE_LOCKING=FALSE``) buys nothing between readers and is only
  needed on filesystems without ``flock`` (some NFS mounts), where the
  environment variable applies to every opener alike; see
  :func:`dali_pipes.stores.hdf5.open_file`.
- TFRecord shards are plain ``O_RDONLY`` files read with ``pread``.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from pathlib import Path

import pytest

from dali_pipes import BatchFormat, DALILoader, RunOptions

from loader_helpers import TinySpec, read_every_sample, sample_digests, write_dataset

FORMATS = ("lmdb", "hdf5", "tfrecord")
READERS = 4
N = 24


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time (ns)."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            st = path.stat()
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", FORMATS)
def test_readers_in_many_processes_and_a_loader_share_a_dataset(tmp_path, fmt):
    path = write_dataset(tmp_path / "ds", N, fmt=fmt, samples_per_shard=6)
    expected = sample_digests(path)
    before = snapshot(path)

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(READERS + 1)  # the readers and this process's loader
    results = ctx.Queue()
    readers = [ctx.Process(target=read_every_sample, args=(str(path), barrier, results)) for _ in range(READERS)]
    for reader in readers:
        reader.start()
    try:
        loader = DALILoader(
            path,
            TinySpec(),
            batch_size=4,
            shuffle=False,
            run=RunOptions(device="cpu", py_num_workers=1),
            batch_format=BatchFormat(with_index=True),
        )
        iterator = iter(loader)
        seen = next(iterator)["index"].tolist()  # the loader's worker has the first shard open now
        barrier.wait(timeout=120)  # ... and so has every reader, all shards: nobody was refused
        for batch in iterator:
            seen += batch["index"].tolist()
        assert seen == list(range(N))
        got = {}
        for _ in readers:
            pid, digests = results.get(timeout=120)
            got[pid] = digests
        for reader in readers:
            reader.join(timeout=60)
            assert reader.exitcode == 0
    finally:
        for reader in readers:
            if reader.is_alive():
                reader.kill()
                reader.join()
    assert len(got) == READERS
    for pid, digests in got.items():
        assert digests == expected, f"reader {pid}: {digests if isinstance(digests, str) else 'other bytes'}"
    loader.close()
    # Readers left the dataset folder as they found it: no lock files, nothing written or touched.
    assert snapshot(path) == before


@pytest.mark.timeout(60)
def test_hdf5_readers_hold_shared_locks_only(tmp_path):
    # The locking claim above, checked with h5py directly: two read-only opens of one file coexist,
    # while a writer's open of a file a reader holds is refused at once (no waiting either way).
    import h5py

    from dali_pipes.stores.hdf5 import open_file

    path = write_dataset(tmp_path / "ds", 6, fmt="hdf5", samples_per_shard=6) / "shard-00000.h5"
    with open_file(path) as first:
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        for mode in ("r", "r+"):
            probe = ctx.Process(target=_open_in_child, args=(str(path), mode, results))
            probe.start()
            probe.join(timeout=60)
            try:
                outcome = results.get(timeout=5)
            except queue.Empty:
                outcome = "no answer"
            assert outcome == ("opened" if mode == "r" else "refused"), (mode, outcome)
        assert first.attrs["num_samples"] == 6
    with h5py.File(path, "r") as again:  # and nothing was left locked
        assert again.attrs["num_samples"] == 6


def _open_in_child(path: str, mode: str, results) -> None:
    import h5py

    try:
        with h5py.File(path, mode):
            results.put("opened")
    except OSError as exc:
        results.put("refused" if "lock" in str(exc).lower() else f"error: {exc}")
