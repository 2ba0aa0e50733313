"""The DALI external-source callable (dali_pipes.loading.sources) on its own: SampleInfo in, arrays out."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from dali_pipes import StoreError, open_store
from dali_pipes.dataset.manifest import Field
from dali_pipes.loading.sources import EpochControl, StoreSource, dali_output_types
from dali_pipes.sampling import EpochRules, World, rank_indices
from dali_pipes.stores import tfexample

from loader_helpers import encode_jpeg, grey_level, write_dataset

N = 11


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return open_store(write_dataset(tmp_path_factory.mktemp("sources") / "ds", N, samples_per_shard=4))


def info(i, dali_epoch=0):
    return SimpleNamespace(idx_in_epoch=i, epoch_idx=dali_epoch, iteration=0, idx_in_batch=0)


def make(store, control, fields=("image", "label"), **kwargs):
    """A source of ``fields``: batches of 4 for rank 1 of 2, shuffled with seed 3, padded, unless ``kwargs`` say."""
    rules = dict(batch_size=4, world=World(1, 2), seed=3, shuffle=True, last_batch="pad")
    rules.update((name, kwargs.pop(name)) for name in list(kwargs) if name in rules)
    return StoreSource(store, fields, EpochRules(**rules), control=control, **kwargs)


def in_order(store, control, fields, batch_size, **kwargs):
    """A source of ``fields`` for a single rank, in dataset order."""
    return make(store, control, fields, batch_size=batch_size, world=World(), seed=0, shuffle=False, **kwargs)


def read_epoch(source, dali_epoch):
    out = []
    i = 0
    while True:
        try:
            out.append(source(info(i, dali_epoch)))
        except StopIteration:
            return out
        i += 1


def test_samples_follow_the_published_epoch_padded_to_whole_batches(store):
    control = EpochControl()
    source = make(store, control)
    control.publish(0, epoch=5, start=2)
    samples = read_epoch(source, 0)
    expected, expected_pad = rank_indices(N, 4, 1, 2, 5, 3, start=2)
    assert len(expected) == 5 and len(samples) == 8  # 5 samples, padded to 2 batches of 4
    image, label, is_pad, index = samples[0]
    assert image.dtype == np.uint8 and image.ndim == 1 and bytes(image) == store[int(index)]["image"]
    assert label.shape == () and label.dtype == np.int64 and int(label) == int(index) % 5
    assert is_pad.shape == () and is_pad.dtype == bool and index.shape == () and index.dtype == np.int64
    assert [int(s[3]) for s in samples[:5]] == expected.tolist()
    assert [bool(s[2]) for s in samples[:5]] == expected_pad.tolist()
    assert all(bool(s[2]) for s in samples[5:])  # the batch filler is padding too
    # Still past the end when asked again (DALI prefetches beyond the end).
    with pytest.raises(StopIteration):
        source(info(9))

    control.publish(1, epoch=6, start=0)
    assert [int(s[3]) for s in read_epoch(source, 1)][:6] == rank_indices(N, 4, 1, 2, 6, 3)[0].tolist()


def test_stale_and_cancelled_epochs_stop(store):
    control = EpochControl()
    source = make(store, control)
    control.publish(3, epoch=0, start=0)
    with pytest.raises(StopIteration):
        source(info(0, dali_epoch=2))  # a task of an epoch already left
    source(info(0, dali_epoch=3))
    control.cancel()
    with pytest.raises(StopIteration):
        source(info(1, dali_epoch=3))


def test_without_index_and_output_types(store):
    control = EpochControl()
    control.publish(0, 0, 0)
    source = in_order(store, control, ("label",), 2, with_index=False)
    assert len(source(info(0))) == 2
    from nvidia.dali import types

    assert dali_output_types(store, ("image", "label")) == (
        [types.UINT8, types.INT64, types.BOOL, types.INT64],
        [1, 0, 0, 0],
    )
    assert dali_output_types(store, ("label",), with_index=False) == ([types.INT64, types.BOOL], [0, 0])


def test_missing_field_is_named(store):
    with pytest.raises(ValueError, match="no field 'boxes'"):
        in_order(store, EpochControl(), ("boxes",), 2)


def _read_in_child(source, queue):
    queue.put([int(s[3]) for s in read_epoch(source, 0)])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_pickled_source_sees_what_the_parent_publishes(store, method):
    control = EpochControl()
    source = make(store, control, world=World(0, 1), shuffle=False)
    clone = pickle.loads(pickle.dumps(source))
    assert clone._dali_epoch == -1 and clone._values is None
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    control.publish(0, epoch=0, start=7)  # published after the pickling, as the loader does
    child = ctx.Process(target=_read_in_child, args=(source, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(60)
    assert got[:4] == [7, 8, 9, 10]


def test_the_control_file_belongs_to_its_creator():
    control = EpochControl()
    clone = pickle.loads(pickle.dumps(control))
    clone.close()  # an attached copy never deletes it
    control.publish(0, 1, 2)
    assert clone.values.tolist() == [0, 1, 2, 0, 0, 0, 0]  # (dali_epoch, epoch, start, cancelled, size, first, chained)
    control.close()
    assert not os.path.exists(control.path)


def _drop_in_child(control, queue):
    control.close()  # the owner's finalizer, inherited through fork
    queue.put(os.path.exists(control.path))


def test_a_forked_child_never_deletes_the_owners_file():
    control = EpochControl()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_drop_in_child, args=(control, queue))
    child.start()
    assert queue.get(timeout=60) is True
    child.join(60)
    assert os.path.exists(control.path)
    control.close()


# --- the source reads only the fields it returns ---------------------------------------------------

#: ``ids``, a large int64 array, is in the dataset but not in the spec (what the source returns).
WIDE_FIELDS = {"image": Field.image(), "label": Field.array("int64", ()), "ids": Field.array("int64", (512,))}
DAMAGED = 6  # global sample whose stored ``ids`` is damaged: shard 1, record 2 (4 samples a shard)


def wide_samples(n: int) -> list[dict]:
    rng = np.random.default_rng(7)
    return [
        {
            "image": encode_jpeg(grey_level(i)),
            "label": np.array(i % 5, np.int64),
            "ids": rng.integers(2**40, 2**50, 512),  # varints of 6 to 8 bytes in a TFRecord
        }
        for i in range(n)
    ]


def damage_unused_field(root: Path, fmt: str, sample: dict) -> None:
    """Damage, on disk and in place, only the stored ``ids`` (the field the spec leaves out).

    LMDB: the key of sample ``DAMAGED``'s ``ids`` is renamed (``.../ids`` -> ``.../idt``,
    which sorts in the same place), so that record is missing. HDF5: a byte of the
    ``ids`` dataset's object header is flipped, so its checksum fails and the field
    cannot be opened, in any sample. TFRecord: the last varint of sample
    ``DAMAGED``'s ``ids`` list is cut open, and the record's CRC rewritten to match,
    so only decoding ``ids`` can notice. The file sizes do not change.
    """
    if fmt == "lmdb":
        path = root / "shard-00001.lmdb"
        raw = path.read_bytes()
        key = b"0000000002/ids"
        assert raw.count(key) >= 1
        path.write_bytes(raw.replace(key, b"0000000002/idt"))
    elif fmt == "hdf5":
        path = root / "shard-00001.h5"
        with h5py.File(path, "r") as f:
            header = h5py.h5o.get_info(f["ids"].id).addr
        raw = bytearray(path.read_bytes())
        assert raw[header : header + 4] == b"OHDR"  # a version-2 object header, which has a checksum
        raw[header + 20] ^= 0x40
        path.write_bytes(bytes(raw))
    else:
        path = root / "shard-00001.tfrecord"
        offset, size = map(int, (root / "shard-00001.tfrecord.idx").read_text().splitlines()[2].split())
        raw = bytearray(path.read_bytes())
        data_at, data_end = offset + tfexample.HEADER_SIZE, offset + size - tfexample.FOOTER_SIZE
        packed = tfexample.encode_varints(sample["ids"])
        at = raw.find(packed, data_at, data_end)
        assert at > 0
        raw[at + len(packed) - 1] |= 0x80  # the last value now runs past the list's end
        raw[data_end : data_end + 4] = struct.pack("<I", tfexample.masked_crc32c(bytes(raw[data_at:data_end])))
        path.write_bytes(bytes(raw))


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "tfrecord"])
def test_the_source_never_reads_the_fields_it_does_not_return(fmt, tmp_path, write_dataset):
    """A field outside the spec may be damaged: the source, which never reads it, delivers every sample.

    A full read of the same sample fails, so the damage is real and would reach
    the loader if the source read every field.
    """
    n = 11
    samples = wide_samples(n)
    root = write_dataset(tmp_path / "ds", fmt, WIDE_FIELDS, samples, per_shard=4)
    damage_unused_field(root, fmt, samples[DAMAGED])
    store = open_store(root)
    with pytest.raises(StoreError, match=rf"sample {DAMAGED} .*shard-00001.*'ids'"):
        store[DAMAGED]
    with pytest.raises(StoreError, match="'ids'"):
        store.read(DAMAGED, ["ids"])

    control = EpochControl()
    control.publish(0, epoch=0, start=0)
    source = in_order(store, control, ("image", "label"), 4)
    out = read_epoch(source, 0)
    assert len(out) == 12  # 11 samples padded to 3 batches of 4
    assert [int(index) for *_, index in out[:n]] == list(range(n))
    for image, label, is_pad, index in out[:n]:
        assert bytes(image) == samples[int(index)]["image"] and int(label) == int(index) % 5 and not is_pad
    control.close()
