"""A shard task carries its own slice of the input only: its size and start-up work do not grow with N.

For every converter source, the task the runner sends for one 10-sample shard is
pickled from a small input and from one 10x larger; the two must be the same size
within a few bytes (the shard's own items differ only in their names), and running
the task must not read more bytes from the larger input (counted by the kernel in
``/proc/self/io``) nor allocate more memory (``tracemalloc``'s peak): before, every
list-file task re-read and parsed the whole list.
"""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import tracemalloc
from pathlib import Path

import lmdb
import numpy as np
import pytest
from test_tfrecord_source import imagenet_example, write_records

from converters.base import ConversionError
from converters.input_plan import plan_input
from converters.jobdir import legacy_job_digest
from converters.runner import JOB_DIR, convert, shard_tasks, write_shard
from converters.sources.arrays import ArraysSource
from converters.sources.coco import CocoSource
from converters.sources.imagefolder import ImageFolderSource
from converters.sources.listfile import ListFileSource
from converters.sources.plainlmdb import LmdbSource
from converters.sources.segmentation import SegmentationSource
from converters.sources.tfrecords import TFRecordSource
from converters.sources.webdataset import WebDatasetSource
from converters.synth import render

PER_SHARD = 10
SMALL, LARGE = 40, 400


def _photo(imagenet_mini: Path) -> Path:
    return sorted(p for p in imagenet_mini.glob("*/*") if p.suffix.lower() in (".jpg", ".jpeg"))[0]


def _list_source(root: Path, n: int, photo: Path) -> ListFileSource:
    (root / "photo.jpg").symlink_to(photo)
    # Long keys, so that re-reading the larger list would show well above the noise.
    (root / "list.txt").write_text("".join(f"key{i:0100d} photo.jpg {i % 7}\n" for i in range(n)))
    return ListFileSource(root / "list.txt")


def _arrays_source(root: Path, n: int, photo: Path) -> ArraysSource:
    np.save(root / "feats.npy", np.arange(n * 16, dtype=np.float32).reshape(n, 16))
    return ArraysSource([root / "feats.npy"])


def _imagefolder_source(root: Path, n: int, photo: Path) -> ImageFolderSource:
    for i in range(n):
        folder = root / "images" / f"class{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{i:06d}.jpg").symlink_to(photo)
    return ImageFolderSource(root / "images")


def _coco_source(root: Path, n: int, photo: Path) -> CocoSource:
    (root / "images").mkdir()
    images, annotations = [], []
    for i in range(n):
        (root / "images" / f"{i:06d}.jpg").symlink_to(photo)
        images.append({"id": i + 1, "file_name": f"{i:06d}.jpg", "height": 10, "width": 10})
        annotations.append({"id": i + 1, "image_id": i + 1, "category_id": 1, "bbox": [1, 1, 2, 2], "iscrowd": 0})
    categories = [{"id": 1, "name": "thing"}]
    (root / "instances.json").write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories})
    )
    return CocoSource(root / "images", root / "instances.json")


def _webdataset_source(root: Path, n: int, photo: Path) -> WebDatasetSource:
    image = photo.read_bytes()
    with tarfile.open(root / "train.tar", "w") as tar:  # one tar: a task must start at its own sample's header
        for i in range(n):
            for name, data in ((f"s{i:06d}.jpg", image), (f"s{i:06d}.cls", str(i % 7).encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return WebDatasetSource([root / "train.tar"])


def _tfrecord_source(root: Path, n: int, photo: Path) -> TFRecordSource:
    image = photo.read_bytes()
    write_records(root / "train.tfrecord", [imagenet_example(f"s{i:06d}.jpg", image, i % 7, []) for i in range(n)])
    return TFRecordSource([root / "train.tfrecord"])


def _parquet_source(root: Path, n: int, photo: Path):
    from test_parquet_source import write_hf_parquet  # needs pyarrow (the parquet extra, in the test extra)

    from converters.sources import ParquetSource

    # A larger Parquet input is more files (a file's footer grows with its row groups, and every reader of the
    # file reads it whole): 40 rows a file, in row groups of 7.
    rows = [(f"s{i:06d}.jpg", photo.read_bytes(), i % 3) for i in range(n)]
    files = [write_hf_parquet(root / f"train-{k:03d}.parquet", rows[k : k + 40], group=7) for k in range(0, n, 40)]
    return ParquetSource(files)


def _segmentation_pairs_source(root: Path, n: int, photo: Path) -> SegmentationSource:
    from PIL import Image

    (root / "photo.jpg").symlink_to(photo)
    with Image.open(photo) as image:  # a label map of the photo's size: the task converts its samples
        Image.new("L", image.size, 3).save(root / "mask.png")
    (root / "pairs.txt").write_text("".join("photo.jpg mask.png\n" for _ in range(n)))
    return SegmentationSource(pairs=root / "pairs.txt")


def _lmdb_source(root: Path, n: int, photo: Path) -> LmdbSource:
    with lmdb.open(str(root / "plain.lmdb"), map_size=1 << 30) as env, env.begin(write=True) as txn:
        for i in range(n):
            txn.put(f"img{i:06d}".encode(), photo.read_bytes())
    return LmdbSource(root / "plain.lmdb")


SOURCES = {
    "list": _list_source,
    "arrays": _arrays_source,
    "imagefolder": _imagefolder_source,
    "coco": _coco_source,
    "webdataset": _webdataset_source,
    "tfrecord": _tfrecord_source,
    "parquet": _parquet_source,
    "lmdb": _lmdb_source,
    "segmentation-pairs": _segmentation_pairs_source,
}


def _task(make, root: Path, n: int, photo: Path, which: int = 0) -> tuple[bytes, Path]:
    """Shard ``which``'s task (0: the first, -1: the last), pickled as a worker gets it."""
    root.mkdir()
    source = make(root, n, photo)
    inputs = plan_input(source, samples_per_shard=PER_SHARD)
    out = root / "out"
    (out / JOB_DIR).mkdir(parents=True)
    _, _, args = shard_tasks(source, "lmdb", inputs, [inputs.plans[which]], out, "fail")[0]
    return pickle.dumps((source, *args)), out  # what a worker gets: the shared source, then the task


def _bytes_read() -> int:
    """Bytes this process has read through read() and pread() calls so far (memory maps not included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.parametrize("which", [0, -1], ids=["first", "last"])
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_shard_task_size_and_start_up_work_do_not_grow_with_the_input(tmp_path, imagenet_mini, kind, which):
    photo = _photo(imagenet_mini)
    sizes, read, peaks = [], [], []
    for n in (SMALL, SMALL, LARGE):  # the first run warms imports and caches
        task, out = _task(SOURCES[kind], tmp_path / f"n{len(sizes)}", n, photo, which)
        args = pickle.loads(task)  # what a spawned worker gets
        # The task alone: the source travels once per worker (with its list of input files, O(files)).
        sizes.append((len(pickle.dumps(args[1:])), len(pickle.dumps(args[0]))))
        before = _bytes_read()
        tracemalloc.start()
        record = write_shard(*args)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        read.append(_bytes_read() - before)
        assert record.num_samples == PER_SHARD and not record.errors
    # Identical shards of 10 items; only absolute paths (tmp folder names) may differ by a few bytes.
    assert abs(sizes[2][0] - sizes[1][0]) < 200, sizes
    more_files = 9 if kind == "parquet" else 0  # the larger Parquet input is 10 files instead of 1
    assert abs(sizes[2][1] - sizes[1][1]) < 200 + 100 * more_files, sizes
    # The larger input is 10x the smaller (a list file of ~40 KB more): a task reading it would show.
    assert read[2] - read[1] < 8_000, read
    # Nor hold more memory: 360 more parsed lines or COCO entries would be well over 50 KB.
    assert peaks[2] - peaks[1] < 50_000, peaks


def test_a_list_shard_task_reads_only_its_own_lines_and_never_checks_the_list_again(tmp_path, imagenet_mini):
    # Each task re-parsed the whole list to learn whether it has labels; a streamed one reads its lines from their
    # byte offset, once the list was checked in the parent.
    task, _ = _task(_list_source, tmp_path / "list", LARGE, _photo(imagenet_mini), which=-1)
    args = pickle.loads(task)
    source, plan = args[0], args[2]
    assert args[3] is None and plan.anchor > 0  # no items carried: the last shard's first line, by offset
    lines = Path(source.list_file).read_bytes().splitlines(keepends=True)
    assert plan.anchor == sum(len(line) for line in lines[: plan.start])
    record = write_shard(*args)
    assert record.num_samples == PER_SHARD and "label" in source.fields()


def test_a_shard_whose_input_changed_after_planning_is_refused_and_not_kept(tmp_path, imagenet_mini):
    task, out = _task(_list_source, tmp_path / "list", SMALL, _photo(imagenet_mini), which=-1)
    args = pickle.loads(task)
    listing = Path(args[0].list_file)
    lines = listing.read_text().splitlines(keepends=True)
    listing.write_text("".join(lines[:-1]) + lines[-1].replace("key", "kex"))  # the last key renamed
    with pytest.raises(ConversionError, match=r"shard 3: the input changed while it was converted"):
        write_shard(*args)
    assert not list(out.glob("shard-*"))


def test_a_dataset_finished_before_streamed_planning_is_still_recognised_and_a_label_edit_is_seen(tmp_path):
    # Versions before streamed planning hashed every item after the plan; a dataset they finished must still
    # be recognised as this job's (the same command says there is nothing to do), and nothing else may be.
    (tmp_path / "photo.jpg").write_bytes(render(0, size=(16, 16)).tobytes("jpeg", "RGB"))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"k{i} photo.jpg {i % 3}\n" for i in range(12)))
    out = tmp_path / "out"
    old = dict(format="lmdb", samples_per_shard=5, workers=1, progress=False, order="source")  # as they wrote it
    convert(ListFileSource(listing), out, **old)
    manifest = json.loads((out / "index.json").read_text())
    source = ListFileSource(listing)
    inputs = plan_input(source, samples_per_shard=5)
    manifest["source"]["job"] = legacy_job_digest(source, "lmdb", inputs.stream(source), inputs.plans)
    del manifest["order"]
    (out / "index.json").write_text(json.dumps(manifest))
    assert convert(ListFileSource(listing), out, **old).already_complete
    # In the shuffled order this version writes a labelled list by default, it is another dataset.
    with pytest.raises(ConversionError, match="already holds a different dataset"):
        convert(ListFileSource(listing), out, format="lmdb", samples_per_shard=5, workers=1, progress=False)

    # A dataset of this version: its digest covers the labels (the old one only names and sizes, so for a dataset
    # an older version finished, an edited label still goes unseen, as it did then).
    fresh = tmp_path / "fresh"
    convert(ListFileSource(listing), fresh, format="lmdb", samples_per_shard=5, workers=1, progress=False)
    listing.write_text(listing.read_text().replace("k7 photo.jpg 1", "k7 photo.jpg 2"))  # one label edited
    with pytest.raises(ConversionError, match="already holds a different dataset"):
        convert(ListFileSource(listing), fresh, format="lmdb", samples_per_shard=5, workers=1, progress=False)
    manifest["source"]["job"] = "0" * 64  # and a digest of no job at all is another dataset
    (out / "index.json").write_text(json.dumps(manifest))
    with pytest.raises(ConversionError, match="already holds a different dataset"):
        convert(ListFileSource(listing), out, **old)


def test_a_worker_lets_go_of_the_arrays_it_read_once_each_shard_is_written(tmp_path):
    # A memory map kept for a worker's life held every page it had read: 2.6x its peak from 1M to 10M rows.
    np.save(tmp_path / "feats.npy", np.arange(400 * 16, dtype=np.float32).reshape(400, 16))
    source = ArraysSource([tmp_path / "feats.npy"])
    inputs = plan_input(source, samples_per_shard=100)
    out = tmp_path / "out"
    (out / JOB_DIR).mkdir(parents=True)
    for plan in inputs.plans:
        assert write_shard(source, "hdf5", plan, None, out, "fail").num_samples == 100
        assert not source._handles  # no map of feats.npy left between shards
