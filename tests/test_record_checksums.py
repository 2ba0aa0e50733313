"""The CRC32C of every record of LMDB and HDF5 shards: written by the writers, checked on every read and by verify.

Real shards written by the writers, damaged on disk in place (size unchanged)
the way a bad disk or a stray write would: the store must refuse the damaged
record, naming shard, record and sample, and never hand its bytes over.
(The loader's side, with workers and DDP ranks, is in ``test_loader_faults.py``.)
"""

from __future__ import annotations

import json
import logging

import google_crc32c
import h5py
import lmdb
import numpy as np
import pytest

from converters.merge import merge_hdf5
from dali_pipes import StoreError, open_store
from dali_pipes.cli.verify import verify_dataset
from dali_pipes.dataset.manifest import ManifestError, load_manifest, parse_manifest
from dali_pipes.stores.checksum import CRC_DATASET, RecordChecksumError
from dali_pipes.stores.lmdb import crc_key

from loader_helpers import encode_jpeg, grey_level, scribble_image, shard_name, write_dataset

FORMATS = ("lmdb", "hdf5")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_field_of_every_sample_has_its_crc_in_the_shard(tmp_path, fmt):
    # What a user of plain lmdb / h5py finds, computed here independently of the writer.
    path = write_dataset(tmp_path / "ds", 6, fmt=fmt, samples_per_shard=6)
    shard = path / shard_name(fmt, 0)
    manifest = load_manifest(path)
    assert manifest.checksums == ("sha256", "crc32c")
    assert sorted(manifest.fields) == ["image", "key", "label"]  # the CRCs' order: by name
    if fmt == "lmdb":
        with lmdb.open(str(shard), subdir=False, readonly=True, lock=False) as env, env.begin() as txn:
            table = np.stack([np.frombuffer(txn.get(crc_key(i)), dtype="<u4") for i in range(6)])
    else:
        with h5py.File(shard, "r") as f:
            table = f[CRC_DATASET][()]
    for i in range(6):
        label = np.array(i % 5, dtype="<i8").tobytes()
        fields = (encode_jpeg(grey_level(i)), f"sample-{i}".encode(), label)  # image, key, label
        expected = [google_crc32c.value(value) for value in fields]
        assert table[i].tolist() == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_record_damaged_in_place_is_refused_naming_shard_record_and_sample(tmp_path, fmt):
    path = write_dataset(tmp_path / "ds", 12, fmt=fmt, samples_per_shard=5)
    scribble_image(path, fmt, shard=1, sample=7)
    store = open_store(path)
    with pytest.raises(StoreError) as raised:
        store[7]
    message = str(raised.value)
    assert f"sample 7 (shard {shard_name(fmt, 1)}, record 2): " in message
    assert "field 'image' fails its record CRC32C check" in message and "dali-pipes verify" in message
    assert isinstance(raised.value.__cause__, RecordChecksumError)
    # The other records, and the damaged record's other fields, still read: only what is read is checked.
    assert store[6]["image"] == encode_jpeg(grey_level(6))
    assert store.read(7, ["label", "key"])["key"] == b"sample-7"


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_names_each_damaged_record(tmp_path, fmt):
    path = write_dataset(tmp_path / "ds", 12, fmt=fmt, samples_per_shard=5)
    for sample in (5, 8):
        scribble_image(path, fmt, shard=1, sample=sample)
    report = verify_dataset(path, progress=False)
    name = shard_name(fmt, 1)
    assert report.problems[0] == f"shard {name}: SHA-256 does not match the manifest (the file was altered or damaged)"
    assert [p.split(": ", 2)[1] for p in report.problems[1:]] == ["sample 5", "sample 8"]
    for problem, record in zip(report.problems[1:], (0, 3)):
        assert f"{name}: record {record}: field 'image' fails its record CRC32C check" in problem
    assert report.samples_read == 10  # every record of the good shards and the 3 good ones of shard 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dataset_without_record_crcs_still_loads_saying_so_once(tmp_path, fmt, caplog):
    # A manifest written before the checksums entry existed: its shards are read unchecked.
    path = write_dataset(tmp_path / "ds", 12, fmt=fmt, samples_per_shard=5)
    index = path / "index.json"
    data = json.loads(index.read_text())
    del data["checksums"]
    index.write_text(json.dumps(data))
    scribble_image(path, fmt, shard=1, sample=7)
    with caplog.at_level(logging.WARNING, logger="dali_pipes"):
        store = open_store(path)
        samples = [store[i] for i in range(12)]
        open_store(path).close()  # a second store of it (a loader, verify, the bench) says nothing more
    assert load_manifest(path).checksums == ("sha256",)
    warnings = [r.getMessage() for r in caplog.records if "CRC32C per record" in r.getMessage()]
    assert len(warnings) == 1 and "convert it again" in warnings[0] and str(path) in warnings[0]
    assert samples[7]["image"] != encode_jpeg(grey_level(7))  # unchecked: what the checksums now prevent
    assert samples[6]["image"] == encode_jpeg(grey_level(6))


def test_the_manifest_says_which_checksums_a_dataset_has(tmp_path):
    path = write_dataset(tmp_path / "ds", 3, fmt="lmdb")
    data = json.loads((path / "index.json").read_text())
    assert data["checksums"] == ["sha256", "crc32c"]
    del data["checksums"]
    assert parse_manifest(data).checksums == ("sha256",)
    assert parse_manifest({**data, "format": "tfrecord"}).checksums == ("sha256", "crc32c")  # the format's own
    with pytest.raises(ManifestError, match="unknown checksum 'md5'"):
        parse_manifest({**data, "checksums": ["sha256", "md5"]})


@pytest.mark.parametrize("virtual", [False, True])
def test_a_merged_file_keeps_the_record_crcs(tmp_path, virtual):
    path = write_dataset(tmp_path / "ds", 12, fmt="hdf5", samples_per_shard=5)
    merged = merge_hdf5(path, tmp_path / "merged.h5", virtual=virtual)
    assert open_store(merged)[7]["image"] == encode_jpeg(grey_level(7))
    if virtual:
        scribble_image(path, "hdf5", shard=1, sample=7)  # the virtual file reads the shard's bytes
    else:
        raw = bytearray(merged.read_bytes())
        jpeg = encode_jpeg(grey_level(7))
        at = raw.find(jpeg)
        raw[at + len(jpeg) // 2] ^= 0xFF
        merged.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=r"sample 7 \(shard merged\.h5, record 7\): .*fails its record CRC32C"):
        open_store(merged)[7]


@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_reads_check_each_record_too(tmp_path, fmt):
    # The loader reads batches (Store.read_batch): a damaged image and a damaged fixed-shape
    # label are refused there as well, by the shard's batch read and with the sample named.
    path = write_dataset(tmp_path / "ds", 12, fmt=fmt, samples_per_shard=5)
    scribble_image(path, fmt, shard=1, sample=7)
    shard = path / shard_name(fmt, 1)
    other = np.array(4, dtype="<i8")  # sample 8's label is 3: same size, other bytes
    if fmt == "lmdb":
        from dali_pipes.stores.lmdb import sample_key

        # In place, the size unchanged: an LMDB leaf node holds the key, then the value.
        stored = sample_key(3, "label") + np.array(3, dtype="<i8").tobytes()
        data = shard.read_bytes()
        assert data.count(stored) == 1
        shard.write_bytes(data.replace(stored, sample_key(3, "label") + other.tobytes()))
    else:
        with h5py.File(shard, "r+") as f:
            f["label"][3] = other
    store = open_store(path)
    reader = store._shards[1]
    with pytest.raises(RecordChecksumError, match="record 2: field 'image' fails its record CRC32C check"):
        reader.read_batch(np.array([4, 2, 0]), ["image"])
    with pytest.raises(RecordChecksumError, match="record 3: field 'label' fails its record CRC32C check"):
        reader.read_batch(np.array([4, 3, 0]), ["label"])
    with pytest.raises(StoreError, match=r"sample 8 \(shard"):
        store.read_batch([0, 8, 9], ["label"])
    batch = store.read_batch([9, 5, 0], ["image", "label"])  # undamaged records still read
    assert batch["image"][1] == encode_jpeg(grey_level(5)) and batch["label"].ravel().tolist() == [4, 0, 0]


@pytest.mark.parametrize("width", [0, 1, 3, 4, 7, 8, 64, 65, 255, 256])
def test_rows_checked_together_get_the_crc32c_of_each_row(width):
    # Feature rows are checked together (numpy across rows); the values must be google_crc32c's, row by row.
    from dali_pipes.stores.checksum import crc32c_rows

    rows = np.random.default_rng(width).integers(0, 256, (40, width), dtype=np.uint8)
    assert crc32c_rows(rows).tolist() == [google_crc32c.value(row.tobytes()) for row in rows]


@pytest.mark.parametrize("rows, width", [(1, 24), (31, 64), (32, 24), (33, 100), (1024, 64), (16_385, 4)])
def test_the_combined_crc_of_rows_is_the_crc_of_their_concatenation(rows, width):
    # A batch of feature rows is checked by one hardware CRC over its bytes against a value made from the rows'
    # own CRCs (crc_combine.py), across the inner groups, the outer groups and the blocks of BLOCK_ROWS.
    from dali_pipes.stores.crc_combine import combined_crc

    data = np.random.default_rng(rows).integers(0, 256, (rows, width), dtype=np.uint8)
    crcs = np.array([google_crc32c.value(row.tobytes()) for row in data], dtype=np.uint32)
    assert combined_crc(crcs, width) == google_crc32c.value(data.tobytes())
    crcs[rows // 2] ^= 1  # one stored CRC off by one bit: the combined value must differ
    assert combined_crc(crcs, width) != google_crc32c.value(data.tobytes())


def test_a_damaged_row_among_many_checked_at_once_is_named(tmp_path, write_dataset):
    # 300 rows of 32 float32 (128 bytes) are checked by the combined CRC; two rows damaged alike
    # (the same bytes flipped) do not cancel out, and the first damaged row read is the one named.
    from dali_pipes.dataset.manifest import Field

    fields = {"emb": Field.array("float32", (32,))}
    samples = [{"emb": np.full(32, i, dtype=np.float32)} for i in range(300)]
    path = write_dataset(tmp_path / "ds", "hdf5", fields, samples, per_shard=300)
    store = open_store(path)
    order = np.random.default_rng(0).permutation(300)
    assert store.read_batch(order, ["emb"])["emb"][:, 0].tolist() == order.tolist()
    store.close()
    (shard,) = path.glob("shard-00000.*")
    with h5py.File(shard, "r+") as f:
        for row in (40, 41):  # the same bit of the same byte flipped in both
            damaged = f["emb"][row].view(np.uint8).copy()
            damaged[5] ^= 0x10
            f["emb"][row] = damaged.view(np.float32)
    store = open_store(path)
    with pytest.raises(RecordChecksumError, match="record 41: field 'emb' fails"):
        store.shard_readers[0].read_batch(np.array([5, 41, 40, *range(100, 200)]), ["emb"])
