"""``webdataset``: WebDataset tar shards, read in place (no tar is extracted)."""

from __future__ import annotations

import logging
import os
import re
import tarfile
from dataclasses import dataclass
from typing import IO, Any, ClassVar, Iterator, Sequence

import numpy as np

from converters.base import ConversionError, ImageOptions, Item, Sample, SampleError
from converters.images import prepare_image
from converters.remote_inputs import is_url, open_input
from converters.sources._inputs import InputFilesSource, OpenFiles, add_common_arguments, parse_label
from dali_pipes.dataset.manifest import Field

log = logging.getLogger(__name__)

KIND = "webdataset"
HELP = "WebDataset tar shards: KEY.jpg|png|... with KEY.cls (and KEY.json)"
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")

# WebDataset's own rule: the key is the path up to the first dot of the file name, the rest is the extension.
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")

#: Where a member's bytes lie in its tar: (offset, size).
_Span = tuple[int, int]


@dataclass(frozen=True)
class _Members:
    """The members of one sample that are stored; ``None`` where the tar has none."""

    path: str
    key: str
    image: _Span | None
    label: _Span | None
    json: _Span | None
    damage: str | None = None  # where the tar cannot be read on from here: why


class WebDatasetSource(InputFilesSource):
    """Samples of WebDataset tar shards: members sharing a key (``KEY.jpg``, ``KEY.cls``, ...) are one sample.

    Members are grouped as WebDataset groups them: consecutive members with the
    same key, the key being the member path up to the first dot of its file name.
    The image is the first member whose extension is in ``image_exts``; the label
    is the integer text of the ``label_ext`` member (``None``: no label field);
    a ``json_ext`` member, when any sample has one, is kept as the ``json`` text
    field (empty for a sample without). Samples keep their order in the tars, and
    tars the order given. The tars are read in place (uncompressed tars only).

    Streamed: the conversion's process reads the tars' headers as a stream (LAION-sized sets hold
    100M samples), and each shard task reads its samples' headers again from the tar and byte where
    its first sample begins (the items' anchor), one tar after another.

    Fields: ``image``, ``label`` (int64, as stored), ``key`` (the WebDataset key),
    and ``json``. A sample without an image or label, or with a bad one, is a bad
    input (listed in ``errors.jsonl`` with ``--on-error skip``).
    """

    kind: ClassVar[str] = KIND
    file_kind: ClassVar[str] = "tar shard"

    def __init__(
        self,
        shards: Sequence[str | os.PathLike] | str,
        image_options: ImageOptions = ImageOptions(),
        *,
        image_exts: Sequence[str] = IMAGE_EXTENSIONS,
        label_ext: str | None = "cls",
        json_ext: str | None = "json",
        classes_file: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(shards, image_options, classes_file)
        self.image_exts = tuple(e.lower().lstrip(".") for e in image_exts)
        self.label_ext = label_ext.lower().lstrip(".") if label_ext else None
        self.json_ext = json_ext.lower().lstrip(".") if json_ext else None
        if not self.image_exts:
            raise ConversionError("webdataset: give at least one image extension")
        # Kept when pickled (every shard task asks fields()): decided by a whole pass.
        self._has_json: bool | None = None
        self._files = OpenFiles()

    def iter_items(self) -> Iterator[Item]:
        """One item per key, tar by tar, in member order; ``Item.size`` is the sample's bytes in the tar and
        ``Item.anchor`` ``(tar number, byte offset of its first member's header)``."""
        count = with_json = 0
        for item in self.items_from((0, 0)):
            count += 1
            with_json += item.data.json is not None
            yield item
        if not count:
            raise self._no_samples("no samples")
        self._has_json = self.json_ext is not None and with_json > 0

    def items_from(self, anchor: tuple[int, int]) -> Iterator[Item]:
        for number, path, (start,) in self._files_from(anchor):
            for offset, members in _read_tar(path, self, start):
                yield _item(members, (number, offset))

    def fields(self) -> dict[str, Field]:
        if self._has_json is None:
            for _ in self.iter_items():  # a whole pass decides whether any sample has a .json member
                pass
        fields = self._image_fields(self.label_ext is not None)
        fields["key"] = Field.text()
        if self._has_json:
            fields["json"] = Field.text()
        return fields

    def load(self, item: Item) -> Sample:
        members: _Members = item.data
        if members.damage is not None:
            raise SampleError(item.name, members.damage)
        if members.image is None:
            raise SampleError(item.name, f"no image member (.{', .'.join(self.image_exts)}) with this key")
        image = self._files.read(members.path, *members.image, item.name)
        sample: Sample = {"image": prepare_image(image, item.name, self.image_options)}
        if self.label_ext:
            if members.label is None:
                raise SampleError(item.name, f"no .{self.label_ext} member (the label) with this key")
            text = self._files.read(members.path, *members.label, item.name)
            sample["label"] = np.array(parse_label(text, item.name, f".{self.label_ext}"), dtype=np.int64)
        sample["key"] = members.key.encode("utf-8")
        if self._has_json:
            sample["json"] = b"" if members.json is None else self._files.read(members.path, *members.json, item.name)
        return sample

    def describe(self) -> dict[str, Any]:
        return self._described(
            shards=self.patterns, image_exts=list(self.image_exts), label_ext=self.label_ext, json_ext=self.json_ext
        )


def _item(members: _Members, anchor: tuple[int, int]) -> Item:
    size = sum(span[1] for span in (members.image, members.label, members.json) if span is not None)
    return Item(name=f"{members.path}:{members.key}", size=size, data=members, anchor=anchor)


def _read_tar(path: str, source: WebDatasetSource, start: int = 0) -> Iterator[tuple[int, _Members]]:
    """``(byte offset of its first header, members)`` of the samples of one tar from byte ``start`` (a member's
    header) on, in member order, from the headers alone (the data is skipped over).

    Where the tar is damaged (an unreadable header, a truncated file, no end-of-archive
    marker), the samples before it are kept and one more sample names the byte and why;
    tarfile itself would stop there without a word.
    """
    raw, tar = _open_tar(path, start)
    skipped = 0
    with raw, tar:
        group: dict[str, _Span] = {}
        key = None
        begins = damage = None
        try:
            while (info := tar.next()) is not None:
                tar.members.clear()  # headers of a large tar need not pile up: each is used once
                match = _KEY_EXT.match(info.name) if info.isfile() else None
                if match is None:
                    skipped += info.isfile()
                    continue
                if match.group(1) != key and key is not None:
                    yield begins, _members(path, key, group, source)
                    group = {}
                if match.group(1) != key:
                    begins = info.offset  # the first header of this member (a long name's or pax header too)
                key = match.group(1)
                group.setdefault(match.group(2).lower(), (info.offset_data, info.size))
        except tarfile.TarError as exc:
            damage = f"damaged tar ({exc})"
        damage = damage or _end_damage(path, tar.offset)
        if key is not None:
            yield begins, _members(path, key, group, source)
        if damage is not None:
            damage += f"; the members from byte {tar.offset} on cannot be read"
            if start == 0:  # said by the planning pass; a task reading on from a later sample says it again
                log.warning("%s: %s", path, damage)
            yield tar.offset, _Members(path, f"byte {tar.offset}", None, None, None, damage)
    if skipped and start == 0:
        log.warning("%s: %d members without an extension (not part of any sample) were left out", path, skipped)


def _open_tar(path: str, start: int) -> tuple[IO[bytes], tarfile.TarFile]:
    """The file at ``path`` (whose reads are ranged requests in object storage) and the tar read from byte ``start``
    on; the tar leaves the file open when closed, so the caller closes both."""
    raw = open_input(path) if is_url(path) else open(path, "rb")
    try:
        raw.seek(start)
        return raw, tarfile.open(fileobj=raw, mode="r:")
    except tarfile.ReadError as exc:
        raw.close()
        if start:  # a header the planning pass read: the tar changed since (the task's fingerprint says so too)
            raise ConversionError(
                f"{path}: no tar member at byte {start} any more ({exc}); the input changed"
            ) from None
        raise ConversionError(
            f"{path}: not an uncompressed tar ({exc}); tar shards are read in place, so decompress it first"
        ) from None


def _end_damage(path: str, offset: int) -> str | None:
    """Why the tar does not end at ``offset`` with its end-of-archive marker (two zero blocks), or ``None``."""
    with open_input(path) if is_url(path) else open(path, "rb") as f:
        f.seek(offset)
        end = f.read(2 * tarfile.BLOCKSIZE)
    if end == bytes(2 * tarfile.BLOCKSIZE):
        return None
    if not end.strip(b"\0"):
        return "the tar ends without its end-of-archive marker (the file was cut short)"
    return "an unreadable member header (a damaged or truncated tar)"


def _members(path: str, key: str, group: dict[str, _Span], source: WebDatasetSource) -> _Members:
    image = next((group[ext] for ext in source.image_exts if ext in group), None)
    label = group.get(source.label_ext) if source.label_ext else None
    json = group.get(source.json_ext) if source.json_ext else None
    return _Members(path=path, key=key, image=image, label=label, json=json)


# --- the command line -------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The ``dali-pipes convert webdataset`` arguments (the output options are added by the CLI)."""
    parser.add_argument(
        "shards", nargs="+", metavar="SHARD", help="tar shards (paths, globs, 'train-{000000..000146}.tar'), then OUT"
    )
    parser.add_argument(
        "--image-ext",
        default=",".join(IMAGE_EXTENSIONS),
        help=f"image member extensions, first found wins (default: {','.join(IMAGE_EXTENSIONS)})",
    )
    parser.add_argument("--label-ext", default="cls", help="integer label member ('' for none; default: cls)")
    parser.add_argument("--json-ext", default="json", help="metadata member kept as text ('' for none; default: json)")
    add_common_arguments(parser)


def from_args(args, image_options: ImageOptions) -> tuple[WebDatasetSource, str]:
    """The source the parsed command line describes, and the output folder (the last positional argument)."""
    return WebDatasetSource.from_command_line(
        args,
        args.shards,
        "tar shards",
        image_options,
        image_exts=[e for e in args.image_ext.split(",") if e.strip()],
        label_ext=args.label_ext or None,
        json_ext=args.json_ext or None,
    )
