"""The package version, read once from the installed metadata.

A module of its own so that ``converters`` (which stamps the version into each
manifest) and the CLI can read it without importing the loader.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    # pyproject.toml is the one place the version is written; the installed metadata carries it here.
    __version__ = version("dali-pipes")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
