"""A Ctrl-C that arrives while HDF5 is inside a write of the guarded file ends the shard or the merge cleanly.

HDF5 writes an HDF5 shard (and a merge) through a Python file object, so a SIGINT can land in Python code that
HDF5 itself called. Left alone, the KeyboardInterrupt raised there is swallowed (``Exception ignored in:
'h5py._objects.ObjectID.__dealloc__'``: the Ctrl-C is lost) or becomes a failed write, and the process dies of a
segmentation fault when the file closes: seen in CI as ``exit -11 after Ctrl-C`` of a one-worker HDF5
conversion. Here the signal is sent at an exact write (the real ``SIGINT``, raised from inside that write), in
a child process, so that a crash fails the test instead of ending the suite.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dali_pipes.dataset.manifest import Field

#: Run first in each child: the ``AT``-th write HDF5 makes through the guarded file gets a real SIGINT.
_CTRL_C_AT_WRITE = """
import signal, sys
from converters.writers import _h5file

# As a shell starts a program: Ctrl-C raises. A pytest worker may pass on SIGINT ignored, which a child inherits
# (seen once in a full run: exit 0, the Ctrl-C never came; Lightning's Trainer, for one, ignores SIGINT for good after
# a KeyboardInterrupt).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

AT = int(sys.argv[1])
writes = 0
_write = _h5file.GuardedFile.write

def write_with_ctrl_c(self, data):
    global writes
    writes += 1
    if writes == AT:
        signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C, while HDF5 is inside this write
    return _write(self, data)

_h5file.GuardedFile.write = write_with_ctrl_c
"""

#: 9,000 samples of 1 KiB fixed rows: the writer flushes its first 8 MiB of rows to HDF5 at sample 8,191
#: (about 130 writes), the rest and the ragged field when it closes.
_WRITE_SHARD = (
    _CTRL_C_AT_WRITE
    + """
import numpy as np
from converters.writers.hdf5 import Hdf5ShardWriter
from dali_pipes.dataset.manifest import Field

fields = {"blob": Field.array("uint8", (-1,)), "row": Field.array("float32", (256,))}
writer = Hdf5ShardWriter(sys.argv[2], fields)
sample = -1
try:
    for sample in range(9000):
        writer.write({"blob": np.full(sample % 7, 3, np.uint8), "row": np.full(256, sample, np.float32)})
    sample, before_close = "close", writes
    writer.close()
except KeyboardInterrupt:
    writer.abort()
    print(f"interrupted at sample {sample}, write {writes}", flush=True)
    sys.exit(130)
print(f"finished: {before_close} writes, then {writes - before_close} in close")
"""
)

_MERGE = (
    _CTRL_C_AT_WRITE
    + """
from converters.merge import merge_hdf5

try:
    merge_hdf5(sys.argv[2], sys.argv[3])
except KeyboardInterrupt:
    print(f"interrupted at write {writes}", flush=True)
    sys.exit(130)
print(f"finished after {writes} writes")
"""
)


def _run(script: str, *args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=120)


def _check_stopped_cleanly(proc: subprocess.CompletedProcess) -> str:
    crashed = proc.returncode == -signal.SIGSEGV
    assert proc.returncode == 130, f"exit {proc.returncode}{' (crashed)' * crashed}:\n{proc.stdout}{proc.stderr}"
    assert "Exception ignored" not in proc.stderr, proc.stderr  # a Ctrl-C swallowed inside HDF5
    assert "interrupted" in proc.stdout
    return proc.stdout


@pytest.mark.parametrize("at", [1, 60])
def test_ctrl_c_inside_a_flush_stops_the_shard_at_that_sample(tmp_path, at):
    shard = tmp_path / "shard.h5"
    said = _check_stopped_cleanly(_run(_WRITE_SHARD, at, shard))
    # Raised as the flush ended, in the sample that flushed: not lost, not put off to the end of the shard.
    assert "interrupted at sample 8191," in said, said


def test_ctrl_c_inside_the_writes_of_close_stops_the_shard(tmp_path):
    finished = _run(_WRITE_SHARD, 10**9, tmp_path / "whole.h5")
    assert finished.returncode == 0, finished.stderr
    before, in_close = (int(word) for word in finished.stdout.split() if word.isdigit())
    # Early in the close (a dataset closing writes its chunks), half-way, and its very last write.
    for at in (before + 3, before + in_close // 2, before + in_close):
        said = _check_stopped_cleanly(_run(_WRITE_SHARD, at, tmp_path / f"{at}.h5"))
        assert "interrupted at sample close," in said, said


@pytest.fixture
def dataset(tmp_path, write_dataset) -> Path:
    """An HDF5 dataset of 3 shards (4 + 4 + 3 samples)."""
    rng = np.random.default_rng(3)
    fields = {"blob": Field.array("uint8", (-1,)), "row": Field.array("float32", (4, 64))}
    samples = [
        {"blob": rng.integers(0, 255, i, dtype=np.uint8), "row": rng.random((4, 64), dtype=np.float32)}
        for i in range(11)
    ]
    return write_dataset(tmp_path / "ds", "hdf5", fields, samples, per_shard=4)


def test_ctrl_c_inside_any_write_of_a_merge_leaves_nothing_and_a_rerun_merges(dataset, tmp_path):
    whole = _run(_MERGE, 10**9, dataset, tmp_path / "whole.h5")
    assert whole.returncode == 0, whole.stderr
    writes = int(whole.stdout.split()[2])
    # Every write: which of them crashed depended on what HDF5 was doing (in one run, only the 5th of 17).
    for at in range(1, writes + 1):
        (tmp_path / f"{at}").mkdir()
    with ThreadPoolExecutor(4) as pool:
        runs = list(
            pool.map(lambda at: _run(_MERGE, at, dataset, tmp_path / f"{at}" / "merged.h5"), range(1, writes + 1))
        )
    for at, proc in enumerate(runs, 1):
        _check_stopped_cleanly(proc)
        assert not any((tmp_path / f"{at}").iterdir()), f"write {at}"  # neither the output nor its temporary file
    again = _run(_MERGE, 10**9, dataset, tmp_path / "1" / "merged.h5")
    assert again.returncode == 0, again.stderr
