"""Command-line arguments for datasets that may be URLs: the dataset argument and ``--storage-option``.

Credentials are best left where the backend looks by itself (environment, ``~/.aws``, ``gcloud``
login, ``HF_TOKEN``): a value on the command line is visible to other users of the machine.
``--storage-option`` is for the rest: an endpoint, a region, ``anon=true``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from dali_pipes.remote.urls import is_url


def dataset_arg(text: str) -> str | Path:
    """A URL stays a string (``Path`` would fold ``s3://`` into ``s3:/``); anything else is a local path."""
    return text if is_url(text) else Path(text)


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable): options for the fsspec backend of a URL."""
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option for the object-storage backend of a URL (repeatable), e.g. endpoint_url=http://host:9000, "
        "anon=true, client_kwargs.region_name=eu-west-1; VALUE is read as JSON when it parses",
    )


def storage_options(args: argparse.Namespace, attribute: str = "storage_option") -> dict[str, Any] | None:
    """The ``--storage-option`` values (``attribute``: another such option's) as a (nested, for dotted keys)
    dict; ``None`` when none were given."""
    options: dict[str, Any] = {}
    flag = "--" + attribute.replace("_", "-")
    for item in getattr(args, attribute, None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item.split('=')[0]!r}: expected KEY=VALUE")
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        *parents, last = key.split(".")
        where = options
        for name in parents:
            where = where.setdefault(name, {})
        where[last] = parsed
    return options or None


def add_output_url_options(parser: argparse.ArgumentParser) -> None:
    """``--work-dir`` and ``--storage-option``, for an output that is a URL (``convert ... s3://bucket/ds``), and
    ``--input-storage-option`` for inputs that are URLs."""
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="with an output URL: the local folder shards are written in before their upload, a few at a time "
        "(default: under $DALI_PIPES_CACHE or ~/.cache/dali-pipes)",
    )
    add_storage_options(parser)
    parser.add_argument(
        "--input-storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option for the object-storage backend of the input URLs (repeatable; as --storage-option, which "
        "is the output's): e.g. endpoint_url=http://host:9000, anon=true",
    )


def reading_inputs(args: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    """The context in which a ``convert`` command builds its source and runs: its ``--input-storage-option``
    values in force for every input URL (nothing to do for other commands, or without the option)."""
    options = storage_options(args, "input_storage_option")
    if not options:
        return contextlib.nullcontext()
    from converters.remote_inputs import input_storage_options

    return input_storage_options(options)


def convert_to_url_from_args(args: argparse.Namespace):
    """:func:`converters.upload.convert_to_url` with this command's ``--work-dir`` and ``--storage-option``."""
    import functools

    from converters.upload import convert_to_url

    return functools.partial(convert_to_url, work_dir=args.work_dir, storage_options=storage_options(args))


#: Loggers of the object-storage backends: their INFO lines ("Found credentials in environment variables.")
#: are not for the people reading a command's output; with -v they show.
BACKEND_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec", "gcsfs", "adlfs", "azure", "huggingface_hub")


def quiet_backends(verbose: bool) -> None:
    """Keep the backends' own log lines to warnings (to INFO with ``-v``: their DEBUG lines quote whole requests)."""
    for name in BACKEND_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)


def shown(path: str | os.PathLike) -> str:
    """How a dataset argument is printed (a URL without its secrets)."""
    from dali_pipes.remote.urls import redact

    return redact(path)


__all__ = [
    "add_output_url_options",
    "add_storage_options",
    "convert_to_url_from_args",
    "dataset_arg",
    "quiet_backends",
    "reading_inputs",
    "shown",
    "storage_options",
]
