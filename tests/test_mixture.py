"""Mixtures of datasets (issue 40): the pure draw, the joined store, and real loaders and DDP jobs over it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dali_pipes.sampling import MixtureSampling, exact_counts, mixture_order, num_batches

# --- the draw: pure functions -----------------------------------------------------------------------


def test_each_dataset_walks_all_its_samples_before_any_repeats_across_epochs():
    sizes, proportions = [10, 100], [0.7, 0.3]  # 70 of A (7 rounds) and 30 of B per epoch of 100
    seen_b = np.zeros(100, dtype=int)
    for epoch in range(10):
        order = mixture_order(sizes, proportions, 100, epoch=epoch, seed=5)
        from_a, from_b = order[order < 10], order[order >= 10] - 10
        assert len(from_a) == 70 and np.all(np.bincount(from_a, minlength=10) == 7)
        assert len(from_b) == 30
        seen_b += np.bincount(from_b, minlength=100)
        # No sample of B comes a second time before every sample of B came once (epoch 3 ends round 0).
        assert seen_b.max() - seen_b.min() <= 1, epoch
    assert np.all(seen_b == 3)  # 300 draws: 3 whole rounds


def test_the_draw_is_a_function_of_seed_and_epoch_and_interleaves_the_datasets():
    order = mixture_order([50, 50], [1, 1], 100, epoch=2, seed=1)
    assert np.array_equal(order, mixture_order([50, 50], [1, 1], 100, epoch=2, seed=1))
    assert not np.array_equal(order, mixture_order([50, 50], [1, 1], 100, epoch=3, seed=1))
    assert not np.array_equal(order, mixture_order([50, 50], [1, 1], 100, epoch=2, seed=2))
    first_half_from_a = int((order[:50] < 50).sum())
    assert 10 < first_half_from_a < 40  # interleaved, not one dataset after the other


@pytest.mark.parametrize("total", [1, 7, 10, 99, 1000])
def test_exact_counts_add_up_and_follow_the_proportions(total):
    counts = exact_counts([0.5, 0.3, 0.2], total)
    assert counts.sum() == total
    assert np.all(np.abs(counts - np.array([0.5, 0.3, 0.2]) * total) < 1)


def test_proportions_by_size_read_every_sample_once_per_epoch():
    sampling = MixtureSampling(("a", "b", "c"), (3, 8, 5), (3.0, 8.0, 5.0))
    for epoch in range(4):
        assert sorted(sampling.order(16, epoch, seed=0).tolist()) == list(range(16))
    with pytest.raises(ValueError, match="the mixture has 16 samples, but the store given has 15"):
        sampling.order(15, 0, 0)


def test_the_frequencies_match_the_proportions_over_many_epochs():
    drawn = np.concatenate([mixture_order([30, 40, 30], [0.6, 0.3, 0.1], 97, epoch=e, seed=4) for e in range(50)])
    shares = np.bincount(np.searchsorted([30, 70], drawn, side="right"), minlength=3) / len(drawn)
    assert np.allclose(shares, [0.6, 0.3, 0.1], atol=0.01)  # exact per epoch, up to rounding of 97


# --- the joined store -------------------------------------------------------------------------------


def _classes(path, classes):
    """Give the dataset at ``path`` a class list in its manifest."""
    from dali_pipes.dataset.manifest import load_manifest, write_manifest

    write_manifest(path, dataclasses.replace(load_manifest(path), classes=tuple(classes)))
    return path


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Dataset ``a`` (LMDB, 11 samples, classes c0..c4) and ``b`` (HDF5, 30 samples, classes d0..d4)."""
    from loader_helpers import write_dataset

    root = tmp_path_factory.mktemp("mixture")
    a = _classes(write_dataset(root / "a", 11, samples_per_shard=4), [f"c{i}" for i in range(5)])
    b = _classes(write_dataset(root / "b", 30, fmt="hdf5", samples_per_shard=7), [f"d{i}" for i in range(5)])
    return a, b


def _open(mixture):
    from dali_pipes import DataOptions
    from dali_pipes.loading.store_setup import prepare_store
    from dali_pipes.sampling import EpochRules

    store, _, _ = prepare_store(mixture, DataOptions(), EpochRules(batch_size=4))
    return store


def test_the_mixed_store_reads_each_dataset_and_offsets_labels_when_asked(two):
    from dali_pipes import Mixture, open_store

    a, b = (open_store(p) for p in two)
    mixed = _open(Mixture({"a": two[0], "b": two[1]}, labels="offset"))
    assert len(mixed) == 41 and mixed.manifest.classes == (
        *(f"a/c{i}" for i in range(5)),
        *(f"b/d{i}" for i in range(5)),
    )
    assert mixed.read(3)["image"] == a.read(3)["image"] and int(mixed.read(3)["label"]) == int(a.read(3)["label"])
    assert mixed.read(11 + 8)["key"] == b.read(8)["key"] and int(mixed.read(19)["label"]) == int(b.read(8)["label"]) + 5
    indices = [40, 0, 12, 12, 5]
    batch = mixed.read_batch(indices, ["label", "key"], arrays=True)
    expected = [mixed.read(i) for i in indices]
    assert batch["label"].tolist() == [int(s["label"]) for s in expected]
    assert [bytes(v) for v in batch["key"]] == [s["key"] for s in expected]
    assert mixed.dataset_of(indices).tolist() == [1, 0, 1, 1, 0]
    kept = _open(Mixture({"a": two[0], "b": two[0]}))  # the same classes: labels kept by default
    assert kept.manifest.classes == tuple(f"c{i}" for i in range(5)) and int(kept.read(11 + 3)["label"]) == 3
    with pytest.raises(IndexError, match="out of range for a mixture of 41"):
        mixed.read_batch([41])


def test_different_classes_under_one_numbering_are_refused_unless_offset(two):
    from dali_pipes import Mixture

    with pytest.raises(ValueError, match=r"class 0 is 'c0' in a but 'd0' in b.*labels='offset'"):
        _open(Mixture({"a": two[0], "b": two[1]}))
    with pytest.raises(ValueError, match="labels='keep' would train on wrong labels"):
        _open(Mixture({"a": two[0], "b": two[1]}, labels="keep"))


def test_fields_are_reconciled_by_name(two, tmp_path):
    from dali_pipes import Mixture

    from loader_helpers import write_dataset

    features = write_dataset(tmp_path / "f", 6, fields="arrays")  # features + label, no image
    mixed = _open(Mixture({"a": two[0], "f": features}, labels="keep"))
    assert list(mixed.fields) == ["label"]  # image and key are not in f, features not in a
    with pytest.raises(ValueError, match="the dataset has no field 'image'"):
        mixed.read_batch([0], ["image"])
    from dali_pipes.dataset.manifest import Field, load_manifest, write_manifest

    manifest = load_manifest(features)
    wide = {**manifest.fields, "label": Field.array("int32", ())}
    write_manifest(features, dataclasses.replace(manifest, fields=wide))
    with pytest.raises(ValueError, match="field 'label' is .*int64.* in a .* but .*int32.* in f"):
        _open(Mixture({"a": two[0], "f": features}))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(proportions={"a": 1.0}), r"missing \['b'\]"),
        (dict(proportions={"a": 1.0, "b": -1.0}), r"proportions\[.b.\] must be a number >= 0"),
        (dict(proportions={"a": 0, "b": 0.0}), "all 0"),
        (dict(labels="merge"), "labels must be one of"),
        (dict(num_samples=0), "num_samples must be >= 1"),
    ],
)
def test_bad_mixtures_are_refused_naming_what(two, kwargs, message):
    from dali_pipes import Mixture

    with pytest.raises(ValueError, match=message):
        _open(Mixture({"a": two[0], "b": two[1]}, **kwargs))


# --- through the loader: real DALI pipelines, real processes -----------------------------------------


def _rows(mixture, world_size, **kwargs):
    from loader_helpers import job_rows

    return job_rows(mixture, world_size, **kwargs)


def test_the_loader_reads_the_mixture_exactly_and_resumes_it_on_another_world_size(two):
    from dali_pipes import Mixture

    mixture = Mixture({"a": two[0], "b": two[1]}, proportions={"a": 0.7, "b": 0.3}, num_samples=30, labels="offset")
    drawn = _open(mixture).sampling.order(41, 1, 9).tolist()
    for world_size in (1, 2, 3):
        rows, _ = _rows(mixture, world_size, epoch=1)
        assert [i for i, _ in rows] == drawn
        # a's labels are index % 5; b's (index - 11) % 5, moved past a's 5 classes.
        assert [label for _, label in rows] == [i % 5 if i < 11 else 5 + (i - 11) % 5 for i in drawn]
    _, state = _rows(mixture, 2, epoch=1)
    assert state["samples_consumed"] == 16 and state["sampling"]["mixture"] == ["a", "b"]
    resumed, _ = _rows(mixture, 3, state=state)
    assert [i for i, _ in resumed] == drawn[16:]
    other = Mixture({"a": two[0], "b": two[1]}, proportions={"a": 0.5, "b": 0.5}, num_samples=30, labels="offset")
    with pytest.raises(ValueError, match="sampling="):
        _rows(other, 1, state=state)


def test_a_mixture_refuses_weights_and_the_ram_cache(two):
    from dali_pipes import DALILoader, DataOptions, Mixture, RunOptions, WeightedSampling

    from loader_helpers import TinySpec

    mixture = Mixture({"a": two[0], "b": two[1]}, labels="offset")
    cpu = RunOptions(device="cpu")
    with pytest.raises(ValueError, match="a Mixture draws its own epochs"):
        DALILoader(mixture, TinySpec(), batch_size=4, sampling=WeightedSampling(np.ones(41)), run=cpu)
    with pytest.raises(ValueError, match="cache='ram' does not take a Mixture"):
        DALILoader(mixture, TinySpec(), batch_size=4, run=cpu, data=DataOptions(cache="ram"))


def test_a_ddp_job_reads_each_mixed_epoch_exactly(two, tmp_path):
    """Real processes (gloo): two ranks in lockstep read each epoch's mixture, no sample more or less."""
    from test_ddp import run_job

    from dali_pipes import Mixture

    options = dict(b=str(two[1]), proportions={"a": 0.25, "b": 0.75}, num_samples=26, labels="offset")
    reports = run_job(2, two[0], tmp_path, batch_size=4, epochs=2, mixture=options)
    sampling = _open(Mixture({"a": two[0], "b": two[1]}, **{k: v for k, v in options.items() if k != "b"})).sampling
    for epoch in range(2):
        per_rank = [report["epochs"][epoch] for report in reports]
        assert [len(b) for b in per_rank] == [num_batches(26, 4, 2)] * 2
        read = [i for step in zip(*per_rank) for indices, pads in step for i, p in zip(indices, pads) if not p]
        assert read == sampling.order(41, epoch, 0).tolist()
        assert sum(i < 11 for i in read) == 7  # 0.25 * 26 = 6.5: the tie goes to the first dataset


def test_offset_labels_outgrow_a_small_label_dtype_without_wrapping(tmp_path, write_dataset):
    # Two datasets of uint8 labels and 200 classes each: dataset b's label 70 is the mixture's 270, an int64.
    from dali_pipes import Mixture
    from dali_pipes.dataset.manifest import Field

    fields = {"label": Field.array("uint8", ())}
    paths = [
        write_dataset(tmp_path / name, "hdf5", fields, [{"label": np.uint8(i)} for i in range(0, 200, 10)],
                      classes=[f"{name}{c}" for c in range(200)])
        for name in ("a", "b")
    ]  # fmt: skip
    mixed = _open(Mixture({"a": paths[0], "b": paths[1]}, labels="offset"))
    assert mixed.fields["label"].dtype == "int64" and len(mixed.manifest.classes) == 400
    assert int(mixed.read(20 + 7)["label"]) == 270
    assert mixed.read_batch([0, 19, 20, 39], ["label"])["label"].tolist() == [0, 190, 200, 390]


def test_a_dataset_without_a_class_list_is_not_mixed_with_one_that_has_one_unless_told(two, tmp_path):
    from dali_pipes import Mixture

    from loader_helpers import write_dataset

    unlisted = write_dataset(tmp_path / "u", 6)  # labels 0..4, no class list
    with pytest.raises(ValueError, match=r"\['u'\] have no class list.*labels='keep'"):
        _open(Mixture({"a": two[0], "u": unlisted}))
    kept = _open(Mixture({"a": two[0], "u": unlisted}, labels="keep"))
    assert kept.manifest.classes == tuple(f"c{i}" for i in range(5))
    assert (
        len(
            _open(
                Mixture(
                    {"a": two[0], "b": two[1]}, proportions={"a": np.float32(0.7), "b": np.int64(1)}, labels="offset"
                )
            )
        )
        == 41
    )


def test_a_mixture_read_in_order_is_the_datasets_one_after_the_other(two):
    from dali_pipes import BatchFormat, DALILoader, Mixture, RunOptions

    from loader_helpers import TinySpec

    mixture = Mixture({"a": two[0], "b": two[1]}, labels="offset")
    cpu = RunOptions(device="cpu")
    with DALILoader(
        mixture, TinySpec(), batch_size=8, shuffle=False, batch_format=BatchFormat(with_index=True), run=cpu
    ) as loader:
        assert [i for batch in loader for i in batch["index"].tolist()] == list(range(41))
    drawn = Mixture({"a": two[0], "b": two[1]}, proportions={"a": 1, "b": 1}, labels="offset")
    with pytest.raises(ValueError, match="shuffle=False: a Mixture with proportions"):
        DALILoader(drawn, TinySpec(), batch_size=8, shuffle=False, run=cpu)


@pytest.mark.timeout(300)
def test_reader_processes_read_the_mixture_exactly(two):
    """Two spawned reader processes (the source and the mixed store pickled into each), rows exactly the draws."""
    from dali_pipes import BatchFormat, DALILoader, Mixture, RunOptions

    from loader_helpers import TinySpec

    mixture = Mixture({"a": two[0], "b": two[1]}, proportions={"a": 0.6, "b": 0.4}, num_samples=29, labels="offset")
    sampling = _open(mixture).sampling
    with DALILoader(
        mixture, TinySpec(), batch_size=4, seed=9, batch_format=BatchFormat(with_index=True),
        run=RunOptions(device="cpu", py_num_workers=2, py_start_method="spawn"),
    ) as loader:  # fmt: skip
        assert len(loader.worker_pids) == 2
        for epoch in range(2):
            rows = [(i, int(label)) for b in loader for i, label, pad in zip(
                b["index"].tolist(), b["label"], b["is_pad"].tolist()) if not pad]  # fmt: skip
            drawn = sampling.order(41, epoch, 9).tolist()
            assert [i for i, _ in rows] == drawn
            assert [label for _, label in rows] == [i % 5 if i < 11 else 5 + (i - 11) % 5 for i in drawn]
