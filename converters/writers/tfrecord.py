"""TFRecord shard writer: one ``tf.train.Example`` record per sample, plus DALI's ``.idx``.

The record layout, the field-to-feature mapping and the ``.idx`` format are in
:mod:`dali_pipes.stores.tfexample`, shared with the reader. The index is written
next to the shard as ``<shard path>.idx`` at :meth:`close`, so DALI's
``fn.readers.tfrecord`` can read the shard without running ``tfrecord2idx``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from converters.base import Sample, ShardWriter
from converters.writers._sample import check_fields, normalize_sample
from dali_pipes.dataset.manifest import Field
from dali_pipes.stores.tfexample import FOOTER_SIZE, HEADER_SIZE, encode_sample, frame_footer, frame_header, index_line


class TFRecordShardWriter(ShardWriter):
    """Writes a ``.tfrecord`` shard and its ``.tfrecord.idx`` index."""

    format = "tfrecord"
    suffix = ".tfrecord"

    def __init__(self, path: str | os.PathLike, fields: Mapping[str, Field]) -> None:
        super().__init__(path, fields)
        check_fields(self.fields, str(self.path))
        self._file = open(self.path, "wb")
        self._offset = 0
        self._index: list[str] = []

    def index_path(self) -> Path:
        """``<shard path>.idx``: DALI's index, one ``offset size`` line per record."""
        return Path(f"{self.path}.idx")

    def write(self, sample: Sample) -> None:
        """Append one sample as an Example record."""
        where = f"{self.path}: sample {self.num_samples}"
        data = encode_sample(self.fields, normalize_sample(self.fields, sample, where))
        # Three writes rather than one concatenation: the data can be megabytes.
        self._file.write(frame_header(len(data)))
        self._file.write(data)
        self._file.write(frame_footer(data))
        size = HEADER_SIZE + len(data) + FOOTER_SIZE
        self._index.append(index_line(self._offset, size))
        self._offset += size
        self.num_samples += 1

    def close(self) -> None:
        """Flush and fsync the shard, then write and fsync its index."""
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        with open(self.index_path(), "w", encoding="ascii", newline="\n") as idx:
            idx.write("".join(self._index))
            idx.flush()
            os.fsync(idx.fileno())

    def abort(self) -> None:
        """Close the shard without writing the index; the runner removes what is left."""
        self._file.close()
