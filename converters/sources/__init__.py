"""Input sources: where the samples of a conversion come from.

Each source is a :class:`converters.base.Source`; :data:`SOURCES` maps the
``dali-pipes convert`` sub-command (and the manifest's ``source.kind``) to its class.
"""

from __future__ import annotations

from converters.base import Source
from converters.sources.arrays import ArraysSource
from converters.sources.coco import CocoSource
from converters.sources.imagefolder import IMAGE_EXTENSIONS, ImageFolderSource
from converters.sources.listfile import TWO_COLUMN_RULE, ListFileSource
from converters.sources.parquet import ParquetSource
from converters.sources.plainlmdb import LmdbSource
from converters.sources.segmentation import SegmentationSource
from converters.sources.tfrecords import TFRecordSource
from converters.sources.webdataset import WebDatasetSource

SOURCES: dict[str, type[Source]] = {
    ImageFolderSource.kind: ImageFolderSource,
    ListFileSource.kind: ListFileSource,
    CocoSource.kind: CocoSource,
    ArraysSource.kind: ArraysSource,
    WebDatasetSource.kind: WebDatasetSource,
    TFRecordSource.kind: TFRecordSource,
    LmdbSource.kind: LmdbSource,
    ParquetSource.kind: ParquetSource,
    SegmentationSource.kind: SegmentationSource,
}

#: Modules of the packed-input sources; each has ``KIND``, ``HELP``, ``add_arguments(parser)`` and
#: ``from_args(args, image_options) -> (source, out)``, so that the CLI only registers them.
PACKED_SOURCE_MODULES = (
    "converters.sources.webdataset",
    "converters.sources.tfrecords",
    "converters.sources.plainlmdb",
    "converters.sources.parquet",
    "converters.sources.segmentation",
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "SOURCES",
    "TWO_COLUMN_RULE",
    "ArraysSource",
    "CocoSource",
    "ImageFolderSource",
    "ListFileSource",
    "LmdbSource",
    "PACKED_SOURCE_MODULES",
    "ParquetSource",
    "SegmentationSource",
    "TFRecordSource",
    "WebDatasetSource",
]
