"""``lmdb``: a plain LMDB whose values are encoded images (as ``img2lmdb`` scripts write them).

An LMDB given by URL (``s3://bucket/train.lmdb``) is downloaded first, into a local folder that is
checked for room and removed after the conversion (:mod:`converters.sources.lmdb_download`): an LMDB
is memory-mapped, never opened over the network.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

import lmdb
import numpy as np

from converters.base import (
    ConversionError,
    ImageOptions,
    Item,
    Sample,
    SampleError,
    absolute_path,
    optional_absolute_path,
)
from converters.images import prepare_image
from converters.remote_inputs import is_url
from converters.sources import lmdb_download
from converters.sources._inputs import INTEGER, PackedSource, add_common_arguments, text_lines
from dali_pipes.dataset.manifest import Field

log = logging.getLogger(__name__)

KIND = "lmdb"
HELP = "a plain LMDB whose values are encoded images (keys in byte order or from --keys)"

#: Values checked before the job starts: when none of them is an image, the LMDB is not one of images.
_PROBE = 8


@dataclass(frozen=True)
class _Entry:
    key: bytes
    label: int | None


class LmdbSource(PackedSource):
    """The values of a plain LMDB, each an encoded image; keys in byte order, or those of a key list.

    ``path`` is the LMDB folder (holding ``data.mdb``) or its data file. With
    ``keys_file``, a UTF-8 text file of ``KEY [LABEL]`` lines, only those keys are
    read, in that order, with their integer labels (every line has one or none
    does); a listed key the LMDB lacks is a bad input. Without it every key is
    read, in byte order, and there is no label field.

    A value that is not an image is a bad input; a Python pickle (the layout of
    many ``img2lmdb`` scripts, ``(image, label)`` tuples) is refused as such and
    never unpickled. When none of the first values is an image, the job is refused.

    Fields: ``image``, ``label`` (int64, with a labelled key list), ``key``
    (the LMDB key as text; bytes that are not UTF-8 as ``\\xNN``).
    """

    kind: ClassVar[str] = KIND

    def __init__(
        self,
        path: str | os.PathLike,
        image_options: ImageOptions = ImageOptions(),
        *,
        keys_file: str | os.PathLike | None = None,
        classes_file: str | os.PathLike | None = None,
        download_dir: str | os.PathLike | None = None,
    ) -> None:
        self.path = absolute_path(path)
        self.image_options = image_options
        self.keys_file = optional_absolute_path(keys_file)
        self.classes_file = optional_absolute_path(classes_file)
        self._labelled: bool | None = None  # kept when pickled: every shard task asks fields()
        # A URL: where its LMDB is downloaded (kept when pickled, so that the workers open the same copy).
        self._local = str(lmdb_download.download_folder(self.path, download_dir)) if is_url(self.path) else None
        self._checked_on: str | None = None  # the machine whose copy was downloaded or checked

    def _open(self) -> lmdb.Environment:
        if self._local is None:
            return _open_env(self.path)
        if self._checked_on != socket.gethostname():
            # First use on this machine (the main process, or a Dask worker elsewhere): downloaded, a copy left by
            # an earlier run checked, or another process's download waited for.
            lmdb_download.download_lmdb(self.path, self._local)
            self._checked_on = socket.gethostname()
        return _open_env(self._local)

    def release(self) -> None:
        """Remove the local copy of an LMDB given by URL (the CLI calls this after a conversion that completed);
        a later use downloads it again. Nothing to do for a local LMDB."""
        if self._local is not None:
            _close_env(self._local)
            lmdb_download.remove_download(Path(self._local))

    def iter_items(self) -> Iterator[Item]:
        """One item per key, streamed; ``Item.size`` is the value's size (0 for a listed key the LMDB lacks),
        ``Item.anchor`` the key (every key, in byte order) or the byte offset of its line in the key list."""
        first: list[Item] = []  # the first few, to refuse an LMDB of something else than images up front
        for item in self.items_from(None):
            if len(first) < _PROBE:
                first.append(item)
                if len(first) == _PROBE:
                    self._refuse_non_images(first)
            yield item
        if not first:
            raise ConversionError(f"{self.path}: the LMDB holds no entries")
        if len(first) < _PROBE:
            self._refuse_non_images(first)
        self._labelled = first[0].data.label is not None

    def items_from(self, anchor: bytes | int | None) -> Iterator[Item]:
        with self._open().begin(buffers=True) as txn:
            if self.keys_file is None:
                cursor = txn.cursor()
                found = cursor.first() if anchor is None else cursor.set_range(anchor)
                while found:
                    key = bytes(cursor.key())
                    yield self._item(_Entry(key, None), len(cursor.value()), key)
                    found = cursor.next()
                return
            for offset, entry in _keys_file_entries(Path(self.keys_file), anchor or 0):
                value = txn.get(entry.key)
                yield self._item(entry, 0 if value is None else len(value), offset)

    def _item(self, entry: _Entry, size: int, anchor: bytes | int) -> Item:
        return Item(name=f"{self.path}:{_key_text(entry.key)}", size=size, data=entry, anchor=anchor)

    def _refuse_non_images(self, items: list[Item]) -> None:
        """Stop before the job starts when the first values are all something else than images."""
        reasons = []
        with self._open().begin(buffers=True) as txn:
            for item in items[:_PROBE]:
                try:
                    _image(txn.get(item.data.key), item.name, ImageOptions())
                    return
                except SampleError as exc:
                    reasons.append(exc.reason)
        raise ConversionError(
            f"{self.path}: none of the first {len(reasons)} values is an encoded image ({reasons[0]}); "
            "convert lmdb reads an LMDB whose values are image files (with --keys for a subset of keys)"
        )

    def fields(self) -> dict[str, Field]:
        if self._labelled is None:
            self._labelled = self.keys_file is not None and _first_key(Path(self.keys_file)).label is not None
        return {**self._image_fields(self._labelled), "key": Field.text()}

    def load(self, item: Item) -> Sample:
        entry: _Entry = item.data
        try:
            with self._open().begin() as txn:
                value = txn.get(entry.key)
        except lmdb.Error as exc:
            raise SampleError(item.name, f"cannot read the value ({type(exc).__name__}: {exc})") from None
        sample: Sample = {"image": _image(value, item.name, self.image_options)}
        if self._labelled:
            sample["label"] = np.array(entry.label, dtype=np.int64)
        sample["key"] = _key_text(entry.key).encode("utf-8")
        return sample

    def describe(self) -> dict[str, Any]:
        return self._described(path=self.path, keys_file=self.keys_file)


# py-lmdb refuses to open one environment twice in a process, and a worker process runs many
# tasks, each with its own copy of the source: one read-only handle per path and process, with the
# inode of its data file (a file replaced since, such as a fresh download, is opened anew).
_ENVS: dict[tuple[str, int], tuple[lmdb.Environment, int]] = {}
_ENVS_LOCK = threading.Lock()


def _open_env(path: str) -> lmdb.Environment:
    """This process's read-only handle of the LMDB at ``path`` (an LMDB handle must not cross a fork)."""
    key = (os.path.realpath(path), os.getpid())
    with _ENVS_LOCK:
        if not os.path.exists(path):
            raise ConversionError(f"{path}: no such LMDB (give its folder, holding data.mdb, or that file)")
        try:
            inode = os.stat(os.path.join(path, "data.mdb") if os.path.isdir(path) else path).st_ino
        except OSError:
            inode = -1  # no data file: lmdb.open says so below
        env, opened = _ENVS.get(key, (None, None))
        if env is not None and opened != inode:
            env.close()
            env = None
        if env is None:
            try:
                env = lmdb.open(path, readonly=True, lock=False, readahead=False, subdir=os.path.isdir(path))
            except lmdb.Error as exc:
                raise ConversionError(f"{path}: not an LMDB ({exc})") from None
            _ENVS[key] = (env, inode)
        return env


def _close_env(path: str) -> None:
    """Close this process's handle of the LMDB at ``path`` (before its files are removed)."""
    with _ENVS_LOCK:
        env, _ = _ENVS.pop((os.path.realpath(path), os.getpid()), (None, None))
    if env is not None:
        env.close()


def _image(value: bytes | memoryview | None, name: str, options: ImageOptions) -> bytes:
    """The checked image of one value; :class:`SampleError` for a missing key, a pickle or a non-image."""
    if value is None:
        raise SampleError(name, "no such key in the LMDB")
    value = bytes(value)
    if value[:1] == b"\x80" and value[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise SampleError(name, "the value is a Python pickle, not an encoded image (dali-pipes never unpickles data)")
    return prepare_image(value, name, options)


def _key_text(key: bytes) -> str:
    return key.decode("utf-8", "backslashreplace")


def _keys_file_entries(path: Path, start: int = 0) -> Iterator[tuple[int, _Entry]]:
    """``(byte offset, entry)`` of the ``KEY [LABEL]`` lines from byte ``start`` on (blank and ``#`` lines
    skipped), streamed; every line has a label or none does. Line numbers in errors count from ``start``."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ConversionError(f"{path}: no such key list; give a text file of 'KEY [LABEL]' lines") from None
    except OSError as exc:
        raise ConversionError(f"{path}: cannot read the key list ({exc})") from None
    width = None
    found = False
    with f:
        for number, line_offset, parts in text_lines(f, start, path):
            if len(parts) > 2 or (width is not None and len(parts) != width):
                raise ConversionError(f"{path}:{number}: expected 'KEY LABEL' or 'KEY' on every line, as on the first")
            if len(parts) == 2 and not INTEGER.match(parts[1]):
                raise ConversionError(f"{path}:{number}: label {parts[1]!r} is not an integer")
            width, found = len(parts), True
            yield line_offset, _Entry(parts[0].encode("utf-8"), int(parts[1]) if len(parts) == 2 else None)
    if not found and start == 0:
        raise ConversionError(f"{path}: the key list is empty")


def _first_key(path: Path) -> _Entry:
    """The first entry of a key list (whether it has labels says whether every line has)."""
    for _, entry in _keys_file_entries(path):
        return entry
    raise AssertionError("unreachable: an empty key list raised")


# --- the command line -------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The ``dali-pipes convert lmdb`` arguments (the output options are added by the CLI)."""
    parser.add_argument(
        "src", help="the LMDB: its folder (holding data.mdb) or its data file; or a URL of either (downloaded first)"
    )
    parser.add_argument("out", help="output dataset folder (created)")
    parser.add_argument("--keys", metavar="FILE", help="'KEY [LABEL]' lines: the keys to read, in order, and labels")
    parser.add_argument(
        "--download-dir",
        metavar="DIR",
        help="with an LMDB URL: the local folder it is downloaded into before converting (default: under "
        "$DALI_PIPES_CACHE or ~/.cache/dali-pipes); its room is checked first, and the copy removed once converted",
    )
    add_common_arguments(parser)


def from_args(args, image_options: ImageOptions) -> tuple[LmdbSource, str]:
    """The source the parsed command line describes, and the output folder."""
    source = LmdbSource(
        args.src, image_options, keys_file=args.keys, classes_file=args.classes, download_dir=args.download_dir
    )
    return source, args.out
