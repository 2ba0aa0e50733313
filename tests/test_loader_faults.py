"""Faults the loader meets while training: shards damaged after conversion, and worker processes that die.

Every test uses real shards (LMDB, HDF5, TFRecord files written by the
writers), a real DALI pipeline on the CPU and real processes; the damage is
done to the files on disk, the deaths with real signals. What each test asks is
that the loader *raises*, within a timeout, an error that names what is wrong
and what to do, and never yields garbage or hangs.

What is detectable, and by whom (a flipped byte is not always detectable):

- ``flip``: the first four bytes of one sample's JPEG (its SOI and APP0
  markers) are zeroed inside the shard file; ``scribble``: the middle of its
  entropy-coded data is overwritten, markers kept, so that a decoder usually
  decodes it into a damaged picture without a word. Every record carries a
  checksum that each read checks (TFRecord's own CRC per record; a CRC32C per
  field of each sample in LMDB and HDF5), so the store itself catches both.
- ``truncate``: the shard is cut to half. Caught when the shard is opened: LMDB
  by its last page, HDF5 by its end-of-file address, TFRecord by its index's
  last record.
- ``delete``: caught when the shard is opened (the file is missing).
- ``swap``: the shard (and its ``.idx``) is replaced by the same-named shard of
  another dataset with a different record count. Caught when the shard is
  opened: its count (LMDB's ``__len__`` record, HDF5's ``num_samples``
  attribute, the TFRecord index's lines) disagrees with the manifest.

Those marked ``driver_init`` run again with the loader's workers spawned (tests/README.md).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from dali_pipes import BatchFormat, DALILoader, LoaderError, RunOptions, StoreError
from dali_pipes.loading.loader import ShardReadError, WorkerDiedError

from loader_helpers import (
    DAMAGES,
    TinySpec,
    damage_shard,
    ddp_worker,
    free_port,
    shard_name,
    skip_if_fork_refused,
    wait_until_dead,
    write_dataset,
)

FORMATS = ("lmdb", "hdf5", "tfrecord")
N = 12
PER_SHARD = 5  # shard 1 holds samples 5..9


def make(path, *, batch_size: int = 4, **run):
    """A loader of TinySpec over ``path`` in dataset order, with ``index``, on the CPU with ``run``'s options."""
    return DALILoader(
        path,
        TinySpec(),
        batch_size=batch_size,
        shuffle=False,
        run=RunOptions(device="cpu", **run),
        batch_format=BatchFormat(with_index=True),
    )


def expected_error(fmt: str, how: str) -> tuple[type[BaseException], str]:
    """The exception type and message pattern the loader must raise for ``how`` damage to shard 1."""
    shard = shard_name(fmt, 1).replace(".", r"\.")
    damaged_record = how in ("flip", "scribble")
    sample, record = (6, 1) if damaged_record else (5, 0)
    crc = "data CRC mismatch" if fmt == "tfrecord" else r"field 'image' fails its record CRC32C check"
    reason = {
        "flip": crc,
        "scribble": crc,
        "truncate": "truncated",
        "delete": "missing",
        "swap": r"(holds 6|lists 6 records).*the manifest says 5",
    }[how]
    return ShardReadError, (
        rf"sample {sample} \(shard {shard}, record {record}\): .*{reason}.*Run 'dali-pipes verify .*' and re-convert "
        r"the damaged shard\. \[rank 0, epoch 0, batch [01] or later\]"
    )


@pytest.fixture(scope="module")
def other_datasets(tmp_path_factory):
    """Per format, a different dataset whose shard 1 holds 6 samples (the swap's source)."""
    root = tmp_path_factory.mktemp("other")
    return {fmt: write_dataset(root / fmt, N, fmt=fmt, samples_per_shard=6) for fmt in FORMATS}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fmt, how, workers",
    [
        # Rerun with spawned workers (driver_init): one damage per format, read in a worker.
        pytest.param(fmt, how, workers, marks=[pytest.mark.driver_init] if workers and how == "truncate" else [])
        for fmt in FORMATS
        for how in DAMAGES
        for workers in (0, 2)
    ],
)
def test_a_shard_damaged_after_conversion_raises_naming_shard_and_sample(tmp_path, other_datasets, fmt, how, workers):
    path = write_dataset(tmp_path / "ds", N, fmt=fmt, samples_per_shard=PER_SHARD)
    loader = make(path, py_num_workers=workers)
    # After the loader exists, as on a shared disk: shards are opened lazily, at their first read.
    damage_shard(path, fmt, how, shard=1, sample=6, other=other_datasets[fmt])
    error, message = expected_error(fmt, how)
    seen = []
    with pytest.raises(error, match=message) as raised:
        for batch in loader:
            seen.extend(batch["index"].tolist())
    assert isinstance(raised.value, LoaderError)  # one type to catch for every failure of the loader
    if error is ShardReadError:
        assert isinstance(raised.value, StoreError)  # and still what the store raised
    # Batch 0 (samples 0..3, shard 0) is whole, and may come out before DALI reports batch 1's
    # failure, depending on how far ahead it had prepared; nothing from the damaged batch did.
    assert seen in ([], [0, 1, 2, 3])
    with pytest.raises(LoaderError, match="failed earlier"):
        iter(loader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_shard_of_the_right_count_but_another_size_is_refused_on_open(tmp_path, fmt):
    # A shard swapped for one with as many records but other content: only the manifest's
    # byte count tells (one stat, when the shard is opened); same-sized swaps need 'verify'.
    path = write_dataset(tmp_path / "ds", N, fmt=fmt, samples_per_shard=PER_SHARD)
    name = shard_name(fmt, 1)
    target = path / name
    if fmt == "tfrecord":
        # Append a whole extra record: the index still matches the first five, the size does not.
        raw = target.read_bytes()
        first = Path(str(target) + ".idx").read_text().splitlines()[0].split()
        target.write_bytes(raw + raw[int(first[0]) : int(first[0]) + int(first[1])])
    else:
        # Same file, grown: a different file of the right count, as far as any count can tell.
        with open(target, "ab") as f:
            f.write(bytes(4096))
    loader = make(path, py_num_workers=0)
    with pytest.raises(ShardReadError, match=rf"sample 5 \(shard {name}, record 0\): .*manifest says \d+: it was "):
        list(loader)


# --- a worker process that dies ------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("workers") / "ds", 60, samples_per_shard=20)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_worker_killed_between_batches_raises_worker_died(big_dataset, start_method):
    """SIGKILL a worker while the training thread is between batches.

    Without the loader's check, DALI 2.4 usually hangs here for ever (the dead
    worker was asleep on the task queue, and the next batch's ``put`` waits in
    ``Condition.notify`` for it to wake); when its observer thread wins the
    race it raises a bare "Worker data receiving interrupted" instead.
    """
    if start_method == "fork":
        skip_if_fork_refused()
    loader = make(big_dataset, batch_size=2, py_num_workers=2, py_start_method=start_method)
    pids = loader.worker_pids
    assert len(pids) == 2 and os.getpid() not in pids
    iterator = iter(loader)
    assert next(iterator)["index"].tolist() == [0, 1]
    os.kill(pids[1], signal.SIGKILL)
    wait_until_dead(pids[1])
    started = time.monotonic()
    with pytest.raises(
        WorkerDiedError, match=rf"worker process {pids[1]} \(worker 1 of 2\) was killed by SIGKILL"
    ) as e:
        # The survivor may read every batch left in this epoch before the kernel has reaped the killed worker
        # (a killed process stays unwaitable until all its threads are gone: seen under load); DALI then reads
        # on into the next epoch, which needs the dead worker: noticed there at the latest.
        for _ in iterator:
            pass
        for _ in loader:
            pass
    assert time.monotonic() - started < 60  # noticed, not hung (WATCH_INTERVAL; generous for a loaded machine)
    message = str(e.value)
    assert str(big_dataset) in message and "resume from the last state_dict()" in message
    assert re.search(r"epoch [01], batch ", message)
    with pytest.raises(LoaderError, match="failed earlier.*was killed by SIGKILL"):
        iter(loader)
    # The pool is gone: the surviving worker was stopped too.
    for pid in pids:
        wait_until_dead(pid)
    loader.close()


@pytest.mark.driver_init
@pytest.mark.timeout(180)
def test_a_worker_killed_while_the_loader_waits_on_dali_raises_worker_died(big_dataset):
    """SIGKILL a worker while the training thread is inside a DALI call that cannot finish.

    Both workers are stopped (SIGSTOP) first, so the next call into DALI blocks
    (DALI's ``put`` waits for a sleeping worker to wake); then one is killed
    and the other let go. The dead worker's semaphore is never released, so
    that DALI call never returns; the loader notices the death within
    ``WATCH_INTERVAL`` and raises, leaving the stuck call in its helper thread.
    """
    loader = make(big_dataset, batch_size=2, py_num_workers=2)
    pids = loader.worker_pids
    iterator = iter(loader)
    next(iterator)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)

    def kill_later() -> None:
        time.sleep(1.0)
        os.kill(pids[0], signal.SIGKILL)
        time.sleep(0.5)
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass

    killer = threading.Thread(target=kill_later)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(WorkerDiedError, match=rf"worker process {pids[0]} \(worker 0 of 2\) was killed by SIGKILL"):
            for _ in iterator:
                pass
    finally:
        killer.join()
        for pid in pids:  # never leave a stopped process behind, whatever happened
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert 0.9 < time.monotonic() - started < 60  # it did block, and it did not hang
    loader.close()


@pytest.mark.driver_init
@pytest.mark.timeout(180)
def test_a_worker_that_exits_by_itself_is_named_with_its_status(big_dataset):
    loader = make(big_dataset, batch_size=2, py_num_workers=1)
    iterator = iter(loader)
    next(iterator)
    (pid,) = loader.worker_pids
    os.kill(pid, signal.SIGTERM)  # as a scheduler or a user's `kill` would
    wait_until_dead(pid)
    with pytest.raises(WorkerDiedError, match=rf"worker process {pid} \(worker 0 of 1\) was killed by SIGTERM"):
        list(iterator)


@pytest.mark.driver_init
@pytest.mark.timeout(180)
def test_healthy_workers_are_not_reported(big_dataset):
    # The watch must not misfire: three whole epochs with workers, the same samples every time.
    loader = make(big_dataset, batch_size=4, py_num_workers=2)
    for _ in range(3):
        assert sorted(i for b in loader for i in b["index"].tolist()) == list(range(60))
    pids = loader.worker_pids
    loader.close()
    for pid in pids:  # close() stops them
        wait_until_dead(pid)


# --- DDP: every rank reads the damaged shard ------------------------------------------------------


def _two_ranks_raise_shard_read_error(dataset, out, options) -> None:
    """Run two spawned gloo ranks of ``ddp_worker`` over ``dataset``; the job must end with a ShardReadError."""
    with pytest.raises(mp.ProcessRaisedException, match="ShardReadError"):
        mp.start_processes(
            ddp_worker,
            args=(2, free_port(), str(dataset), str(out), options),
            nprocs=2,
            join=True,
            start_method="spawn",
        )


def _one_format_by_default(default: str) -> list:
    """``FORMATS`` with all but ``default`` marked slow: what a DDP job does with a rank's error is the same for every
    format, and each format's own message is checked for every damage by the single-process test above."""
    return [pytest.param(fmt, marks=[] if fmt == default else [pytest.mark.slow]) for fmt in FORMATS]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", _one_format_by_default("hdf5"))
def test_ddp_ranks_reading_a_truncated_shard_all_raise_naming_it(tmp_path, fmt):
    """Two gloo ranks; shard 0 (samples 0..6) is truncated; both read it in their first step.

    Without shuffling, rank 0 reads samples 0, 1, 2 and rank 1 samples 3, 4, 5
    first: each rank must end with its own error naming the shard and its first
    sample, and the job must end, not hang in a collective.
    """
    dataset = write_dataset(tmp_path / "ds", 12, fmt=fmt, samples_per_shard=7)
    damage_shard(dataset, fmt, "truncate", shard=0, sample=0)
    out = tmp_path / "out"
    out.mkdir()
    options = {"batch_size": 3, "epochs": 1, "workers": 1, "shuffle": False}
    _two_ranks_raise_shard_read_error(dataset, out, options)
    name = shard_name(fmt, 0)
    for rank, sample in ((0, 0), (1, 3)):
        message = (out / f"rank-{rank}.error").read_text()
        assert f"sample {sample} (shard {name}, record {sample}): " in message
        assert "truncated" in message and "dali-pipes verify" in message
        assert f"[rank {rank}, epoch 0, batch 0 or later]" in message
    assert not list(out.glob("rank-*.json"))  # no rank finished the epoch as if nothing happened


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", _one_format_by_default("tfrecord"))
def test_ddp_ranks_reading_damaged_records_all_raise_naming_them(tmp_path, fmt):
    """Two gloo ranks with two workers each; one record of each rank's first batch is damaged in place.

    The images still decode (``scribble`` keeps the JPEG markers): only the
    record checksums can tell, and each rank must raise naming its own sample,
    and yield nothing from it.
    """
    dataset = write_dataset(tmp_path / "ds", 12, fmt=fmt, samples_per_shard=7)
    for sample in (1, 4):  # rank 0 reads samples 0, 1, 2 first; rank 1 samples 3, 4, 5
        damage_shard(dataset, fmt, "scribble", shard=0, sample=sample)
    out = tmp_path / "out"
    out.mkdir()
    options = {"batch_size": 3, "epochs": 1, "workers": 2, "shuffle": False}
    _two_ranks_raise_shard_read_error(dataset, out, options)
    name = shard_name(fmt, 0)
    crc = "data CRC mismatch" if fmt == "tfrecord" else "fails its record CRC32C check"
    for rank, sample in ((0, 1), (1, 4)):
        message = (out / f"rank-{rank}.error").read_text()
        assert f"sample {sample} (shard {name}, record {sample}): " in message
        assert crc in message and "dali-pipes verify" in message
        assert f"[rank {rank}, epoch 0, batch 0 or later]" in message
    assert not list(out.glob("rank-*.json"))
