"""A large object read in parallel ranged parts (dali_pipes/remote/parts.py, through remote/transfer.py's
download_to), against the loopback S3-protocol server: the parts after a held one are read meanwhile, the bytes
arrive whole and in order, the hash is the object's; and in_order alone: results in order, a read's error in its
place, no read started once the caller leaves.
"""

from __future__ import annotations

import hashlib
import io
import threading
import time

import numpy as np
import pytest
from s3_helpers import options

from dali_pipes.remote import transfer
from dali_pipes.remote.parts import PARTS, in_order

CHUNK = 64 << 10


@pytest.fixture
def blob(s3, monkeypatch) -> tuple[str, bytes]:
    """An object of 20 chunks and a bit (the chunk made small: 64 KiB), written straight to the server."""
    monkeypatch.setattr(transfer, "CHUNK", CHUNK)
    data = np.random.default_rng(1).integers(0, 256, 20 * CHUNK + 123, dtype=np.uint8).tobytes()
    path = f"{s3.new_bucket()}/blob"
    s3.fs().pipe_file(path, data)
    return path, data


def ranges_of(s3, path: str) -> set[str]:
    """The byte ranges of ``path`` asked for (a retried request counts once)."""
    with s3.proxy.lock:
        return {asked for seen, asked in s3.proxy.ranges if seen.endswith(path)}


def test_the_parts_after_a_held_one_are_read_meanwhile_and_the_object_arrives_whole_in_order(s3, blob):
    import s3fs

    path, data = blob
    s3.proxy.stall = 30.0
    s3.proxy.add("stall", path=rf"/{path}$", times=1)  # the first part is held by the server
    # A read timeout past the hold: on a loaded machine the 5 s of the tests' options ran out (the held part asked again)
    config = {"connect_timeout": 3, "read_timeout": 60, "retries": {"max_attempts": 1, "mode": "standard"}}
    fs = s3fs.S3FileSystem(**options(s3.proxy.url, config_kwargs=config))
    out, done = io.BytesIO(), {}
    reader = threading.Thread(
        target=lambda: done.update(result=transfer.download_to(fs, path, f"s3://{path}", out, len(data))), daemon=True
    )
    reader.start()
    deadline = time.monotonic() + 20
    first = {f"bytes={k * CHUNK}-{(k + 1) * CHUNK - 1}" for k in range(2 * PARTS)}
    while ranges_of(s3, path) != first:  # the first part, and those read ahead of it meanwhile
        assert time.monotonic() < deadline and ranges_of(s3, path) <= first, ranges_of(s3, path)
        time.sleep(0.01)
    time.sleep(0.2)
    assert ranges_of(s3, path) == first  # no further ahead than that: the memory held stays bounded
    assert out.getvalue() == b"" and reader.is_alive()  # written in order: nothing before the first part
    s3.proxy.clear()  # the held part goes on
    reader.join(30)
    assert done["result"] == (len(data), hashlib.sha256(data).hexdigest())
    assert out.getvalue() == data


def test_an_object_shorter_or_longer_than_expected_shows_in_the_count(s3, blob):
    import s3fs

    path, data = blob
    fs = s3fs.S3FileSystem(**s3.options)
    count, _ = transfer.download_to(fs, path, f"s3://{path}", io.BytesIO(), len(data) + 5 * CHUNK)
    assert count == len(data)  # shorter: the parts past its end read nothing
    out = io.BytesIO()
    count, digest = transfer.download_to(fs, path, f"s3://{path}", out, len(data) - CHUNK - 1)
    assert count == len(data) - CHUNK  # longer: one byte past the expected end, neither written nor hashed
    assert out.getvalue() == data[: len(data) - CHUNK - 1]
    assert digest == hashlib.sha256(data[: len(data) - CHUNK - 1]).hexdigest()


def test_results_come_in_order_and_a_reads_error_is_raised_in_its_place():
    pauses = np.random.default_rng(2).uniform(0, 0.01, 30)

    def read(i: int):
        time.sleep(pauses[i])
        if i == 17:
            raise ValueError("read 17 failed")
        return i

    taken = []
    with pytest.raises(ValueError, match="read 17"):
        with in_order([lambda i=i: read(i) for i in range(30)], 4) as results:
            for value in results:
                taken.append(value)
    assert taken == list(range(17))


def test_no_read_starts_once_the_caller_leaves():
    started, lock = [], threading.Lock()

    def read(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.01)
        return i

    with in_order([lambda i=i: read(i) for i in range(100)], 4) as results:
        assert [next(results), next(results)] == [0, 1]
    time.sleep(0.3)
    assert len(started) <= 2 + 2 * 4  # those taken and those read ahead of them, no more
