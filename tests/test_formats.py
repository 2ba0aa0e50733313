"""The three shard formats, writer and reader side by side: round trips, determinism,
pickling across processes, LMDB map growth, TFRecord interoperability and damaged files.

Real files in ``tmp_path``, real photos from ``dali_pipes/sample_data``, no mocks.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import re
import struct
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from converters.writers import WRITERS, LmdbShardWriter, writer_class
from dali_pipes.dataset.manifest import Field
from dali_pipes.stores import StoreError, open_store, reader_class, tfexample

FORMATS = ["lmdb", "hdf5", "tfrecord"]

#: The array fields, ``name: (dtype, shape)``: every dtype a shard stores, a scalar, and a variable first axis.
ARRAYS = {
    "label": ("int64", ()),
    "boxes": ("float32", (-1, 4)),
    "f16": ("float16", (4, 640)),
    "f32": ("float32", (3, 3)),
    "f64": ("float64", (2,)),
    "u8": ("uint8", (8, 8)),
    "i32": ("int32", (5,)),
    "u16": ("uint16", (3,)),
    "mask": ("bool", (6,)),
}
FIELDS = {"image": Field.image(), "key": Field.text(), **{name: Field.array(*kind) for name, kind in ARRAYS.items()}}


def make_samples(photos: list[bytes]) -> list[dict]:
    """One sample per photo, with edge values: zero boxes, NaN and -0.0, integer extremes."""
    rng = np.random.default_rng(1234)
    samples = []
    for i, photo in enumerate(photos):
        f32 = rng.standard_normal((3, 3)).astype(np.float32)
        f32[0, 0], f32[0, 1], f32[0, 2] = np.nan, -0.0, np.inf
        i32 = rng.integers(-(2**31), 2**31 - 1, 5, dtype=np.int32)
        i32[:2] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max]
        samples.append(
            {
                "image": photo,
                "key": f"n{i:04d}/photo-é-{i}.jpg".encode("utf-8"),
                "label": np.array([-3, np.iinfo(np.int64).max, np.iinfo(np.int64).min][i] if i < 3 else i, np.int64),
                "boxes": (rng.random(((i * 2) % 5, 4)) * 500).astype(np.float32),  # sample 0 has no boxes
                "f16": rng.standard_normal((4, 640)).astype(np.float16),
                "f32": f32,
                "f64": rng.standard_normal(2),
                "u8": rng.integers(0, 256, (8, 8), dtype=np.uint8),
                "i32": i32,
                "u16": rng.integers(0, 2**16, 3, dtype=np.uint16),
                "mask": rng.random(6) > 0.5,
            }
        )
    return samples


@pytest.fixture(scope="module")
def samples(photo_bytes) -> list[dict]:
    return make_samples(photo_bytes)


def assert_same(got: dict, want: dict, where: str = "") -> None:
    """Equal byte for byte: bytes as bytes; arrays with the same dtype, shape and bits (NaN included)."""
    assert got.keys() == want.keys(), where
    for name, value in want.items():
        if isinstance(value, bytes):
            assert type(got[name]) is bytes and got[name] == value, f"{where} {name}"
        else:
            value = np.asarray(value)
            g = got[name]
            assert isinstance(g, np.ndarray), f"{where} {name}: {type(g)}"
            assert (g.dtype, g.shape) == (value.dtype, value.shape), f"{where} {name}"
            assert g.tobytes() == value.tobytes(), f"{where} {name}"


def write_shard(fmt: str, path: Path, samples: list[dict], fields=FIELDS) -> Path | None:
    """Write one shard; return its index path (TFRecord) or None."""
    with writer_class(fmt)(path, fields) as writer:
        for sample in samples:
            writer.write(sample)
    return writer.index_path()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- round trips


def test_registry_names_every_format():
    assert sorted(WRITERS) == sorted(FORMATS)
    assert {fmt: WRITERS[fmt].suffix for fmt in FORMATS} == {"lmdb": ".lmdb", "hdf5": ".h5", "tfrecord": ".tfrecord"}
    for fmt in FORMATS:
        assert WRITERS[fmt].format == fmt and reader_class(fmt).format == fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_with_writer_and_reader(fmt, samples, tmp_path):
    path = tmp_path / f"shard{WRITERS[fmt].suffix}"
    index = write_shard(fmt, path, samples)
    # Nothing but the shard (and TFRecord's index) is left next to it: no lock files, no spool files.
    expected = {path.name} | ({index.name} if index else set())
    assert {p.name for p in tmp_path.iterdir()} == expected
    assert (index is not None) == (fmt == "tfrecord")
    reader = reader_class(fmt)(path, FIELDS, len(samples), index)
    for i in reversed(range(len(samples))):  # random access, not a scan
        assert_same(reader.read(i), samples[i], f"{fmt} sample {i}")
    with pytest.raises(IndexError):
        reader.read(len(samples))


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_through_open_store(fmt, samples, tmp_path, write_dataset):
    root = write_dataset(tmp_path / "ds", fmt, FIELDS, samples, per_shard=4)
    store = open_store(root)
    assert len(store) == len(samples) and len(store.manifest.shards) == 3
    for i, sample in enumerate(samples):
        assert_same(store[i], sample, f"{fmt} sample {i}")
    assert_same(store[-1], samples[-1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_stores_over_one_dataset_in_one_process(fmt, samples, tmp_path, write_dataset):
    """py-lmdb refuses to open one file twice in a process: readers share it instead."""
    root = write_dataset(tmp_path / "ds", fmt, FIELDS, samples, per_shard=6)
    first, second = open_store(root), open_store(root)
    assert_same(first[1], samples[1])
    assert_same(second[1], samples[1])
    first.close()
    assert_same(second[7], samples[7])  # closing one store leaves the other's shard open
    second.close()
    assert_same(first[2], samples[2])  # and a closed store reopens on the next read
    first.close()


def test_tfrecord_reader_without_index_walks_the_file(samples, tmp_path):
    path = tmp_path / "s.tfrecord"
    write_shard("tfrecord", path, samples)
    reader = reader_class("tfrecord")(path, FIELDS, len(samples), None)
    for i in (5, 0, len(samples) - 1):
        assert_same(reader.read(i), samples[i])


def test_hdf5_layout_is_readable_with_plain_h5py(samples, tmp_path):
    path = tmp_path / "s.h5"
    write_shard("hdf5", path, samples)
    reader = reader_class("hdf5")(path, FIELDS, len(samples))
    assert_same(reader.read(0), samples[0])  # the reader's handle stays open while a user opens the file
    with h5py.File(path, "r") as f:
        offsets = f["image/offsets"][()]
        assert f["image/data"].chunks is None  # contiguous: one sample's read is one range
        assert f["image/data"][offsets[3] : offsets[4]].tobytes() == samples[3]["image"]
        rows = f["boxes/offsets"][()]
        assert np.array_equal(f["boxes/data"][rows[4] : rows[5]], samples[4]["boxes"])
        assert f["label"][7] == samples[7]["label"]
        assert f["f16"].chunks == (12, 4, 640) and f["label"].chunks[0] > 1000  # ~64 KiB chunks
        assert f.attrs["num_samples"] == len(samples)


def test_lmdb_layout_is_readable_with_plain_lmdb(samples, tmp_path):
    path = tmp_path / "s.lmdb"
    write_shard("lmdb", path, samples)
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(b"0000000002/image") == samples[2]["image"]
        assert np.frombuffer(txn.get(b"0000000002/label"), "<i8")[0] == samples[2]["label"]
        assert txn.get(b"__len__") == str(len(samples)).encode()
    env.close()
    assert os.listdir(tmp_path) == ["s.lmdb"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_shard_and_a_field_empty_in_every_sample(fmt, tmp_path):
    fields = {"boxes": Field.array("float32", (-1, 4)), "blob": Field(kind="bytes", encoding="raw")}
    empty = tmp_path / f"empty{WRITERS[fmt].suffix}"
    index = write_shard(fmt, empty, [], fields)
    reader = reader_class(fmt)(empty, fields, 0, index)
    with pytest.raises(IndexError):
        reader.read(0)
    path = tmp_path / f"s{WRITERS[fmt].suffix}"
    want = [{"boxes": np.zeros((0, 4), np.float32), "blob": b""} for _ in range(3)]
    index = write_shard(fmt, path, want, fields)
    reader = reader_class(fmt)(path, fields, 3, index)
    for i in range(3):
        assert_same(reader.read(i), want[i])


# --------------------------------------------------------------------------- reading some fields

#: Field subsets read on their own: bytes, scalars, ragged, float16 bytes, reordered, none at all.
SUBSETS = [("label",), ("image", "label"), ("boxes", "f16", "key"), ("mask", "image", "f64"), (), tuple(FIELDS)[::-1]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_of_some_fields_returns_exactly_those_of_a_full_read(fmt, samples, tmp_path, write_dataset):
    root = write_dataset(tmp_path / "ds", fmt, FIELDS, samples, per_shard=4)
    some, full = open_store(root), open_store(root)
    for i in reversed(range(len(samples))):
        for names in SUBSETS:  # `some` reads subsets only: a field's first read may well be in a subset
            got = some.read(i, list(names))
            assert list(got) == list(names), f"{fmt} sample {i}: {names}"  # those, in the order asked for
            assert_same(got, {name: samples[i][name] for name in names}, f"{fmt} sample {i} {names}")
        whole = full[i]
        assert_same(whole, samples[i], f"{fmt} sample {i}")
        assert_same(full.read(i, ("key", "u8")), {"key": whole["key"], "u8": whole["u8"]})
    assert_same(some.read(-1, None), samples[-1])  # None: every field, as store[i]
    assert_same(some.read(3, (name for name in ["i32", "i32"])), {"i32": samples[3]["i32"]})  # any iterable
    # The shard readers take the same argument, with the shard's own indices.
    reader = open_store(root).shard_readers[1]
    assert_same(reader.read(1, ["u16", "boxes"]), {"u16": samples[5]["u16"], "boxes": samples[5]["boxes"]})


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_unknown_field_is_refused_naming_it_and_the_fields(fmt, samples, tmp_path, write_dataset):
    root = write_dataset(tmp_path / "ds", fmt, FIELDS, samples, per_shard=4)
    store = open_store(root)
    fields = re.escape(str(sorted(FIELDS)))
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(root))}: the dataset has no field 'imgae' \(fields: {fields}\)$"
    ):
        store.read(0, ["label", "imgae"])
    shard = root / f"shard-00000{WRITERS[fmt].suffix}"
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(shard))}: the dataset has no field 'nope' \(fields: {fields}\)$"
    ):
        store.shard_readers[0].read(0, ["nope"])
    with pytest.raises(TypeError, match="not the string 'image'"):
        store.read(0, "image")  # a string is iterable: it would ask for the fields 'i', 'm', ...
    assert_same(store.read(0, ["image"]), {"image": samples[0]["image"]})  # and the store still reads


def test_tfrecord_read_of_some_fields_still_checks_the_whole_record(samples, tmp_path, write_dataset):
    """The CRC covers the whole record: damage in a feature not asked for is still caught."""
    root = write_dataset(tmp_path / "ds", "tfrecord", FIELDS, samples, per_shard=20)
    shard = root / "shard-00000.tfrecord"
    raw = bytearray(shard.read_bytes())
    at = raw.find(samples[4]["image"])
    assert at > 0 and raw.find(samples[4]["image"], at + 1) < 0
    raw[at + 100] ^= 0x40  # inside sample 4's image
    shard.write_bytes(bytes(raw))
    store = open_store(root)
    with pytest.raises(StoreError, match=r"shard-00000\.tfrecord.*record 4.*data CRC"):
        store.read(4, ["label"])
    assert_same(store.read(5, ["label"]), {"label": samples[5]["label"]})


def test_hdf5_checks_a_field_when_it_is_first_read(samples, tmp_path):
    """A field's datasets are opened and checked on its first read; the other fields never are."""
    path = tmp_path / "s.h5"
    write_shard("hdf5", path, samples)
    with h5py.File(path, "r+") as f:
        del f["boxes/offsets"]  # the ragged field's offsets are gone
    reader = reader_class("hdf5")(path, FIELDS, len(samples))
    assert_same(reader.read(2, ["label", "image"]), {"label": samples[2]["label"], "image": samples[2]["image"]})
    with pytest.raises(StoreError, match=r"s\.h5: field 'boxes' has no dataset 'boxes/offsets'"):
        reader.read(2)
    with pytest.raises(StoreError, match="'boxes' has no dataset"):
        reader.read(2, ["boxes"])


# --------------------------------------------------------------------------- what writers refuse


@pytest.mark.parametrize("fmt", FORMATS)
def test_writer_refuses_samples_that_would_not_read_back(fmt, samples, tmp_path):
    writer = writer_class(fmt)(tmp_path / f"s{WRITERS[fmt].suffix}", FIELDS)
    bad_cases = [
        ({**samples[0], "f32": samples[0]["f32"].astype(np.float64)}, "f32"),  # would round
        ({**samples[0], "i32": samples[0]["i32"].astype(np.int64)}, "i32"),  # could wrap
        ({**samples[0], "boxes": np.zeros((2, 5), np.float32)}, "boxes"),
        ({**samples[0], "f16": samples[0]["f16"][:3]}, "f16"),
        ({k: v for k, v in samples[0].items() if k != "label"}, "label"),
        ({**samples[0], "extra": b"x"}, "extra"),
    ]
    for sample, name in bad_cases:
        with pytest.raises(ValueError, match=name):
            writer.write(sample)
    with pytest.raises(TypeError, match="image"):
        writer.write({**samples[0], "image": 42})
    writer.write({**samples[0], "label": np.int32(7), "key": "text is encoded"})  # safe cast, str for utf-8
    writer.close()
    got = reader_class(fmt)(writer.path, FIELDS, 1, writer.index_path()).read(0)
    assert got["label"].dtype == np.int64 and got["label"] == 7 and got["key"] == b"text is encoded"


def test_writer_refuses_fields_without_recoverable_shape(tmp_path):
    with pytest.raises(ValueError, match="rows"):
        writer_class("tfrecord")(tmp_path / "s.tfrecord", {"x": Field.array("float32", (-1, 0))})
    with pytest.raises(ValueError, match="object|dtype"):
        writer_class("lmdb")(tmp_path / "s.lmdb", {"x": Field(kind="array", dtype="datetime64", shape=(2,))})
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_samples_give_the_same_bytes(fmt, samples, tmp_path):
    digests = []
    for run in range(2):
        path = tmp_path / f"run{run}{WRITERS[fmt].suffix}"
        index = write_shard(fmt, path, samples)
        digests.append((sha256(path), sha256(index) if index else None))
    assert digests[0] == digests[1]
    # And a different sample order gives different bytes (the comparison can fail).
    path = tmp_path / f"other{WRITERS[fmt].suffix}"
    write_shard(fmt, path, samples[::-1])
    assert sha256(path) != digests[0][0]


def _write_and_hash(args: tuple[str, str, list[dict]]) -> tuple[str, str | None]:
    fmt, path, samples = args
    index = write_shard(fmt, Path(path), samples)
    return sha256(Path(path)), sha256(index) if index else None


def test_same_bytes_from_another_process(samples, tmp_path):
    """A spawned worker (fresh interpreter, different memory) writes the same bytes as this process."""
    jobs = [(fmt, str(tmp_path / f"{name}{WRITERS[fmt].suffix}"), samples) for fmt in FORMATS for name in ("spawned",)]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        spawned = pool.map(_write_and_hash, jobs)
    here = [_write_and_hash((fmt, str(tmp_path / f"here{WRITERS[fmt].suffix}"), samples)) for fmt in FORMATS]
    assert spawned == here


# --------------------------------------------------------------------------- processes


def _read_all_into(stores, queue) -> None:
    queue.put([[store[i] for i in range(len(store))] for store in stores])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_stores_work_in_fork_and_spawn_workers(method, samples, tmp_path, write_dataset):
    """Stores used in this process, then inherited by fork (handles reopened) or pickled for spawn."""
    stores = []
    for fmt in FORMATS:
        store = open_store(write_dataset(tmp_path / fmt, fmt, FIELDS, samples, per_shard=5))
        assert_same(store[6], samples[6])  # handles are open in this process before the worker starts
        blob = pickle.dumps(store)
        assert b"_h_" not in blob  # no handle travels
        stores.append(pickle.loads(blob) if method == "spawn" else store)
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    worker = ctx.Process(target=_read_all_into, args=(stores, queue))  # fork: inherited as they are
    worker.start()
    results = queue.get(timeout=120)
    worker.join(timeout=60)
    assert worker.exitcode == 0
    for fmt, got in zip(FORMATS, results):
        assert len(got) == len(samples)
        for i, sample in enumerate(samples):
            assert_same(got[i], sample, f"{fmt} in {method} worker, sample {i}")
    for store in stores:  # the parent's handles still work after the worker used its own
        assert_same(store[3], samples[3])


# --------------------------------------------------------------------------- LMDB map growth


def test_lmdb_map_grows_instead_of_failing(tmp_path):
    fields = {"blob": Field(kind="bytes", encoding="raw"), "n": Field.array("int32", ())}
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(300_000) for _ in range(40)]  # 12 MB into a 64 KiB map; one value outgrows two doublings
    path = tmp_path / "grow.lmdb"
    with LmdbShardWriter(path, fields, map_size=64 << 10) as writer:
        for i, blob in enumerate(blobs):
            writer.write({"blob": blob, "n": np.int32(i)})
    assert path.stat().st_size > 12_000_000
    again = tmp_path / "again.lmdb"
    with LmdbShardWriter(again, fields, map_size=64 << 10) as writer:
        for i, blob in enumerate(blobs):
            writer.write({"blob": blob, "n": np.int32(i)})
    assert sha256(again) == sha256(path)  # growth happens at the same points, so the bytes repeat
    reader = reader_class("lmdb")(path, fields, len(blobs))
    for i in (0, 17, 39):
        got = reader.read(i)
        assert got["blob"] == blobs[i] and got["n"] == i


class _WriterKeepingItsMap(LmdbShardWriter):
    """The writer as it was before it mapped its file anew after each commit (the control of the test below)."""

    def _drop_mapped_pages(self) -> None:
        pass


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of the file at ``path`` (``/proc/self/smaps``)."""
    total, in_file = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head[0]) > 8 and not head[0].endswith(":"):  # a mapping's first line
                in_file = len(head) >= 6 and head[5] == os.fspath(path)
            elif in_file and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.parametrize("writer_class_", [LmdbShardWriter, _WriterKeepingItsMap], ids=["writer", "control"])
def test_lmdb_writer_keeps_no_more_of_its_file_mapped_as_the_shard_grows(writer_class_, tmp_path):
    """A worker writing a large automatic shard stayed flat in memory only once the map was replaced per commit.

    The control, which keeps one map for the whole shard, holds more and more of the file resident (the pages
    LMDB read back while appending): that is what made LMDB-writing workers grow with N in the scale bench.
    """
    fields = {"blob": Field(kind="bytes", encoding="raw"), "n": Field.array("int32", ())}
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(1000 + i) for i in range(200)]
    path = tmp_path / "big.lmdb"
    after_commit = []  # what stays mapped from one commit to the next
    with writer_class_(path, fields) as writer:
        for i in range(30 * 1024):  # 30 commits of 1,024 samples, ~33 MB
            writer.write({"blob": blobs[i % 200], "n": np.int32(i)})
            if i % 1024 == 1023:
                after_commit.append(_mapped_kib(path))
    early, late = max(after_commit[:5]), max(after_commit[-5:])
    if writer_class_ is LmdbShardWriter:
        assert late <= early + 256, f"the writer's map grew from {early} to {late} KiB while writing"
        control = tmp_path / "control.lmdb"
        with _WriterKeepingItsMap(control, fields) as writer:
            for i in range(30 * 1024):
                writer.write({"blob": blobs[i % 200], "n": np.int32(i)})
        assert sha256(control) == sha256(path)  # mapping the file anew changes no byte of it
    else:
        assert late > early + 1024, f"the control's map did not grow ({early} -> {late} KiB): the test shows nothing"


# --------------------------------------------------------------------------- TFRecord interoperability


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_tfrecord_is_read_by_an_independent_reader_with_valid_crcs(samples, tmp_path):
    import crc32c
    from tfrecord.reader import example_loader

    path = tmp_path / "s.tfrecord"
    index = write_shard("tfrecord", path, samples)
    raw = path.read_bytes()
    records, pos = [], 0
    while pos < len(raw):
        (length,) = struct.unpack_from("<Q", raw, pos)
        (length_crc,) = struct.unpack_from("<I", raw, pos + 8)
        data = raw[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", raw, pos + 12 + length)
        assert _masked(crc32c.crc32c(raw[pos : pos + 8])) == length_crc, f"record {len(records)}"
        assert _masked(crc32c.crc32c(data)) == data_crc, f"record {len(records)}"
        records.append((pos, 16 + length))
        pos += 16 + length
    assert pos == len(raw) and len(records) == len(samples)
    assert index.read_text() == "".join(f"{o} {s}\n" for o, s in records)  # what tfrecord2idx writes

    # Parsed by the manifest's dtypes, as a TensorFlow user would: numbers as float or int lists
    # (float64 alone stays raw bytes: no TensorFlow list holds it exactly).
    description = {name: _tf_type(field) for name, field in FIELDS.items()}
    assert description["u8"] == description["mask"] == "int" and description["f16"] == "float"
    parsed = list(example_loader(str(path), str(index), description, shard=(0, 1)))
    assert len(parsed) == len(samples)
    for got, want in zip(parsed, samples):
        assert got["image"] == want["image"] and got["key"] == want["key"]
        assert got["label"].tolist() == [int(want["label"])]
        assert got["boxes"].tobytes() == want["boxes"].tobytes()
        assert got["f32"].tobytes() == want["f32"].tobytes()
        for name in ("i32", "u8", "u16", "mask"):
            assert got[name].tolist() == want[name].ravel().astype(np.int64).tolist(), name
        assert got["f16"].tolist() == want["f16"].ravel().astype(np.float32).tolist()
        assert got["f64"] == want["f64"].astype("<f8").tobytes()


def _tf_type(field: Field) -> str:
    """The ``tfrecord`` package's name of the list a TensorFlow user parses a field as, from its dtype."""
    if field.kind == "bytes":
        return "byte"
    dtype = np.dtype(field.dtype)
    if dtype.kind == "f" and dtype.itemsize <= 4:
        return "float"
    return "int" if dtype.kind in "biu" and dtype != np.uint64 else "byte"


def test_tfrecord_shards_of_the_raw_bytes_layout_still_read(samples):
    """Shards written before the int64/float lists kept every array but float32 and wide ints as raw bytes."""
    from dali_pipes.stores.codec import array_to_bytes
    from dali_pipes.stores.tfexample import decode_sample, encode_example

    want = samples[3]
    legacy = {name: ("bytes_list", [array_to_bytes(want[name])]) for name in ("f16", "u8", "mask", "f64")}
    got = decode_sample({k: FIELDS[k] for k in legacy}, encode_example(legacy), "old.tfrecord: record 0")
    for name in legacy:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def test_tfrecord_int_list_out_of_its_dtype_range_is_refused():
    from dali_pipes.stores.tfexample import decode_sample, encode_example

    data = encode_example({"u8": ("int64_list", np.arange(64) * 5)})
    with pytest.raises(StoreError, match=r"'u8'.*outside uint8's range 0\.\.255"):
        decode_sample({"u8": FIELDS["u8"]}, data, "x.tfrecord: record 0")


def test_dali_native_tfrecord_reader_reads_the_shard(samples, tmp_path):
    import nvidia.dali.fn as fn
    import nvidia.dali.tfrecord as tfrec
    from nvidia.dali import pipeline_def

    path = tmp_path / "s.tfrecord"
    index = write_shard("tfrecord", path, samples)

    @pipeline_def(batch_size=len(samples), num_threads=1, device_id=None, prefetch_queue_depth=1)
    def pipe():
        out = fn.readers.tfrecord(
            path=[str(path)],
            index_path=[str(index)],
            random_shuffle=False,
            features={
                "image": tfrec.FixedLenFeature((), tfrec.string, ""),
                "label": tfrec.FixedLenFeature([], tfrec.int64, -1),
                "boxes": tfrec.VarLenFeature([4], tfrec.float32, 0.0),
                "i32": tfrec.FixedLenFeature([5], tfrec.int64, 0),
            },
        )
        return out["image"], out["label"], out["boxes"], out["i32"]

    p = pipe()
    p.build()
    images, labels, boxes, ints = p.run()
    for i, want in enumerate(samples):
        assert np.asarray(images.at(i)).tobytes() == want["image"], f"image {i}"
        assert int(np.asarray(labels.at(i))) == int(want["label"])
        assert np.array_equal(np.asarray(boxes.at(i)).reshape(-1, 4), want["boxes"])
        assert np.asarray(ints.at(i)).tolist() == want["i32"].tolist()


@settings(max_examples=60, deadline=None)
@given(
    ints=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=80),
    floats=st.lists(st.floats(width=32, allow_nan=False), max_size=40),
    blobs=st.lists(st.binary(max_size=300), max_size=3),
    name=st.text(min_size=1, max_size=12).filter(lambda s: s not in ("f", "b")),
)
def test_example_codec_matches_protobuf(ints, floats, blobs, name):
    from tfrecord import example_pb2

    features = {
        name: ("int64_list", np.array(ints, dtype=np.int64)),
        "f": ("float_list", np.array(floats, dtype=np.float32)),
        "b": ("bytes_list", blobs),
    }
    data = tfexample.encode_example(features)
    ex = example_pb2.Example()
    ex.ParseFromString(data)
    assert list(ex.features.feature[name].int64_list.value) == ints
    assert np.array_equal(np.array(ex.features.feature["f"].float_list.value, np.float32), np.array(floats, np.float32))
    assert list(ex.features.feature["b"].bytes_list.value) == blobs
    # protobuf's own serialization decodes the same way
    decoded = tfexample.decode_example(ex.SerializeToString(), "test")
    assert decoded[name][1].tolist() == ints and decoded["b"][1] == blobs


def test_decoded_arrays_are_writable_copies_that_do_not_hold_the_record():
    """The decoder parses views of the record and copies each value once: what it returns is the copy.

    A float list is a view of the record until that copy; an array returned as a view would be
    read-only, in little-endian order whatever the machine, and would keep the whole record alive.
    """
    fields = {
        "f": Field.array("float32", (2, 4096)),
        "i": Field.array("int64", (-1,)),
        "i16": Field.array("int16", (5,)),
        "h": Field.array("float16", (3,)),
        "b": Field.image(),
    }
    rng = np.random.default_rng(3)
    sample = {
        "f": rng.standard_normal((2, 4096)).astype(np.float32),
        "i": rng.integers(-(2**40), 2**40, 100),
        "i16": np.arange(-2, 3, dtype=np.int16),
        "h": np.array([0.5, -1, 2], np.float16),
        "b": b"\xff\xd8" + bytes(range(256)),
    }
    data = bytearray(tfexample.encode_sample(fields, sample))
    got = tfexample.decode_sample(fields, memoryview(data), "copies")
    assert got["b"] == sample["b"] and type(got["b"]) is bytes
    for name in ("f", "i", "i16", "h"):
        value = got[name]
        assert value.dtype == sample[name].dtype and value.tobytes() == sample[name].tobytes(), name
        assert value.flags.writeable and value.dtype.isnative, name
        assert not np.shares_memory(value, np.frombuffer(data, np.uint8)), name
    data[:] = bytes(len(data))  # the record's buffer reused for the next read
    assert got["f"].tobytes() == sample["f"].tobytes()


# Derandomized: the same 100 damages every run. Once (CI, 2026-11-26, the whole suite) hypothesis reported its
# own data generation as inconsistent here, which no run of this test alone reproduced (the code it drives is
# pure Python and deterministic); a fixed sequence keeps a guard test from failing a run on that.
@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_damaged_example_is_a_store_error_or_a_valid_sample(data, photo_bytes):
    """Whatever the damage (when CRCs are not there to catch it), decoding never fails any other way."""
    sample = make_samples(photo_bytes[:1])[0]
    sample["image"] = sample["image"][:64]  # keep the search space small
    encoded = bytearray(tfexample.encode_sample(FIELDS, sample))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(encoded) - 1))
        encoded[pos] = data.draw(st.integers(0, 255))
    encoded = encoded[: data.draw(st.integers(0, len(encoded)))]
    try:
        got = tfexample.decode_sample(FIELDS, bytes(encoded), "fuzz")
    except StoreError:
        return
    for name, field in FIELDS.items():
        value = got[name]
        assert isinstance(value, bytes) if field.kind == "bytes" else value.dtype == np.dtype(field.dtype)


def test_malformed_examples_are_store_errors():
    fields = {"f": Field.array("float32", (-1,)), "b": Field.image(), "i": Field.array("int64", ())}
    good = {
        "f": ("float_list", np.ones(2, np.float32)),
        "b": ("bytes_list", [b"x"]),
        "i": ("int64_list", np.array([5])),
    }
    assert tfexample.decode_sample(fields, tfexample.encode_example(good), "ok")["i"] == 5
    # Example{features{feature{key: "f", value{float_list: 3 packed bytes}}}}, by hand
    float_of_3_bytes = b"\x0a\x0e\x0a\x0c\x0a\x01f\x12\x07\x12\x05\x0a\x03abc"
    # Example{features{feature{key: b"\xff", value{bytes_list{}}}}}
    name_not_utf8 = b"\x0a\x09\x0a\x07\x0a\x01\xff\x12\x02\x0a\x00"
    cases = [
        (float_of_3_bytes, "whole number of floats"),
        (tfexample.encode_example(good)[:-1], "runs past"),
        (tfexample.encode_example({**good, "b": ("bytes_list", [b"x", b"y"])}), "2 byte strings"),
        (tfexample.encode_example({k: v for k, v in good.items() if k != "b"}), "no feature 'b'"),
        (tfexample.encode_example({**good, "i": ("float_list", np.ones(1, np.float32))}), "is a float_list"),
        (
            tfexample.encode_example(
                {**good, "f": ("float_list", np.ones(0, np.float32)), "i": ("int64_list", np.array([1, 2]))}
            ),
            "'i' holds 2",
        ),
        (name_not_utf8, "not UTF-8"),
        (b"\x0b", "wire type 3"),
    ]
    for data, reason in cases:
        with pytest.raises(StoreError, match=f"^where-it-was.*{reason}"):
            tfexample.decode_sample(fields, data, "where-it-was")
    for cut_short in (b"\x05\x80", b"\x01" * 40 + b"\x80"):  # the plain-Python and the numpy paths
        with pytest.raises(StoreError, match="ends inside"):
            tfexample.decode_varints(cut_short, "where-it-was")


# --------------------------------------------------------------------------- damaged shards


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_tfrecord_flipped_byte_is_a_store_error_naming_the_shard(samples, tmp_path, write_dataset):
    root = write_dataset(tmp_path / "ds", "tfrecord", FIELDS, samples, per_shard=20)
    shard = root / "shard-00000.tfrecord"
    offsets = [tuple(map(int, line.split())) for line in (root / "shard-00000.tfrecord.idx").read_text().splitlines()]
    _flip(shard, offsets[2][0] + offsets[2][1] // 2)  # inside record 2's data
    _flip(shard, offsets[5][0] + 3)  # inside record 5's length
    store = open_store(root)
    with pytest.raises(StoreError, match=r"shard-00000\.tfrecord.*record 2.*data CRC"):
        store[2]
    with pytest.raises(StoreError, match=r"shard-00000\.tfrecord.*record 5.*length CRC"):
        store[5]
    assert_same(store[3], samples[3])  # the rest of the shard is still readable


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("keep", [0.6, 0.97, 100])
def test_truncated_shard_is_a_store_error_never_garbage(fmt, keep, samples, tmp_path, write_dataset):
    root = write_dataset(tmp_path / "ds", fmt, FIELDS, samples, per_shard=20)
    shard = root / f"shard-00000{WRITERS[fmt].suffix}"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(int(size * keep) if keep < 1 else keep)
    store = open_store(root)
    errors = 0
    for i, sample in enumerate(samples):
        try:
            got = store[i]
        except StoreError as exc:
            assert shard.name in str(exc)
            errors += 1
        else:
            assert_same(got, sample, f"sample {i} read from a truncated {fmt} shard")
    assert errors > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_shard_is_a_store_error_naming_it(fmt, samples, tmp_path, write_dataset):
    root = write_dataset(tmp_path / "ds", fmt, FIELDS, samples, per_shard=4)
    (root / f"shard-00001{WRITERS[fmt].suffix}").unlink()
    store = open_store(root)
    assert_same(store[0], samples[0])
    with pytest.raises(StoreError, match=rf"shard-00001\{WRITERS[fmt].suffix}.*missing"):
        store[5]


def test_missing_tfrecord_index_is_a_store_error_naming_it(samples, tmp_path, write_dataset):
    root = write_dataset(tmp_path / "ds", "tfrecord", FIELDS, samples, per_shard=20)
    (root / "shard-00000.tfrecord.idx").unlink()
    with pytest.raises(StoreError, match=r"shard-00000\.tfrecord\.idx.*missing"):
        open_store(root)[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_shard_with_another_sample_count_is_refused(fmt, samples, tmp_path):
    path = tmp_path / f"s{WRITERS[fmt].suffix}"
    index = write_shard(fmt, path, samples)
    with pytest.raises(StoreError, match=f"{path.name}.*the manifest says {len(samples) - 1}"):
        reader_class(fmt)(path, FIELDS, len(samples) - 1, index).read(0)
