"""The feature-array spec through ``DALILoader`` on DALI's CPU backend, for every shard format.

Arrays are written to ``.npy`` files, converted with ``ArraysSource`` (several
shards per format), and read back by simulated ranks (explicit ``rank`` and
``world_size`` in one process). References are the numpy arrays themselves.
"""

from __future__ import annotations

import logging
import math
import pickle
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from nvidia.dali import Pipeline, fn

from converters.runner import convert
from converters.sources.arrays import ArraysSource
from dali_pipes import BatchFormat, DALILoader, RunOptions, load_manifest, open_store
from dali_pipes.dataset.manifest import Field
from dali_pipes.pipelines import Features, PipelineSpec

N = 23  # not a multiple of the batch size (4) times the world size (2)
BATCH = 4
FIELDS = ("mix", "target", "emb")
FORMATS = ("lmdb", "hdf5", "tfrecord")
INDEXED = BatchFormat(with_index=True)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """``mix`` float32 (4, 640), ``target`` float32 (640,), ``emb`` float16 (8,), ``label`` int64 ()."""
    root = tmp_path_factory.mktemp("arrays")
    rng = np.random.default_rng(0)
    data = {
        "mix": rng.standard_normal((N, 4, 640), dtype=np.float32),
        "target": rng.standard_normal((N, 640), dtype=np.float32),
        "emb": (rng.standard_normal((N, 8)) * 3).astype(np.float16),
        "label": np.arange(N, dtype=np.int64) * 7,
    }
    for name, value in data.items():
        np.save(root / f"{name}.npy", value)
    return root, data


def converted(arrays: tuple[Path, dict[str, np.ndarray]], fmt: str) -> Path:
    """The arrays converted to ``fmt`` shards of 7 samples, once per module, whichever test asks first."""
    root, data = arrays
    out = root / fmt
    if not (out / "index.json").exists():
        files = [root / f"{name}.npy" for name in data]
        convert(ArraysSource(files), out, format=fmt, workers=1, progress=False, samples_per_shard=7)
    return out


@pytest.fixture(scope="module", params=FORMATS)
def dataset(request, arrays) -> tuple[str, Path, dict[str, np.ndarray]]:
    return request.param, converted(arrays, request.param), arrays[1]


def cpu(**fields) -> RunOptions:
    """The CPU, reading in the loader's process unless ``fields`` say otherwise."""
    return RunOptions(**{"device": "cpu", "py_num_workers": 0, **fields})


def loader(path: Path, spec: Features, run: RunOptions | None = None, **kwargs) -> DALILoader:
    """A loader of ``spec`` bound to the dataset, batches of ``BATCH`` with ``index``, on ``run`` (default :func:`cpu`)."""
    kwargs.setdefault("batch_size", BATCH)
    return DALILoader(path, spec.bind(load_manifest(path)), run=run or cpu(), batch_format=INDEXED, **kwargs)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fields=()), "empty"),
        (dict(fields=("a", "a")), "twice"),
        (dict(fields=("a", 3)), "fields"),
        (dict(fields=("a", "is_pad")), "is_pad"),
        (dict(fields=("a",), normalize={"b": (0.0, 1.0)}), "normalize"),
        (dict(fields=("a",), normalize={"a": (0.0, 0.0)}), "std"),
        (dict(fields=("a",), normalize={"a": (0.0, [1.0, -1.0])}), "std"),
        (dict(fields=("a",), normalize={"a": 0.5}), "normalize"),
        (dict(fields=("a",), normalize={"a": (float("nan"), 1.0)}), "finite"),
        (dict(fields=("a",), dtype={"a": "float8"}), "dtype"),
        (dict(fields=("a",), dtype={"b": "float16"}), "dtype"),
    ],
)
def test_bad_arguments_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Features(**kwargs)


def test_spec_is_hashable_picklable_and_keeps_mappings_as_pairs():
    spec = Features(fields=["mix", "emb"], normalize={"emb": (np.zeros(8), np.ones(8))}, dtype={"mix": "float16"})
    assert spec.fields == ("mix", "emb") and spec.required_fields == ("mix", "emb")
    assert spec.normalize == (("emb", ((0.0,) * 8, (1.0,) * 8)),) and spec.dtype == (("mix", "float16"),)
    assert pickle.loads(pickle.dumps(spec)) == spec and hash(spec) == hash(pickle.loads(pickle.dumps(spec)))
    assert isinstance(spec, PipelineSpec) and spec.needs_conditionals is False


def test_bind_refuses_fields_that_cannot_batch(write_dataset, tmp_path):
    fields = {"image": Field.image(), "boxes": Field.array("float32", (-1, 4)), "x": Field.array("float32", (3,))}
    sample = {"image": b"\xff\xd8 not decoded here", "boxes": np.ones((2, 4), np.float32), "x": np.ones(3, np.float32)}
    manifest = load_manifest(write_dataset(tmp_path / "ds", "lmdb", fields, [sample] * 2))
    assert Features(fields=("x",)).bind(manifest) == Features(fields=("x",))
    for name, message in (("image", "bytes"), ("boxes", "variable shape"), ("missing", "no field")):
        with pytest.raises(ValueError, match=message):
            Features(fields=(name,)).bind(manifest)


def test_a_plain_field_adds_no_operator():
    """Without normalisation or cast a field is the external-source node itself: DALI adds no copy."""
    with Pipeline(batch_size=1, num_threads=1, device_id=None):
        node = fn.external_source(source=lambda: [np.zeros(3, np.float32)], batch=True)
        out = Features(fields=("x",)).build({"x": node}, device="cpu")
    assert out["x"] is node


# ---------------------------------------------------------------- every sample, every rank, every format


def test_every_sample_comes_back_equal_on_every_rank(dataset):
    fmt, path, data = dataset
    spec = Features(fields=FIELDS + ("label",))
    # One format reads through a forked DALI worker (the training path), the others in-process.
    workers = 1 if fmt == "lmdb" else 0
    per_rank = math.ceil(N / (BATCH * 2))
    seen: Counter = Counter()
    for rank in range(2):
        with loader(path, spec, cpu(rank=rank, world_size=2, py_num_workers=workers), shuffle=True, seed=5) as it:
            assert len(it) == per_rank
            batches = list(it)
        assert len(batches) == per_rank
        for batch in batches:
            index = batch["index"].numpy()
            for name in FIELDS + ("label",):
                got = batch[name].numpy()
                assert got.dtype == data[name].dtype and got.shape == (len(index),) + data[name].shape[1:]
                np.testing.assert_array_equal(got, data[name][index], err_msg=f"{fmt}: {name}")
            seen.update(index[~batch["is_pad"].numpy()].tolist())
    assert seen == Counter(range(N)), f"{fmt}: not every sample exactly once"


def test_normalize_and_cast(dataset):
    fmt, path, data = dataset
    mean8, std8 = np.linspace(-1, 1, 8), np.linspace(0.5, 2, 8)
    spec = Features(
        fields=FIELDS,
        normalize={"mix": (0.5, 2.0), "emb": (mean8, std8)},
        dtype={"mix": "float16", "target": "float64"},
    )
    with loader(path, spec, shuffle=False) as it:
        batches = list(it)
    for batch in batches:
        index = batch["index"].numpy()
        mix, target, emb = (batch[name].numpy() for name in FIELDS)
        assert (mix.dtype, target.dtype, emb.dtype) == (np.float16, np.float64, np.float32)
        np.testing.assert_allclose(mix, (data["mix"][index] - 0.5) / 2.0, rtol=1e-3, atol=1e-3)
        np.testing.assert_array_equal(target, data["target"][index].astype(np.float64))
        np.testing.assert_allclose(emb, (data["emb"][index].astype(np.float64) - mean8) / std8, rtol=1e-5, atol=1e-5)


def test_resume_gives_the_rest_of_the_epoch(arrays):
    path = converted(arrays, "lmdb")  # converted here too: under pytest-xdist no other test may have run first
    spec = Features(fields=("label",))
    two = cpu(rank=1, world_size=2)
    with loader(path, spec, two, seed=2) as full:
        whole = [b["index"].tolist() for b in full]
    with loader(path, spec, two, seed=2) as first:
        it = iter(first)
        head = [next(it)["index"].tolist()]
        state = first.state_dict()
    with loader(path, spec, two, seed=2) as second:
        second.load_state_dict(state)
        assert len(second) == len(whole) - 1
        rest = [b["index"].tolist() for b in second]
    assert head + rest == whole


def test_features_read_in_the_training_process_unless_told_otherwise(arrays):
    """Small rows cost less to read in the loader's process than to move from a worker: no workers by default."""
    from dali_pipes.loading.options import resolve_counts

    spec = Features(fields=("emb", "label"))
    assert resolve_counts(spec, RunOptions())[1].py_num_workers == 0
    assert resolve_counts(spec, RunOptions(py_num_workers=2))[1].py_num_workers == 2  # an explicit count wins
    tuned = arrays[0] / "tuned.json"
    tuned.write_text('{"kind": "dali-pipes-settings", "version": 1, "loader": {"py_num_workers": 3}}')
    assert resolve_counts(spec, RunOptions(settings=tuned))[1].py_num_workers == 3  # and so does a tuned settings file
    assert resolve_counts(PipelineSpecLike(), RunOptions())[1].py_num_workers is None  # other specs: as the format says
    _, data = arrays
    path = converted(arrays, "hdf5")
    run = RunOptions(device="cpu")
    with DALILoader(path, spec, batch_size=BATCH, shuffle=False, run=run, batch_format=INDEXED) as it:
        assert it.worker_pids == []
        batches = list(it)
    with DALILoader(path, spec, batch_size=BATCH, shuffle=False, run=RunOptions(device="cpu", py_num_workers=1)) as it:
        assert len(it.worker_pids) == 1
        by_worker = list(it)
    for batch, other in zip(batches, by_worker, strict=True):
        np.testing.assert_array_equal(batch["emb"].numpy(), data["emb"][batch["index"].numpy()])
        np.testing.assert_array_equal(batch["emb"].numpy(), other["emb"].numpy())


class PipelineSpecLike:
    """A spec without ``py_num_workers_by_default`` (as the image specs are)."""

    required_fields = ("emb",)


# ---------------------------------------------------------------- host copies


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_reading_a_sample_copies_its_arrays_once(arrays, fmt):
    """The store hands over each array with one host copy (the one per-sample Python copy allowed)."""
    _, data = arrays
    store = open_store(converted(arrays, fmt))
    sample_bytes = sum(data[name][0].nbytes for name in data)
    store[0]  # open the shard outside the measurement
    tracemalloc.start()
    try:
        peaks = []
        for i in range(4):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            sample = store[i]
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
            del sample
    finally:
        tracemalloc.stop()
        store.close()
    # One copy plus small Python objects (the dict, keys, array headers).
    # The fewest of four reads: tracemalloc counts every thread, and under pytest-xdist a thread another test of this
    # worker left running may allocate during one of them; a second copy would show in every read.
    assert min(peaks) <= sample_bytes + 4096, (peaks, sample_bytes)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_batches_are_on_the_gpu_and_equal(arrays):
    import torch

    data = arrays[1]
    path = converted(arrays, "lmdb")  # not left to the dataset fixture: `pytest -m gpu` runs this test alone
    mean8, std8 = np.linspace(-1, 1, 8), np.linspace(0.5, 2, 8)
    spec = Features(fields=FIELDS, normalize={"emb": (mean8, std8)}, dtype={"mix": "float16"})
    with DALILoader(
        path,
        spec.bind(load_manifest(path)),
        batch_size=BATCH,
        shuffle=False,
        run=RunOptions(device="gpu", py_num_workers=1),
        batch_format=INDEXED,
    ) as it:
        batches = list(it)
    assert len(batches) == math.ceil(N / BATCH)
    for batch in batches:
        assert all(v.is_cuda for v in batch.values())
        index = batch["index"].cpu().numpy()
        assert batch["mix"].dtype == torch.float16
        np.testing.assert_array_equal(batch["mix"].cpu().numpy(), data["mix"][index].astype(np.float16))
        np.testing.assert_array_equal(batch["target"].cpu().numpy(), data["target"][index])
        np.testing.assert_allclose(
            batch["emb"].cpu().numpy(), (data["emb"][index].astype(np.float64) - mean8) / std8, rtol=1e-5, atol=1e-5
        )


@pytest.mark.gpu
def test_plain_rows_on_the_gpu_skip_dali_and_arrive_on_the_gpu_equal(arrays):
    """The direct path (no DALI graph) on the GPU: every batch on this GPU, equal to the arrays, every sample once."""
    data = arrays[1]
    path = converted(arrays, "lmdb")
    gpu = RunOptions(device="gpu")
    with DALILoader(path, Features(fields=FIELDS), batch_size=BATCH, shuffle=True, run=gpu, batch_format=INDEXED) as it:
        assert it.py_num_workers == 0  # plain rows are read in the loader's process, not through DALI
        batches = list(it)
    seen = []
    for batch in batches:
        assert all(v.is_cuda for v in batch.values())
        keep = ~batch["is_pad"].cpu().numpy().astype(bool)
        index = batch["index"].cpu().numpy()[keep]
        seen.extend(index.tolist())
        for name in FIELDS:
            np.testing.assert_array_equal(batch[name].cpu().numpy()[keep], data[name][index])
    assert sorted(seen) == list(range(N))


def test_plain_rows_skip_dali_and_give_exactly_what_the_dali_pipeline_gives(dataset, caplog):
    """No normalise, no cast: no DALI pipeline at all (issue 38), the same batches as through DALI, every guarantee kept.

    Two ranks, shuffled, the last batch padded, epoch 1 resumed part-way: batch for batch equal to the DALI
    pipeline the loader builds when asked for a reader process.
    """
    fmt, path, _ = dataset
    spec = Features(fields=tuple(load_manifest(path).fields))
    assert (
        spec.runs_without_dali and not Features(fields=spec.fields, dtype={spec.fields[0]: "float16"}).runs_without_dali
    )

    def epochs(workers, rank):
        seen = []
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dali_pipes.loading.loader"):
            it = loader(path, spec, cpu(py_num_workers=workers, rank=rank, world_size=2), seed=3, shuffle=True)
        without_dali = any("without a DALI graph" in r.getMessage() for r in caplog.records)
        assert without_dali == (workers == 0)
        with it:
            for epoch in (0, 1):
                if epoch == 1:
                    it.load_state_dict({**it.state_dict(), "epoch": 1, "samples_consumed": 8})
                else:
                    it.set_epoch(epoch)
                seen.extend({name: value.numpy().copy() for name, value in batch.items()} for batch in it)
        return seen

    for rank in (0, 1):
        direct, through_dali = epochs(0, rank), epochs(1, rank)
        assert len(direct) == len(through_dali) > 0
        for a, b in zip(direct, through_dali):
            assert a.keys() == b.keys()
            for name in a:
                assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
                assert np.array_equal(a[name], b[name]), name
