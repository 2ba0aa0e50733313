"""Datasets in object storage: ``s3://``, ``gs://``, ``az://``, ``hf://`` URLs wherever a path is taken.

Reached through fsspec and its optional backends (the extras ``s3``, ``gcs``, ``azure``, ``hf``),
imported only when a URL of theirs is used:

- ``urls``: is it a URL, joining names onto it, and taking secrets out of anything shown;
- ``fs``: the filesystem of a URL (with timeouts and retries set), and errors that name the URL and what to do;
- ``transfer``: whole-object downloads and uploads, checked by size and hash, retried with backoff;
- ``destination``: whether a conversion can write to a URL, asked before any work.
"""

from dali_pipes.remote.fs import RemoteError, filesystem, read_bytes, remote_errors
from dali_pipes.remote.urls import is_url, join, redact

__all__ = ["RemoteError", "filesystem", "is_url", "join", "read_bytes", "redact", "remote_errors"]
