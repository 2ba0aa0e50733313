"""The fsspec filesystem of a URL, and errors that name the URL and say what to do.

Backends are optional extras, imported only when a URL of theirs is used. For ``s3://`` the
connection and read timeouts are set (an unanswered request ends in an error, never a hang) and
botocore retries throttling (``503 SlowDown``) with backoff; :mod:`dali_pipes.remote.transfer`
retries dropped connections on top, resuming at the byte it reached.

How patient that is depends on the use (:class:`Patience`): a job (:data:`JOB`: staging, a conversion's
uploads) waits long and resumes when run again; a read-only look (:data:`LOOK`: ``inspect``, the check of a
conversion's destination before any work) gives up within seconds, since a person waits for its answer.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Patience:
    """How long one use of object storage waits for the server before it gives up, and what its error then
    advises. ``attempts`` are :func:`dali_pipes.remote.transfer.retrying`'s tries (``None``: its ``ATTEMPTS``)."""

    connect_timeout: float
    read_timeout: float
    boto_attempts: int
    attempts: int | None
    #: What to do once the endpoint or the network is mended (said when the server did not answer).
    then: str


#: A job (staging, a conversion's uploads): it may run for hours, a pause of the network is worth waiting out,
#: and a job that failed resumes where it stopped.
JOB = Patience(CONNECT_TIMEOUT, READ_TIMEOUT, BOTO_ATTEMPTS, None, "then run the same command again (it resumes)")
#: A read-only look (``inspect``, the check of a destination before a conversion): a person waits for the answer
#: and nothing is resumed, so one try of two requests, 5 s to connect and 10 s between bytes: a server that is
#: down or unreachable is reported within seconds (at most about 2 x 10 s when it accepts and then stalls).
LOOK = Patience(5.0, 10.0, 2, 1, "then try again")
#: A job's first request (its manifest): nothing has started, so there is nothing to wait out nor to resume, and
#: a person waits for the answer: a server that is down is said as quickly as :data:`LOOK` says it; one that
#: answers slowly is given a job's time between bytes.
FIRST_CONTACT = Patience(LOOK.connect_timeout, READ_TIMEOUT, LOOK.boto_attempts, 1, LOOK.then)

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


def _options(kind: str, storage_options: Mapping[str, Any] | None, patience: Patience) -> dict[str, Any]:
    """``storage_options`` with this project's defaults filled in (timeouts and retries for S3); the user's own
    ``config_kwargs`` win."""
    options = dict(storage_options or {})
    if kind in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", patience.connect_timeout)
        config.setdefault("read_timeout", patience.read_timeout)
        config.setdefault("retries", {"max_attempts": patience.boto_attempts, "mode": "standard"})
        options["config_kwargs"] = config
        # A path of the form s3://bucket/key needs no virtual-host DNS name (custom endpoints, MinIO).
        if options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
            config.setdefault("s3", {"addressing_style": "path"})
    return options


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None, patience: Patience = JOB) -> tuple[Any, str]:
    """``(fs, path)``: the fsspec filesystem that serves ``url`` and the path within it.

    Credentials and endpoints come from ``storage_options`` (passed to the backend) or from where
    the backend looks by itself (environment, ``~/.aws``, ``gcloud`` login, ``HF_TOKEN``); ``patience`` sets
    the timeouts and retries of each request. Raises :class:`RemoteError` naming the extra to install when the
    backend is missing.
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
    with remote_errors(url, storage_options, patience):
        try:
            fs, path = url_to_fs(url, **_options(kind, storage_options, patience))
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
def remote_errors(
    url: str, storage_options: Mapping[str, Any] | None = None, patience: Patience = JOB
) -> Iterator[None]:
    """Turn a backend's error into a :class:`RemoteError` that names ``url`` and says what to do."""
    try:
        yield
    except RemoteError:
        raise
    except Exception as exc:  # noqa: BLE001 - each backend raises its own kinds; all are told the same way
        message = describe(url, exc, storage_options, patience)
        if message is None:
            raise
        log.debug("%s", message)
        raise RemoteError(message) from None  # the original may quote request details; the message says it all


def failure(exc: BaseException) -> str | None:
    """What a backend's error means, whichever backend raised it: ``"credentials"`` (none found), ``"denied"``,
    ``"missing"`` (no such bucket or object), ``"throttled"``, ``"unreachable"`` (no answer, a dropped
    connection), ``"refused"`` (the URL's form), or ``None`` for an error that is none of these."""
    name = type(exc).__name__
    if name in _CREDENTIAL_ERRORS or "credentials" in str(exc).lower() and "unable to locate" in str(exc).lower():
        return "credentials"
    if isinstance(exc, PermissionError):
        return "denied"
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
        return "throttled"
    if isinstance(exc, (OSError, TimeoutError)) or "timeout" in name.lower() or "connect" in name.lower():
        return "unreachable"
    return "refused" if "validation" in name.lower() else None


#: Where each backend takes its credentials, and how it reads public data without any (said when none were found).
_CREDENTIALS = {
    "s3": (
        "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials, AWS_PROFILE), or pass storage_options "
        "key and secret (--storage-option key=... --storage-option secret=...)",
        "anon=true",
    ),
    "gs": (
        "run gcloud auth application-default login, or pass a service account's JSON file as storage_options token "
        "(--storage-option token=FILE)",
        "token=anon",
    ),
    "az": (
        "set AZURE_STORAGE_ACCOUNT_NAME and a key or SAS token, or AZURE_STORAGE_ANON=false to use az login",
        "anon=true",
    ),  # fmt: skip
    "hf": ("set HF_TOKEN or run huggingface-cli login", ""),
}
_CREDENTIALS.update(s3a=_CREDENTIALS["s3"], gcs=_CREDENTIALS["gs"], abfs=_CREDENTIALS["az"], abfss=_CREDENTIALS["az"])


def credentials_help(url: str) -> str:
    """What to do for the backend of ``url`` (that backend's ways only) when it found no credentials."""
    where, public = _CREDENTIALS.get(scheme(url) or "", ("give them in storage_options", ""))
    return f"{where}; a public bucket reads without them with --storage-option {public}" if public else where


def describe(
    url: str, exc: BaseException, storage_options: Mapping[str, Any] | None = None, patience: Patience = JOB
) -> str | None:
    """A message for a backend error at ``url`` (secrets taken out), or ``None`` for an error that is not one."""
    shown = redact(url, storage_options)
    raw = f"{type(exc).__name__}: {exc}"
    reason = redact(raw, storage_options, url_secrets(url))
    kind = failure(exc)
    if kind == "credentials":
        return f"{shown}: no credentials found ({reason}); {credentials_help(url)}"
    if kind == "denied":
        return (
            f"{shown}: access denied ({reason}); check the credentials (wrong or expired keys) and that they may "
            "read (and, to write, write) this bucket"
        )
    if kind == "missing" and ("bucket does not exist" in raw.lower() or "NoSuchBucket" in raw):
        bucket = redact(url.split("://", 1)[-1].split("/", 1)[0], storage_options)
        return (
            f"{shown}: the bucket {bucket} does not exist ({reason}); check the URL, and that the endpoint, "
            f"{endpoint(url, storage_options)}, is the one that holds it"
        )
    if kind == "missing":
        return (
            f"{shown}: no such bucket or object ({reason}); check the URL, and that the dataset was uploaded whole "
            "(its index.json is written last)"
        )
    if kind == "throttled":
        return (
            f"{shown}: the server kept asking to slow down (503 SlowDown) after every retry ({reason}); try again later"
        )
    if kind == "unreachable":
        return unreachable(shown, url, reason, storage_options, patience)
    if reason != raw or kind == "refused":  # the backend quoted a secret, or refused the URL's form
        return f"{shown}: the storage backend refused this ({reason}); check the URL"
    return None


def unreachable(
    shown: str, url: str, reason: str, storage_options: Mapping[str, Any] | None, patience: Patience = JOB
) -> str:
    """The message for a server that did not answer: after how many tries, which endpoint, what to check, what next."""
    tries = "every retry" if patience.attempts is None else f"{patience.attempts * patience.boto_attempts} tries"
    return (
        f"{shown}: the storage server did not answer or dropped the connection after {tries} ({reason}); check "
        f"that the endpoint, {endpoint(url, storage_options)}, is right and that this machine reaches it (network, "
        f"VPN, proxy, firewall, the server running), {patience.then}"
    )


#: Where each backend's endpoint is set, and the one it uses when none is.
_ENDPOINTS = {
    "s3": ("endpoint_url in storage_options or --storage-option, else AWS_ENDPOINT_URL", "AWS S3's own"),
    "gs": ("endpoint_url in storage_options or --storage-option", "Google Cloud Storage's own"),
    "az": ("account_name in storage_options or --storage-option, else AZURE_STORAGE_ACCOUNT_NAME", "none"),
    "hf": ("endpoint in storage_options or --storage-option, else HF_ENDPOINT", "https://huggingface.co"),
}
_ENDPOINTS.update(s3a=_ENDPOINTS["s3"], gcs=_ENDPOINTS["gs"], abfs=_ENDPOINTS["az"], abfss=_ENDPOINTS["az"])


def endpoint(url: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """The server that ``url``'s requests go to, and where that is set (secrets taken out): for a message."""
    options = storage_options or {}
    kind = scheme(url) or ""
    given = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
    if kind in ("s3", "s3a"):
        given = given or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    elif kind == "hf":
        given = options.get("endpoint") or os.environ.get("HF_ENDPOINT")
    elif kind in ("az", "abfs", "abfss"):
        account = options.get("account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        given = f"the account {account}" if account else None
    where, default = _ENDPOINTS.get(kind, ("storage_options", "the backend's own"))
    return f"{redact(given, storage_options) if given else default} ({where})"


__all__ = [
    "credentials_help",
    "FIRST_CONTACT",
    "JOB",
    "LOOK",
    "Patience",
    "RemoteError",
    "describe",
    "endpoint",
    "failure",
    "filesystem",
    "read_bytes",
    "remote_errors",
    "unreachable",
]
