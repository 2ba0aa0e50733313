"""URLs of object storage: which strings are URLs, names joined onto them, and secrets taken out of text.

Secrets come in three ways: in ``storage_options`` (keys, tokens, SAS tokens, passwords), in the
environment (``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``, ...) and inside a URL (``user:password@``, a
signed URL's query). :func:`redact` replaces each of them with ``***`` in any text shown to a person
or written to a file: log lines, error messages, the manifest's ``source``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Iterable, Mapping

#: URL schemes read through fsspec, and the extra (``pip install "dali-pipes[EXTRA]"``) each needs.
SCHEMES: dict[str, str] = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "hf": "hf",
    "memory": "",  # fsspec's in-memory filesystem: no extra (tests, examples)
}
#: ``storage_options`` keys whose values are secrets (matched as words inside longer names too).
_SECRET_KEY = re.compile(r"(secret|token|password|passwd|key|credential|sas|signature|auth)", re.IGNORECASE)
#: Environment variables that hold secrets of the backends.
SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_CLIENT_SECRET",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
)
#: The environment variable that carries the storage options of a conversion's input URLs (JSON) to the
#: processes that read them: set by :func:`converters.remote_inputs.input_storage_options`, inherited by workers.
INPUT_OPTIONS_ENV = "DALI_PIPES_INPUT_STORAGE_OPTIONS"
#: ``user:password@`` in a URL (a userinfo without a colon, as in ``abfs://container@account...``, names a
#: container, not a secret, and is kept).
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@:\s]*:[^/@\s]*@")
_QUERY = re.compile(r"(?P<url>[a-zA-Z][a-zA-Z0-9+.-]*://[^\s?'\"]*)\?[^\s'\"]*")
#: Secrets shorter than this are not searched for: a 3-character "secret" would blank out ordinary words.
_MIN_SECRET = 6


def scheme(url: str | os.PathLike) -> str | None:
    """The scheme of a URL that names object storage (``"s3"`` for ``s3://b/k``), else ``None``."""
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    if not isinstance(text, str) or "://" not in text:
        return None
    name = text.split("://", 1)[0].lower()
    return name if name in SCHEMES else None


def is_url(path: Any) -> bool:
    """True for a URL of object storage (``s3://``, ``gs://``, ``az://``, ``hf://``, ...); False for local paths."""
    return isinstance(path, (str, os.PathLike)) and scheme(path) is not None


def check_dataset_path(path: Any) -> None:
    """Refuse a ``scheme://`` that is no object storage dali-pipes reads (``https://``, ``file://``, ...): taken for a
    local path it would be named in errors and cache folders with its ``user:password@`` (``Path`` makes the
    ``//`` one ``/``, which the redaction no longer sees as a URL). The refusal names it redacted."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if isinstance(text, str) and re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", text) and scheme(text) is None:
        raise ValueError(
            f"{redact(text)}: not a URL of object storage that dali-pipes reads "
            f"({', '.join(f'{name}://' for name in SCHEMES if name != 'memory')}) nor a local path; give the "
            "dataset folder's URL in one of those, or download the dataset and give its local path"
        )


def join(url: str, *names: str) -> str:
    """``url`` with ``names`` appended, one ``/`` between each (``join("s3://b/ds/", "index.json")``)."""
    out = url.rstrip("/")
    for name in names:
        out = f"{out}/{name.strip('/')}"
    return out


def secrets_in(storage_options: Mapping[str, Any] | None) -> list[str]:
    """The secret values of ``storage_options`` (nested dicts too) and of the environment."""
    found: list[str] = []

    def walk(options: Mapping[str, Any]) -> None:
        for key, value in options.items():
            if isinstance(value, Mapping):
                walk(value)
            elif isinstance(value, str) and _SECRET_KEY.search(str(key)):
                found.append(value)

    walk(storage_options or {})
    walk(input_options_in_environment() or {})
    found.extend(os.environ[name] for name in SECRET_ENV if os.environ.get(name))
    return [s for s in found if len(s) >= _MIN_SECRET]


def input_options_in_environment() -> dict[str, Any] | None:
    """The input storage options that :data:`INPUT_OPTIONS_ENV` carries: ``{}`` when unset, ``None`` when it
    holds no JSON object (the reader of inputs refuses that; redaction then finds nothing there)."""
    try:
        options = json.loads(os.environ.get(INPUT_OPTIONS_ENV) or "{}")
    except ValueError:
        return None
    return options if isinstance(options, dict) else None


def url_secrets(url: Any) -> list[str]:
    """The secrets inside a URL: the userinfo of ``scheme://user:password@host`` and the query's values."""
    text = str(url)
    found = []
    match = re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://([^/@\s]*)@", text)
    if match and ":" in match.group(1):  # without a password, the userinfo names something (an Azure container)
        found += [match.group(1), match.group(1).partition(":")[2]]
    if "?" in text:
        found += [v for part in text.split("?", 1)[1].split("&") for v in [part.partition("=")[2]] if v]
    return [s for s in found if len(s) >= _MIN_SECRET]


def redact_urls(text: Any) -> str:
    """``text`` (made a string) with the secrets inside URLs replaced by ``***``: ``user:password@``, queries."""
    out = _USERINFO.sub(lambda m: m.group("scheme") + "***@", str(text))
    return _QUERY.sub(lambda m: m.group("url") + "?***", out)


def redact(text: Any, storage_options: Mapping[str, Any] | None = None, extra: Iterable[str] = ()) -> str:
    """``text`` (made a string) with every secret replaced by ``***``: URL passwords and queries, option values,
    and the values of the environment's secret variables (:data:`SECRET_ENV`)."""
    out = redact_urls(text)
    for secret in sorted({*secrets_in(storage_options), *extra}, key=len, reverse=True):
        out = out.replace(secret, "***")
    return out


class RedactingFilter(logging.Filter):
    """Takes the secrets out of every log line a handler writes (:func:`redact`), whichever module logged it.

    It rewrites the record in place (its message made final, its arguments dropped), so the handlers after this
    one see the redacted text too: only text is removed. A record whose arguments do not fit its format is
    left as it is, for the handler to report as logging does.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - the handler's own handleError reports it, as without this filter
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def redact_log_lines(*handlers: logging.Handler) -> None:
    """Have ``handlers`` (default: the root logger's, or logging's last resort when it has none) write no
    secret; a handler that already redacts is left as it is."""
    for handler in handlers or (logging.getLogger().handlers or [logging.lastResort]):
        if handler is not None and not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def redact_values(value: Any) -> Any:
    """``value`` with :func:`redact_urls` applied to every string in it (dicts, lists and tuples walked): a
    source's description as the manifest records it, with no password or signature of an input URL in it.
    The environment's secrets are not searched for: a local path that happened to contain one's value would be
    recorded wrongly, and a source's description holds paths and options, never the environment."""
    if isinstance(value, str):
        return redact_urls(value)
    if isinstance(value, Mapping):
        return {key: redact_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_values(item) for item in value)
    return value


__all__ = [
    "INPUT_OPTIONS_ENV",
    "SCHEMES",
    "SECRET_ENV",
    "check_dataset_path",
    "input_options_in_environment",
    "is_url",
    "join",
    "RedactingFilter",
    "redact",
    "redact_log_lines",
    "redact_urls",
    "redact_values",
    "scheme",
    "secrets_in",
    "url_secrets",
]
