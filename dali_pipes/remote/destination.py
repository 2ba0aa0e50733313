"""Is a URL a place a conversion can write to? Asked before any work, answered within seconds.

A conversion into ``s3://bucket/ds`` writes shards locally and uploads each when whole; without this
check a bucket that does not exist, keys that may not write there, no keys at all or an endpoint that
does not answer would show only at the first upload, after a shard's worth of work (or, for a small
dataset, all of it) and with a work folder left in the cache. :func:`check_destination` writes one empty
object under the URL and deletes it again, with the bounded patience of a read-only look
(:data:`~dali_pipes.remote.fs.LOOK`), and turns each failure into one line that names the URL and says
what to do.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Mapping

from dali_pipes.remote.fs import LOOK, RemoteError, credentials_help, describe, failure, filesystem, unreachable
from dali_pipes.remote.urls import join, redact, scheme, url_secrets

log = logging.getLogger(__name__)

#: The name of the empty object written (and deleted) to find out whether the credentials may write.
PROBE_PREFIX = ".dali-pipes-write-check-"
#: Stores where an object written and deleted leaves a trace (the Hub: two commits in the repository's history):
#: there only the dataset's repository is looked up, and a refused write shows at the first upload.
_NO_PROBE = ("hf",)
_NOTHING_DONE = "nothing was converted"
#: How a bucket is made, for the message that says there is none.
_CREATE = {
    "s3": "aws s3 mb s3://{bucket}",
    "s3a": "aws s3 mb s3://{bucket}",
    "gs": "gcloud storage buckets create gs://{bucket}",
    "gcs": "gcloud storage buckets create gs://{bucket}",
    "az": "az storage container create --name {bucket}",
    "abfs": "az storage container create --name {bucket}",
    "abfss": "az storage container create --name {bucket}",
}


def check_destination(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Check that a conversion can write under ``url``: credentials found, the server reached, the bucket there,
    writing allowed. Raises :class:`RemoteError` naming ``url`` and what to do; leaves nothing behind."""
    fs, root = filesystem(url, storage_options, LOOK)
    if scheme(url) in _NO_PROBE:
        _look_up(fs, root, url, storage_options)
        return
    probe = join(root, PROBE_PREFIX + uuid.uuid4().hex)
    try:
        fs.pipe_file(probe, b"")
    except Exception as exc:  # noqa: BLE001 - each backend raises its own kinds; sorted by failure()
        _refuse(url, exc, storage_options)
    try:
        fs.rm_file(probe)
    except Exception as exc:  # noqa: BLE001 - writing is what matters; the empty object is only untidy
        log.warning(
            "%s: could not delete the empty object this check wrote (%s); delete it when convenient",
            redact(join(url, probe.rsplit("/", 1)[-1]), storage_options),
            redact(f"{type(exc).__name__}: {exc}", storage_options, url_secrets(url)),
        )


def _look_up(fs: Any, root: str, url: str, storage_options: Mapping[str, Any] | None) -> None:
    """Where no object is written to check: the store answers and the dataset's repository (or bucket) exists."""
    parts = root.split("/")
    # A Hub repository is datasets/ORG/NAME, spaces/ORG/NAME or (a model) ORG/NAME; elsewhere the bucket.
    top = "/".join(parts[: 3 if parts[0] in ("datasets", "spaces") else 2]) if scheme(url) == "hf" else parts[0]
    try:
        fs.info(top)
    except Exception as exc:  # noqa: BLE001 - as above
        _refuse(url, exc, storage_options)


def _refuse(url: str, exc: BaseException, storage_options: Mapping[str, Any] | None) -> None:
    """Raise :class:`RemoteError` for ``exc`` (called in its ``except``); an error that is no storage failure, a
    bug rather than the destination, is raised as it is."""
    message = _message(url, exc, storage_options)
    if message is None:
        raise exc
    raise RemoteError(message) from None


def _message(url: str, exc: BaseException, storage_options: Mapping[str, Any] | None) -> str | None:
    """One line for a destination that cannot be written to: the URL, why, and what to do."""
    shown = redact(url, storage_options)
    reason = redact(f"{type(exc).__name__}: {exc}", storage_options, url_secrets(url))
    bucket = redact(url.split("://", 1)[-1].split("/", 1)[0], storage_options)
    kind = failure(exc)
    if kind == "credentials":
        return f"{shown}: no credentials found to write there ({reason}); {credentials_help(url)}; {_NOTHING_DONE}"
    if kind == "denied":
        return (
            f"{shown}: these credentials may not write there ({reason}); use keys allowed to write to the bucket "
            f"{bucket} (for S3: s3:PutObject on it), or convert into a bucket you may write to; {_NOTHING_DONE}"
        )
    if kind == "missing":
        how = _CREATE.get(scheme(url) or "", "").format(bucket=bucket)
        return (
            f"{shown}: the bucket {bucket} does not exist ({reason}); check the URL and the endpoint, create the bucket "
            f"first{f' ({how})' if how else ''} or convert into one that exists; {_NOTHING_DONE}"
        )
    if kind == "unreachable":
        return unreachable(shown, url, reason, storage_options, LOOK) + f"; {_NOTHING_DONE}"
    said = describe(url, exc, storage_options, LOOK)
    return f"{said}; {_NOTHING_DONE}" if said else None


__all__ = ["PROBE_PREFIX", "check_destination"]
