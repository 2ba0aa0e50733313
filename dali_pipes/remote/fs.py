"""The fsspec filesystem of a URL, and errors that name the URL and say what to do.

Backends are optional extras, imported only when a URL of theirs is used. For ``s3://`` the
connection and read timeouts are set (an unanswered request ends in an error, never a hang) and
botocore retries throttling (``503 SlowDown``) with backoff; :mod:`dali_pipes.remote.transfer`
retries dropped connections on top, resuming at the byte it reached.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from typing import Any, Iterator, Mapping

from dali_pipes.remote.urls import SCHEMES, redact, scheme, url_secrets

log = logging.getLogger(__name__)

#: Seconds to open a connection and to wait for the next bytes of an answer (``s3://``; override in
#: ``storage_options["config_kwargs"]``).
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 30.0
#: Attempts botocore makes at one request (throttling, 5xx answers and timeouts are retried with backoff).
#: s3fs's own retries, which would multiply these, are turned off: :mod:`dali_pipes.remote.transfer`
#: retries on top, resuming at the byte reached. A server that stops answering so ends in an error after
#: at most ATTEMPTS x BOTO_ATTEMPTS x READ_TIMEOUT (7.5 minutes by default), never a hang.
BOTO_ATTEMPTS = 3

_CREDENTIAL_ERRORS = (
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "DefaultCredentialsError",
)


class RemoteError(ValueError):
    """Object storage that cannot be used as asked: no credentials, access denied, no such bucket or
    object, a missing extra, a server that keeps failing. The message names the URL (secrets taken
    out) and says what to do."""


def _options(kind: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` with this project's defaults filled in (timeouts and retries for S3)."""
    options = dict(storage_options or {})
    if kind in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", CONNECT_TIMEOUT)
        config.setdefault("read_timeout", READ_TIMEOUT)
        config.setdefault("retries", {"max_attempts": BOTO_ATTEMPTS, "mode": "standard"})
        options["config_kwargs"] = config
        # A path of the form s3://bucket/key needs no virtual-host DNS name (custom endpoints, MinIO).
        if options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
            config.setdefault("s3", {"addressing_style": "path"})
    return options


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(fs, path)``: the fsspec filesystem that serves ``url`` and the path within it.

    Credentials and endpoints come from ``storage_options`` (passed to the backend) or from where
    the backend looks by itself (environment, ``~/.aws``, ``gcloud`` login, ``HF_TOKEN``).
    Raises :class:`RemoteError` naming the extra to install when the backend is missing.
    """
    kind = scheme(url)
    if kind is None:
        raise ValueError(
            f"{url}: not a URL of object storage (expected one of {', '.join(f'{s}://' for s in SCHEMES)})"
        )
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise RemoteError(_install_message(url, kind)) from None
    with remote_errors(url, storage_options):
        try:
            fs, path = url_to_fs(url, **_options(kind, storage_options))
        except ImportError:
            raise RemoteError(_install_message(url, kind)) from None
    if kind in ("s3", "s3a"):
        fs.retries = 1  # see BOTO_ATTEMPTS
    return fs, path


def _install_message(url: str, kind: str) -> str:
    extra = SCHEMES[kind]
    return (
        f"{redact(url)}: reading {kind}:// URLs needs an optional package that is not installed; "
        f'install it with: pip install "dali-pipes[{extra}]"'
    )


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole object at ``url`` (a small one: a manifest, ``errors.jsonl``); :class:`RemoteError` if it cannot be read."""
    fs, path = filesystem(url, storage_options)
    with remote_errors(url, storage_options):
        return fs.cat_file(path)


@contextlib.contextmanager
def remote_errors(url: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Turn a backend's error into a :class:`RemoteError` that names ``url`` and says what to do."""
    try:
        yield
    except RemoteError:
        raise
    except Exception as exc:  # noqa: BLE001 - each backend raises its own kinds; all are told the same way
        message = describe(url, exc, storage_options)
        if message is None:
            raise
        log.debug("%s", message)
        raise RemoteError(message) from None  # the original may quote request details; the message says it all


def describe(url: str, exc: BaseException, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """A message for a backend error at ``url`` (secrets taken out), or ``None`` for an error that is not one."""
    shown = redact(url, storage_options)
    raw = f"{type(exc).__name__}: {exc}"
    reason = redact(raw, storage_options, url_secrets(url))
    name = type(exc).__name__
    if name in _CREDENTIAL_ERRORS or "credentials" in str(exc).lower() and "unable to locate" in str(exc).lower():
        return (
            f"{shown}: no credentials found ({reason}); give them where the backend looks (for S3: "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, ~/.aws/credentials or AWS_PROFILE; GCS: gcloud auth "
            "application-default login; Azure: AZURE_STORAGE_ACCOUNT_NAME and a key or SAS token, or "
            "AZURE_STORAGE_ANON=false to use az login; HF: HF_TOKEN) or in storage_options, or read a public bucket "
            'with storage_options={"anon": True} (S3, Azure) or {"token": "anon"} (GCS)'
        )
    if isinstance(exc, PermissionError):
        return (
            f"{shown}: access denied ({reason}); check the credentials (wrong or expired keys) and that they may "
            "read (and, to write, write) this bucket"
        )
    if isinstance(exc, FileNotFoundError):
        return (
            f"{shown}: no such bucket or object ({reason}); check the URL, and that the dataset was uploaded whole "
            "(its index.json is written last)"
        )
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
        return (
            f"{shown}: the server kept asking to slow down (503 SlowDown) after every retry ({reason}); try again later"
        )
    if isinstance(exc, (OSError, TimeoutError)) or "timeout" in name.lower() or "connect" in name.lower():
        return (
            f"{shown}: the storage server did not answer or dropped the connection after every retry ({reason}); "
            "check the endpoint and the network, then run the same command again (it resumes)"
        )
    if reason != raw or "validation" in name.lower():  # the backend quoted a secret, or refused the URL's form
        return f"{shown}: the storage backend refused this ({reason}); check the URL"
    return None


__all__ = ["RemoteError", "describe", "filesystem", "read_bytes", "remote_errors"]
