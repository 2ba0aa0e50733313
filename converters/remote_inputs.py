"""Inputs of a conversion read from object storage: the one place the sources go for a URL's bytes.

A source keeps its inputs as URLs (``s3://bucket/train-000.tar``) as it keeps local paths, and reads
them through these helpers: a whole small file (an image, a list), a byte range (a tar member, a
TFRecord record: :class:`~converters.sources._inputs.OpenFiles`), or a seekable file whose reads are
ranged requests (a tar's headers, a Parquet file's row groups): the input is streamed, never copied
whole. Credentials and endpoints come from the environment or ``~/.aws`` (as for the backend itself),
from fsspec's configuration (``FSSPEC_S3_ENDPOINT_URL``, ...), or from the storage options given with
:func:`input_storage_options`; the worker processes that read inputs inherit all three through their
environment. Reads are retried with backoff (:mod:`dali_pipes.remote.transfer`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import posixpath
from typing import IO, Any, Iterator, Mapping

from converters.base import ConversionError
from dali_pipes.remote.fs import RemoteError, filesystem
from dali_pipes.remote.transfer import retrying
from dali_pipes.remote.urls import INPUT_OPTIONS_ENV, input_options_in_environment, is_url, scheme

#: Bytes fetched per ranged request when a remote input is read as a file (tar headers, Parquet pages).
BLOCK = 4 << 20


@contextlib.contextmanager
def input_storage_options(options: Mapping[str, Any] | None) -> Iterator[None]:
    """Within this block, input URLs are opened with the backend options ``options`` (an endpoint, a region,
    ``anon``, keys): building a source, planning, and the local worker processes a conversion starts in it.

    The options travel to the workers as JSON in :data:`~dali_pipes.remote.urls.INPUT_OPTIONS_ENV`, as the
    backends' own environment variables do; their secret values are redacted like those
    (:func:`~dali_pipes.remote.urls.redact`). Dask workers read inputs with their own environment. ``None``
    or ``{}`` changes nothing.
    """
    if not options:
        yield
        return
    try:
        text = json.dumps(dict(options))
    except (TypeError, ValueError) as exc:
        raise ConversionError(
            f"input storage options must be JSON values (strings, numbers, booleans, lists, dicts): {exc}; give "
            "a backend object such as a botocore Config as its plain options instead (config_kwargs={...})"
        ) from None
    before = os.environ.get(INPUT_OPTIONS_ENV)
    os.environ[INPUT_OPTIONS_ENV] = text
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INPUT_OPTIONS_ENV, None)
        else:
            os.environ[INPUT_OPTIONS_ENV] = before


def _options_now() -> dict[str, Any] | None:
    options = input_options_in_environment()
    if options is None:
        raise ConversionError(f"{INPUT_OPTIONS_ENV} is not a JSON object; unset it or give one")
    return options or None


def url_fs(url: str) -> tuple[Any, str]:
    """``(fs, path)`` of an input URL (with the :func:`input_storage_options` in force); a
    :class:`ConversionError` naming the URL when it cannot be reached."""
    try:
        return filesystem(url, _options_now())
    except RemoteError as exc:
        raise ConversionError(str(exc)) from None


def read_input(url: str) -> bytes:
    """The whole input at ``url`` (an image, a list file). Raises :class:`RemoteError` (a missing object too)."""
    fs, path = url_fs(url)
    return retrying(lambda: fs.cat_file(path), url, "reading")


def read_range(url: str, offset: int, size: int) -> bytes:
    """``size`` bytes of ``url`` at ``offset`` (one ranged request, retried)."""
    fs, path = url_fs(url)
    return retrying(lambda: fs.cat_file(path, start=offset, end=offset + size), url, f"reading bytes at {offset}")


def open_input(url: str, block: int = BLOCK) -> IO[bytes]:
    """A seekable binary file over ``url`` whose reads are ranged requests of at least ``block`` bytes,
    each retried on its own (a dropped connection costs one block, not the file)."""
    fs, path = url_fs(url)
    size = int(retrying(lambda: fs.info(path), url, "looking it up").get("size") or 0)
    return io.BufferedReader(_RangedFile(url, size), buffer_size=block)


class _RangedFile(io.RawIOBase):
    """The raw side of :func:`open_input`: ``readinto`` is one ranged request (:func:`read_range`)."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos = url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self.size - self.pos)
        if want <= 0:
            return 0
        data = read_range(self.url, self.pos, want)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def expand_url(pattern: str) -> list[str]:
    """The objects a URL pattern names (``s3://b/train-*.tar``), sorted; the URL itself when it has no wildcard.

    Each match keeps the pattern's own spelling up to its last folder without a wildcard: the backend's
    paths drop what its URLs may hold before them (``abfs://container@account.dfs.core.windows.net/``
    names the account, ``hf://datasets/ORG/NAME@REV/`` a revision), which a match must not lose."""
    fs, path = url_fs(pattern)
    if not any(c in path for c in "*?["):
        return [pattern] if retrying(lambda: fs.isfile(path), pattern, "looking it up") else []
    url_dir, path_dir = _static_folder(pattern), _static_folder(path)
    fallback = f"{scheme(pattern)}://"
    return [
        url_dir + match[len(path_dir) :] if match.startswith(path_dir) else fallback + match
        for match in sorted(retrying(lambda: fs.glob(path), pattern, "listing"))
    ]


def _static_folder(text: str) -> str:
    """``text`` up to and with the last ``/`` before its first wildcard."""
    first = min(i for i in (text.find(c) for c in "*?[") if i >= 0)
    return text[: text.rfind("/", 0, first) + 1]


def beside(base: str, rel: str) -> str:
    """``rel`` resolved against the folder of ``base`` (a URL or a local path); absolute paths and URLs stay."""
    if is_url(rel) or posixpath.isabs(rel) or not is_url(base):
        return rel if (is_url(rel) or posixpath.isabs(rel)) else posixpath.join(posixpath.dirname(base), rel)
    return posixpath.join(posixpath.dirname(base), rel)


def tree(url: str) -> dict[str, int]:
    """``{path relative to url: size}`` of every object below ``url`` (hidden names left out), listed once for
    the input storage options in force."""
    return _tree(url, os.environ.get(INPUT_OPTIONS_ENV))


@functools.lru_cache(maxsize=4)
def _tree(url: str, options: str | None) -> dict[str, int]:
    """:func:`tree`, cached by URL and options (another endpoint or account may list other objects)."""
    fs, root = url_fs(url)
    root = root.rstrip("/")
    found = retrying(lambda: fs.find(root, detail=True), url, "listing")
    out = {}
    for path, info in found.items():
        rel = path[len(root) :].lstrip("/")
        if rel and info.get("type", "file") == "file" and not any(part.startswith(".") for part in rel.split("/")):
            out[rel] = int(info.get("size") or 0)
    return dict(sorted(out.items()))


def class_folders(url: str) -> tuple[list[str], list[str], dict[str, list[tuple[str, int]]]]:
    """An image-folder tree at ``url``: its class names (sorted), the files loose in its root, and the
    ``(relative path, size)`` of the files below each class, sorted."""
    classes: dict[str, list[tuple[str, int]]] = {}
    loose = []
    for rel, size in tree(url).items():
        top, sep, _ = rel.partition("/")
        if sep:
            classes.setdefault(top, []).append((rel, size))
        else:
            loose.append(rel)
    return sorted(classes), loose, classes


__all__ = [
    "BLOCK",
    "beside",
    "class_folders",
    "expand_url",
    "input_storage_options",
    "is_url",
    "open_input",
    "read_input",
    "read_range",
    "tree",
    "url_fs",
]
