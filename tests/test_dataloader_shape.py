"""DALILoader as scripts written for a DataLoader use it: tuples, ``dataset``, ``sampler.set_epoch``, exact evaluation."""

from __future__ import annotations

import pytest
import torch
from test_ddp import run_job

from dali_pipes import BatchFormat, ClassificationVal, DALILoader, RunOptions, open_store
from dali_pipes.loading.compat import LoaderDataset

from loader_helpers import TinySpec, write_dataset

CPU = RunOptions(device="cpu")

N = 23


@pytest.fixture(scope="module")
def photos(imagenet_mini, tmp_path_factory):
    """The package's sample photos (class folders), converted to LMDB."""
    from converters.runner import convert
    from converters.sources import ImageFolderSource

    out = tmp_path_factory.mktemp("shape") / "shards"
    convert(ImageFolderSource(imagenet_mini), out, format="lmdb", workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("shape-tiny") / "ds", N, samples_per_shard=5)


def test_tuples_and_the_attributes_a_training_script_reads(photos):
    store = open_store(photos)
    classes = list(store.manifest.classes)
    labels = {i: int(store.read(i, ("label",))["label"]) for i in range(len(store))}
    fmt = BatchFormat(keys=("image", "label", "index"), with_index=True)
    with DALILoader(photos, TinySpec(), batch_size=8, run=CPU, batch_format=fmt) as loader:
        assert len(loader.dataset) == len(store) and loader.dataset.classes == classes and len(classes) > 1
        assert loader.dataset.class_to_idx == {name: i for i, name in enumerate(classes)}
        assert loader.batch_size == 8 and loader.drop_last is False
        assert len(loader.sampler) == loader.samples_per_epoch == len(store)  # one rank: the whole dataset
        loader.sampler.set_epoch(3)
        assert loader.epoch == 3
        seen = []
        for batch in loader:
            assert isinstance(batch, tuple) and len(batch) == 3
            image, label, index = batch
            assert image.dim() == 4 and len(image) == len(label) and label.dtype == torch.int64
            assert [labels[i] for i in index.tolist()] == label.tolist()  # each image with its own label
            seen.extend(index.tolist())
        assert sorted(seen) == list(range(len(store)))
        assert loader.epoch == 4  # the next pass: set_epoch went through the sampler to the loader
    with pytest.raises(TypeError, match="read inside DALI"):
        LoaderDataset(store)[0]


@pytest.mark.parametrize("drop", [False, True])
def test_evaluation_without_padding_counts_each_sample_once_over_the_ranks(tiny, drop):
    """23 samples, batch 4, 3 ranks: with drop_padding the ranks' rows add up to the dataset, once each."""
    fmt = BatchFormat(keys=("label", "index"), drop_padding=drop, with_index=True)
    counts, rows = [], []
    for rank in range(3):
        run = RunOptions(device="cpu", rank=rank, world_size=3)
        with DALILoader(tiny, TinySpec(), batch_size=4, shuffle=False, run=run, batch_format=fmt) as loader:
            batches = list(loader)
            counts.append(len(batches))
            rows.extend(i for _, index in batches for i in index.tolist())
    assert len(set(counts)) == 1  # every rank yields as many batches: no collective waits for ever
    if drop:
        assert sorted(rows) == list(range(N))
    else:
        assert sorted(set(rows)) == list(range(N)) and len(rows) == counts[0] * 3 * 4  # the filler is duplicates


def _evaluate(path, n_ranks, batch_size):
    """Each rank's ``(label, index)`` batches, one loader per rank in turn, read in order without padding."""
    fmt = BatchFormat(keys=("label", "index"), drop_padding=True, with_index=True)
    per_rank = []
    for rank in range(n_ranks):
        run = RunOptions(device="cpu", rank=rank, world_size=n_ranks)
        with DALILoader(path, TinySpec(), batch_size=batch_size, shuffle=False, run=run, batch_format=fmt) as loader:
            per_rank.append([index.tolist() for _, index in loader])
    return per_rank


@pytest.mark.parametrize("n, batch_size", [(16, 4), (10, 2), (10, 4)])
def test_evaluation_without_padding_never_yields_an_empty_batch_on_any_rank(tmp_path, n, batch_size):
    """3 ranks: every rank as many batches, none empty, the rows of all of them the dataset once each.

    16 in batches of 4 left rank 2 a last batch of padding alone (0 rows) before the last step was dealt out
    evenly; 10 in batches of 2 or 4 are the batch sizes the refusal below proposes.
    """
    per_rank = _evaluate(write_dataset(tmp_path / "ds", n, samples_per_shard=5), 3, batch_size)
    assert len({len(batches) for batches in per_rank}) == 1  # every rank takes as many steps
    assert all(len(batch) > 0 for batches in per_rank for batch in batches)  # accuracy divides by the rows
    assert sorted(i for batches in per_rank for batch in batches for i in batch) == list(range(n))


def test_evaluation_that_would_leave_a_rank_an_empty_last_batch_is_refused_naming_batch_sizes_that_work(tmp_path):
    # 10 samples, batch 3, 3 ranks: the last step holds 1 sample, so ranks 1 and 2 would get 0 rows.
    dataset = write_dataset(tmp_path / "ds", 10, samples_per_shard=5)
    fmt = BatchFormat(keys=("label", "index"), drop_padding=True, with_index=True)
    for rank in range(3):  # every rank refuses alike: none is left waiting in a collective for the others
        run = RunOptions(device="cpu", rank=rank, world_size=3)
        with pytest.raises(ValueError, match=r"drop_padding=True.*rank\(s\) 1, 2 would get an empty last batch.*"
                           r"batch_size=2 or 4.*is_pad"):  # fmt: skip
            DALILoader(dataset, TinySpec(), batch_size=3, shuffle=False, run=run, batch_format=fmt)
    with DALILoader(dataset, TinySpec(), batch_size=3, run=RunOptions(device="cpu", rank=2, world_size=3)) as padded:
        assert [len(batch["label"]) for batch in padded] == [3, 1]  # with the padding kept: one filler row
    tiny_set = write_dataset(tmp_path / "two", 2)
    with pytest.raises(ValueError, match="2 samples in batches of 1 on 3 ranks.*evaluate on at most 2 ranks"):
        _evaluate(tiny_set, 3, 1)


@pytest.mark.timeout(300)
def test_a_ddp_evaluation_on_three_ranks_has_no_empty_batch_or_refuses_on_every_rank(tmp_path):
    """Real processes (gloo) in lockstep, tuples without padding: 16 samples read once, no rank given 0 rows;
    10 in batches of 3 refused by every rank when its loader is made, so the job ends instead of hanging."""
    import torch.multiprocessing as mp

    reports = run_job(3, write_dataset(tmp_path / "16", 16, samples_per_shard=5), tmp_path, batch_size=4, epochs=1,
                      dataloader_shape=True, shuffle=False)  # fmt: skip
    per_rank = [report["epochs"][0] for report in reports]
    assert [len(batches) for batches in per_rank] == [2, 2, 2]
    assert [len(indices) for batches in per_rank for indices, _ in batches] == [4, 2, 4, 1, 4, 1]
    assert sorted(i for batches in per_rank for indices, _ in batches for i in indices) == list(range(16))
    with pytest.raises(mp.ProcessRaisedException, match="would get an empty last batch"):
        run_job(3, write_dataset(tmp_path / "10", 10), tmp_path, batch_size=3, epochs=1, dataloader_shape=True)


def test_a_resumed_evaluation_pass_that_would_leave_a_rank_empty_is_refused_before_it_starts(tiny):
    # 23 samples: a state saved after 10 (one batch of 5 on 2 ranks) leaves 13 for 3 ranks in batches of 4, so
    # the last step holds 1 sample. Refused at iter(), the loader unchanged: a whole epoch still reads.
    fmt = BatchFormat(keys=("label", "index"), drop_padding=True, with_index=True)
    run = RunOptions(device="cpu", rank=0, world_size=3)
    with DALILoader(tiny, TinySpec(), batch_size=4, shuffle=False, run=run, batch_format=fmt) as loader:
        whole = loader.state_dict()
        loader.load_state_dict({**whole, "samples_consumed": 10})
        with pytest.raises(ValueError, match=r"13 samples in batches of 4 on 3 ranks leave 1 for the last step"):
            iter(loader)
        loader.load_state_dict(whole)
        assert [i for _, index in loader for i in index.tolist()] == [0, 1, 2, 3, 12, 13, 14, 15]


def test_batch_format_refuses_what_it_cannot_yield(tiny):
    with pytest.raises(TypeError, match="tuple of output names"):
        BatchFormat(keys="image")
    fmt = BatchFormat(keys=("image", "target"))
    with DALILoader(tiny, TinySpec(), batch_size=4, run=CPU, batch_format=fmt) as loader:
        with pytest.raises(KeyError, match="'target'.*outputs are 'image', 'label', 'is_pad'"):
            next(iter(loader))


def test_a_ddp_evaluation_through_the_dataloader_surface_reads_each_sample_once(tiny, tmp_path):
    """Real processes (gloo): sampler.set_epoch and tuples without padding, each epoch exactly the dataset."""
    reports = run_job(3, tiny, tmp_path, batch_size=4, epochs=2, dataloader_shape=True)
    assert all(report["dataset_len"] == N for report in reports)
    for epoch in range(2):
        per_rank = [report["epochs"][epoch] for report in reports]
        assert len({len(batches) for batches in per_rank}) == 1
        read = sorted(i for batches in per_rank for indices, _ in batches for i in indices)
        assert read == list(range(N))
    first = [i for report in reports for indices, _ in report["epochs"][0] for i in indices]
    second = [i for report in reports for indices, _ in report["epochs"][1] for i in indices]
    assert first != second  # set_epoch through the sampler changed the order


def test_the_models_dtype_and_channels_last_as_the_scripts_prefetchers_deliver_them(tiny):
    """bfloat16 and channels_last NCHW: the same pixels as the spec's plain NCHW float32 output."""
    plain = BatchFormat(keys=("image", "label"))
    model_like = BatchFormat(keys=("image", "label"), dtype="bfloat16", channels_last=True)
    outputs = {}
    for layout, fmt in (("NCHW", plain), ("NHWC", model_like), ("NCHW", model_like)):
        spec = ClassificationVal(size=16, layout=layout)
        with DALILoader(tiny, spec, batch_size=4, run=CPU, batch_format=fmt) as loader:
            outputs[layout, fmt.dtype] = [image for image, _ in loader]
    for key in (("NHWC", "bfloat16"), ("NCHW", "bfloat16")):
        for image, reference in zip(outputs[key], outputs["NCHW", None]):
            assert image.dtype == torch.bfloat16 and image.shape == reference.shape
            assert image.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(image, reference.to(torch.bfloat16))
    # From NHWC, channels_last is a view of DALI's batch: nothing copied.
    nhwc = torch.rand(2, 5, 6, 3)
    (view,) = BatchFormat(keys=("image",), channels_last=True).apply({"image": nhwc}, last=False, layout="NHWC")
    assert view.data_ptr() == nhwc.data_ptr() and view.shape == (2, 3, 5, 6)
    with pytest.raises(ValueError, match="torch dtype"):
        BatchFormat(dtype="bfloat17")


def test_a_collate_style_transform_runs_on_every_batch(tiny):
    """Any callable, as a script's collate_fn would apply it: called with the tuple's items, its result yielded."""
    plain = BatchFormat(keys=("image", "label"))
    hooked = BatchFormat(keys=("image", "label"), transform=lambda image, label: (image.flip(-1), label + 100))
    got = {}
    for fmt in (plain, hooked):
        with DALILoader(tiny, TinySpec(), batch_size=4, run=CPU, shuffle=False, batch_format=fmt) as loader:
            got[fmt] = list(loader)
    assert len(got[plain]) == len(got[hooked]) == 6
    for (image, label), (flipped, shifted) in zip(got[plain], got[hooked]):
        assert torch.equal(flipped, image.flip(-1)) and torch.equal(shifted, label + 100)


def test_timms_mixup_mixes_our_batches_and_its_switch_is_honoured(tiny):
    """timm's Mixup as the transform: soft targets of the right width; loader.mixup_enabled = False stops it."""
    from recipe_helpers import timm_module

    mixup = timm_module("mixup").Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=5)
    fmt = BatchFormat(keys=("image", "label"), transform=mixup)
    spec = ClassificationVal(size=16)
    with DALILoader(tiny, spec, batch_size=4, run=CPU, last_batch="drop", shuffle=False, batch_format=fmt) as loader:
        assert loader.mixup_enabled
        mixed = list(loader)
        loader.mixup_enabled = False  # timm's train.py at --mixup-off-epoch
        assert mixup.mixup_enabled is False and not loader.mixup_enabled
        unmixed = list(loader)
    with DALILoader(tiny, spec, batch_size=4, run=CPU, last_batch="drop", shuffle=False) as loader:
        reference = [(batch["image"], batch["label"]) for batch in loader]
    assert len(mixed) == len(unmixed) == len(reference) == N // 4
    for (image, target), (ref_image, ref_label) in zip(mixed, reference):
        assert target.shape == (4, 5) and torch.allclose(target.sum(1), torch.ones(4))
        assert not torch.equal(image, ref_image)  # mixed with the flipped batch
    for (image, target), (ref_image, ref_label) in zip(unmixed, reference):
        assert torch.equal(image, ref_image)
        assert target.argmax(1).tolist() == ref_label.tolist() and target.max(1).values.min() > 0.9  # smoothed one-hot


def test_mixing_that_cannot_be_honoured_is_refused_saying_what_to_use(tiny):
    from recipe_helpers import timm_module

    from dali_pipes import ClassificationTrain
    from dali_pipes.pipelines import Mix

    timm_mixup = timm_module("mixup")
    with pytest.raises(ValueError, match="FastCollateMixup.*timm.data.Mixup"):
        BatchFormat(keys=("image", "label"), transform=timm_mixup.FastCollateMixup(mixup_alpha=0.8, num_classes=5))
    mixing_spec = ClassificationTrain(size=16, mix=Mix(mixup_alpha=0.8, num_classes=5))
    fmt = BatchFormat(keys=("image", "label"), transform=timm_mixup.Mixup(mixup_alpha=0.8, num_classes=5))
    with pytest.raises(ValueError, match="mixes in the graph.*mix in one place"):
        DALILoader(tiny, mixing_spec, batch_size=4, run=CPU, batch_format=fmt)
    with DALILoader(tiny, mixing_spec, batch_size=4, run=CPU) as loader:
        assert loader.mixup_enabled
        with pytest.raises(ValueError, match="cannot be switched.*BatchFormat\\(transform=timm.data.Mixup"):
            loader.mixup_enabled = False
        loader.mixup_enabled = True  # already so: nothing to switch
