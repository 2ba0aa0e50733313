"""Whole objects moved between object storage and local files, checked, and retried with backoff.

A read goes by byte ranges of :data:`CHUNK`, a few at once for a large object (:mod:`dali_pipes.remote.parts`);
a connection dropped or timed out mid-object is retried after a pause that doubles each time (with jitter), from
the byte reached, so that a flaky link costs a chunk rather than the object. Errors that retrying cannot mend (no such
object, access denied, no credentials) are raised at once, and so is the last error after
:data:`ATTEMPTS` tries, as a :class:`~dali_pipes.remote.fs.RemoteError` naming the URL.

Each range has its own tries, so a large object could take many failed requests in all. Within
:func:`object_tries` (the streaming cache's download of one shard) they share one budget instead, with the
downloads that arrived whole but wrong, so that a shard that keeps failing is asked for a bounded
number of times, and its error can say how many.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterator, Mapping, TypeVar

from dali_pipes.remote.fs import JOB, Patience, RemoteError, describe, unreachable
from dali_pipes.remote.parts import PARTS, in_order
from dali_pipes.remote.urls import redact

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Bytes asked for in one ranged read.
CHUNK = 8 << 20
#: Tries at one request before giving up, and the first pause between them (seconds; doubles, at most BACKOFF_MAX).
ATTEMPTS = 5
BACKOFF = 0.2
BACKOFF_MAX = 8.0
#: Words in the names of errors worth retrying (the error's class or a class it derives from); "checksum":
#: botocore's check of a response against the checksum the object was stored with (FlexibleChecksumError), so the
#: bytes were damaged on the way, not at rest; "httpclienterror": botocore's base of the errors of a connection
#: that failed mid-request (ConnectionClosedError, ReadTimeoutError, ResponseStreamingError: aiobotocore's wrapper of
#: a connection lost while the body is read).
_TRANSIENT_NAMES = (
    "timeout",
    "connection",
    "payload",
    "incompleteread",
    "responseparser",
    "disconnected",
    "ebusy",
    "checksum",
    "httpclienterror",
)


@dataclass
class Tries:
    """The failed tries left to one object (:func:`object_tries`), and the requests made for it (counted under a
    lock: the parts of a large object are read in threads of their own)."""

    left: int
    made: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def request(self) -> None:
        """Count a request."""
        with self._lock:
            self.made += 1

    def failed(self) -> bool:
        """Count a failed try; True when it was the last one allowed."""
        with self._lock:
            self.left -= 1
            return self.left <= 0


_TRIES: contextvars.ContextVar[Tries | None] = contextvars.ContextVar("dali_pipes_tries", default=None)


@contextlib.contextmanager
def object_tries(size: int) -> Iterator[Tries]:
    """Within the block (in this thread, and the threads reading its parts), :func:`retrying`'s failed tries share
    one budget: :data:`ATTEMPTS` for each chunk read at once (an outage fails them together), one more for each
    further chunk (a flaky link may cost a chunk now and then)."""
    chunks = max(1, -(-size // CHUNK))
    together = min(chunks, PARTS)
    tries = Tries(ATTEMPTS * together + chunks - together)
    token = _TRIES.set(tries)
    try:
        yield tries
    finally:
        _TRIES.reset(token)


def transient(exc: BaseException) -> bool:
    """True for an error worth retrying: a dropped or timed-out connection, a throttling answer, a response
    that fails its checksum."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    names = [cls.__name__.lower() for cls in type(exc).__mro__]
    return any(word in name for name in names for word in _TRANSIENT_NAMES)


def retrying(
    call: Callable[[], _T],
    url: str,
    what: str,
    storage_options: Mapping[str, Any] | None = None,
    patience: Patience = JOB,
) -> _T:
    """``call()``, retried with backoff on transient errors (``patience.attempts`` tries, default
    :data:`ATTEMPTS`); :class:`RemoteError` naming ``url`` when it gives up."""
    attempts = patience.attempts or ATTEMPTS  # read at each call: tests lower ATTEMPTS
    shared = _TRIES.get()
    for attempt in range(1, attempts + 1):
        try:
            if shared is not None:
                shared.request()
            return call()
        except RemoteError:
            raise
        except Exception as exc:  # noqa: BLE001 - sorted below into retried and raised
            retry = transient(exc)
            spent = shared is not None and shared.failed()
            if not retry or attempt == attempts or spent:
                message = describe(url, exc, storage_options, patience)
                if message is None and retry:  # a transient kind describe() does not know by name
                    reason = redact(f"{type(exc).__name__}: {exc}", storage_options)
                    message = unreachable(redact(url, storage_options), url, reason, storage_options, patience)
                if message is None:
                    raise
                raise RemoteError(message) from None
            pause = min(BACKOFF * 2 ** (attempt - 1), BACKOFF_MAX) * (0.5 + random.random())
            log.info(
                "%s: %s failed (%s, try %d of %d); retrying in %.1f s",
                redact(url, storage_options),
                what,
                redact(exc, storage_options),
                attempt,
                attempts,
                pause,
            )
            time.sleep(pause)
    raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover


def read_ranges(
    fs: Any,
    path: str,
    url: str,
    size: int,
    sink: Callable[[bytes], None],
    storage_options: Mapping[str, Any] | None = None,
    parts: int = 1,
) -> int:
    """Read bytes ``0 .. size`` of ``path`` by ranges into ``sink``, in order; return the count read (``size`` unless
    the object is shorter, which the caller checks). Each range is retried on its own; ``parts`` of them are read
    at once (:func:`~dali_pipes.remote.parts.in_order`)."""
    ranges = [(lo, min(lo + CHUNK, size)) for lo in range(0, size, CHUNK)]
    reads = [
        lambda lo=lo, hi=hi: retrying(
            lambda: _range(fs, path, lo, hi), url, f"reading bytes {lo}-{hi}", storage_options
        )
        for lo, hi in ranges
    ]
    offset = 0
    with in_order(reads, parts) as results:
        for (_, end), data in zip(ranges, results):
            if data:
                sink(data)
                offset += len(data)
            if offset < end:  # a ranged read returns what there is: the object ends here
                break
    return offset


#: How the backends word an HTTP 416 (a range that starts at or past the object's end): S3's and Azure's
#: ``InvalidRange``, GCS's and the Hub's "Requested range not satisfiable". Each raises its own kind of error.
_PAST_END = ("not satisfiable", "invalidrange")


def _range(fs: Any, path: str, start: int, end: int) -> bytes:
    """Bytes ``start .. end`` of the object: fewer where it ends sooner, none where it ends before ``start``.

    The last read of :func:`download_to` asks for one byte past the expected end, so a range that starts
    exactly at the end is common (an empty object, or one whose size is a multiple of :data:`CHUNK`)."""
    try:
        return fs.cat_file(path, start=start, end=end)
    except Exception as exc:  # noqa: BLE001 - gcsfs's HttpError, adlfs's and the Hub's are no OSError
        missing = isinstance(exc, (FileNotFoundError, PermissionError))
        if not missing and any(word in str(exc).lower() for word in _PAST_END):
            return b""
        raise


def remote_size(fs: Any, path: str, url: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """The object's size in bytes (:class:`RemoteError` naming ``url`` when there is none)."""
    info = retrying(lambda: fs.info(path), url, "looking it up", storage_options)
    return int(info.get("size") or 0)


def download_to(
    fs: Any,
    path: str,
    url: str,
    out: IO[bytes],
    expected_bytes: int,
    advance: Callable[[int], None] = lambda n: None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, str]:
    """Write the object into ``out`` by ranged reads (:data:`~dali_pipes.remote.parts.PARTS` at once: a large shard
    in parallel parts); return ``(bytes read, hex SHA-256)``, hashed as read.

    No request asks for the size first: the reads stop short where the object is shorter than
    ``expected_bytes``, and one byte more is asked for at the end, so that a longer object shows
    too (its count is then ``expected_bytes + 1``; that byte is neither written nor hashed).
    """
    digest = hashlib.sha256()
    written = 0

    def sink(data: bytes) -> None:
        nonlocal written
        if len(data) > expected_bytes - written:  # the byte past the end (sliced only then: a slice copies)
            data = data[: expected_bytes - written]
        written += len(data)
        digest.update(data)
        out.write(data)
        advance(len(data))

    return read_ranges(fs, path, url, expected_bytes + 1, sink, storage_options, PARTS), digest.hexdigest()


def hash_remote(
    fs: Any,
    path: str,
    url: str,
    advance: Callable[[int], None] = lambda n: None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, str]:
    """``(size, hex SHA-256)`` of the object, read by ranges (nothing written locally)."""
    digest = hashlib.sha256()

    def sink(data: bytes) -> None:
        digest.update(data)
        advance(len(data))

    size = remote_size(fs, path, url, storage_options)
    read = read_ranges(fs, path, url, size, sink, storage_options, PARTS)
    return read, digest.hexdigest()


def upload_file(local: str, fs: Any, path: str, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Upload a local file to ``path``. An object store shows an object only once its upload completes
    (a single PUT, or a multipart upload completed last), so a killed upload leaves nothing at ``path``."""
    retrying(lambda: fs.put_file(local, path), url, "uploading", storage_options)


__all__ = [
    "ATTEMPTS",
    "CHUNK",
    "Tries",
    "download_to",
    "hash_remote",
    "object_tries",
    "read_ranges",
    "remote_size",
    "retrying",
    "transient",
    "upload_file",
]
