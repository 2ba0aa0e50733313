"""A shard truncated while a reader has it open: an error naming shard and sample, not a dead process.

LMDB reads records straight from a memory map of the shard; once the file is
truncated under it, touching a page past the new end raises SIGBUS, which kills
the reading process outright (the training process itself with
``py_num_workers=0``). The store checks the file's size before each read.

Each read runs in a child process, so that a SIGBUS (the behaviour without the
check) fails the test with the signal's name instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loader_helpers import shard_name, write_dataset

TESTS = Path(__file__).resolve().parent
N = 40  # samples, in one shard


def run_child(function: str, *args: str) -> dict:
    """Run ``function(*args)`` of this module in a new Python process; return what it printed (JSON)."""
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_store_faults as t; t.{function}(*sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    if done.returncode < 0:
        pytest.fail(
            f"the reading process was killed by {signal.Signals(-done.returncode).name}:\n{done.stderr[-3000:]}"
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def truncate_to_meta_pages(path: Path) -> None:
    """Cut an LMDB shard to its two meta pages: every record's page is then past the end of the file.

    (A cut inside a page would leave that page's tail reading as zeros, no SIGBUS,
    and records there looking merely "missing"; a cut at a page boundary is what
    shows the crash every time.)
    """
    os.truncate(path, 2 * os.sysconf("SC_PAGE_SIZE"))  # LMDB's page size is the system's


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "tfrecord"])
def test_running_out_of_file_descriptors_says_so_and_not_re_convert(tmp_path, fmt):
    """Every shard read stays open; past ``ulimit -n`` the error must name the limit, not damage."""
    dataset = write_dataset(tmp_path / "many", 120, fmt=fmt, samples_per_shard=1)
    outcome = run_child("child_read_all_under_a_descriptor_limit", str(dataset), "60")
    assert outcome["error"] == "StoreError", outcome
    assert "too many open files" in outcome["message"] and "ulimit -n" in outcome["message"], outcome
    assert "re-convert the damaged shard" not in outcome["message"], outcome
    assert 0 < outcome["read"] < 120, outcome  # it failed part way, at the limit


# --- run in the child process --------------------------------------------------------------------


def child_read_after_truncation(dataset: str) -> None:
    """Read a sample, truncate the shard, read the last sample; print the outcome."""
    from dali_pipes import StoreError, open_store

    store = open_store(dataset)
    first = store[0]
    truncate_to_meta_pages(Path(dataset) / shard_name("lmdb", 0))
    try:
        store[N - 1]
    except StoreError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    else:
        outcome = {"error": None, "message": ""}
    outcome["first_label"] = int(first["label"])
    print(json.dumps(outcome))


def child_loader_after_truncation(dataset: str) -> None:
    """Iterate a DALILoader (no worker processes); truncate the shard after the first batch."""
    from dali_pipes import BatchFormat, DALILoader, LoaderError, RunOptions

    from loader_helpers import TinySpec, quiet_dali_logs

    quiet_dali_logs()
    loader = DALILoader(
        dataset, TinySpec(), batch_size=2, shuffle=False, batch_format=BatchFormat(with_index=True),
        run=RunOptions(device="cpu", py_num_workers=0),
    )  # fmt: skip
    seen: list[int] = []
    outcome = {"error": None, "message": ""}
    try:
        for number, batch in enumerate(loader):
            seen.extend(batch["index"].tolist())
            if number == 0:
                truncate_to_meta_pages(Path(dataset) / shard_name("lmdb", 0))
    except LoaderError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seen"] = seen
    print(json.dumps(outcome))


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_store_reading_an_lmdb_shard_truncated_while_open_raises_naming_it(tmp_path):
    dataset = write_dataset(tmp_path / "ds", N, fmt="lmdb", samples_per_shard=N)
    outcome = run_child("child_read_after_truncation", str(dataset))
    assert outcome["first_label"] == 0
    assert outcome["error"] == "StoreError", outcome
    message = outcome["message"]
    shard = shard_name("lmdb", 0)
    assert f"sample {N - 1} (shard {shard}, record {N - 1})" in message
    assert "shrank from" in message and "while it was open" in message
    assert f"Run 'dali-pipes verify {dataset}' and re-convert the damaged shard" in message


@pytest.mark.timeout(120)
def test_a_loader_without_workers_reading_an_lmdb_shard_truncated_while_open_raises_naming_it(tmp_path):
    dataset = write_dataset(tmp_path / "ds", N, fmt="lmdb", samples_per_shard=N)
    outcome = run_child("child_loader_after_truncation", str(dataset))
    assert outcome["error"] == "ShardReadError", outcome
    message = outcome["message"]
    assert f"(shard {shard_name('lmdb', 0)}, record " in message and "shrank from" in message
    assert "dali-pipes verify" in message and "re-convert" in message
    # Only batches read before the truncation (DALI prefetches a few) came out, in order.
    assert outcome["seen"] == list(range(len(outcome["seen"]))) and len(outcome["seen"]) < N


def child_read_all_under_a_descriptor_limit(dataset: str, spare: str) -> None:
    """Allow ``spare`` more descriptors than are open now, read every sample; print how far it got."""
    import resource

    from dali_pipes import StoreError, open_store

    store = open_store(dataset)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + int(spare), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    read = 0
    try:
        for i in range(len(store)):
            store[i]
            read += 1
    except StoreError as exc:
        print(json.dumps({"error": "StoreError", "message": str(exc), "read": read}))
        return
    except Exception as exc:  # noqa: BLE001 - the test reports whatever else it was
        print(json.dumps({"error": type(exc).__name__, "message": str(exc), "read": read}))
        return
    print(json.dumps({"error": None, "message": "", "read": read}))
