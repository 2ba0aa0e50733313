"""The order a conversion writes: a class-ordered input shuffled by a seeded permutation, recorded in the manifest.

The permutation is a pure function of ``(seed, n)``; a converted image folder's shards each hold many classes (as a
random permutation's would) where the source's order gives one or two. The same bytes whatever the worker count
and after a kill: ``test_convert.py`` and ``test_resume.py``, which convert image folders in this default order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from converters.base import ConversionError
from converters.input_plan import plan_input
from converters.jobdir import job_digest
from converters.order import Permutation, choose_order
from converters.runner import SHARD_LAYOUT_VERSION, convert
from converters.sources import ArraysSource, ImageFolderSource, ListFileSource
from converters.synth import make_imagefolder
from dali_pipes import open_store
from dali_pipes.dataset.manifest import ManifestError, load_manifest, parse_manifest
from dali_pipes.dataset.sample_order import SOURCE_ORDER, SampleOrder, order_line

from test_convert import run_cli

CLASSES, PER_CLASS, PER_SHARD = 5, 8, 8


@pytest.fixture(scope="module")
def class_folder(tmp_path_factory) -> Path:
    """40 small JPEGs in 5 class folders of 8: one source-ordered shard of 8 is one class."""
    root = tmp_path_factory.mktemp("order") / "images"
    return make_imagefolder(root, CLASSES * PER_CLASS, size=(32, 24), classes=CLASSES, seed=1, workers=1)


def _labels_per_shard(out: Path) -> list[list[int]]:
    store = open_store(out)
    offsets = store.manifest.shard_offsets
    labels = [int(store[i]["label"]) for i in range(len(store))]
    return [labels[a:b] for a, b in zip(offsets, offsets[1:])]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_the_permutation_is_a_bijection_and_a_pure_function_of_seed_and_count(n):
    first = Permutation(n, 5).positions(range(n)).tolist()
    assert sorted(first) == list(range(n))
    assert first == Permutation(n, 5).positions(range(n)).tolist() and first[n // 2] == Permutation(n, 5)(n // 2)
    if n >= 64:
        assert first != Permutation(n, 6).positions(range(n)).tolist() and first != list(range(n))
    with pytest.raises(IndexError):
        Permutation(n, 5)(n)


def test_the_permutation_mixes_a_class_ordered_list_as_a_random_one_does():
    # 100 classes of 100 in class order; a random permutation puts 63.4 classes in each run of 100 on average.
    labels = np.empty(10_000, dtype=np.int64)
    labels[Permutation(10_000, 0).positions(range(10_000))] = np.arange(10_000) // 100
    mean = np.mean([len(set(labels[a : a + 100])) for a in range(0, 10_000, 100)])
    assert 60 <= mean <= 67, mean


def test_auto_shuffles_class_ordered_sources_only(tmp_path, class_folder):
    (tmp_path / "labels.txt").write_text("a.jpg 0\nb.jpg 1\n")
    (tmp_path / "paths.txt").write_text("a.jpg\nb.jpg\n")
    np.save(tmp_path / "x.npy", np.zeros((3, 2), np.float32))
    assert choose_order(ImageFolderSource(class_folder)) == SampleOrder("shuffled", 0)
    assert choose_order(ListFileSource(tmp_path / "labels.txt"), seed=4) == SampleOrder("shuffled", 4)
    assert choose_order(ListFileSource(tmp_path / "paths.txt")) == SOURCE_ORDER  # no labels, no classes to mix
    assert choose_order(ArraysSource([tmp_path / "x.npy"])) == SOURCE_ORDER
    assert choose_order(ArraysSource([tmp_path / "x.npy"]), "shuffled", 2) == SampleOrder("shuffled", 2)
    assert choose_order(ImageFolderSource(class_folder), "source") == SOURCE_ORDER
    with pytest.raises(ConversionError, match="unknown --order 'random'"):
        choose_order(ImageFolderSource(class_folder), "random")
    with pytest.raises(ConversionError, match="--order-seed must be a non-negative integer"):
        choose_order(ImageFolderSource(class_folder), "auto", -1)


def test_a_class_folder_is_written_shuffled_by_default_and_in_source_order_on_request(class_folder, tmp_path):
    options = dict(format="lmdb", samples_per_shard=PER_SHARD, progress=False)
    shuffled = convert(ImageFolderSource(class_folder), tmp_path / "shuffled", workers=1, **options)
    source = convert(ImageFolderSource(class_folder), tmp_path / "source", workers=1, order="source", **options)
    assert shuffled.manifest.order == SampleOrder("shuffled", 0) and source.manifest.order == SOURCE_ORDER
    assert json.loads((tmp_path / "shuffled" / "index.json").read_text())["order"] == {"kind": "shuffled", "seed": 0}

    in_order = _labels_per_shard(tmp_path / "source")
    assert [set(labels) for labels in in_order] == [{label} for label in range(CLASSES)]
    mixed = _labels_per_shard(tmp_path / "shuffled")
    # A random permutation: 5 * (1 - 0.8 ** 8) = 4.2 classes in a shard of 8 on average.
    assert len(mixed) == CLASSES and 3.4 <= np.mean([len(set(labels)) for labels in mixed]) <= 5

    # The same samples, each once, its key still naming its file and class.
    store = open_store(tmp_path / "shuffled")
    keys = [store[i]["key"].decode() for i in range(len(store))]
    assert sorted(keys) == sorted(str(p.relative_to(class_folder)) for p in class_folder.glob("*/*"))
    classes = store.manifest.classes
    assert all(classes[int(store[i]["label"])] == keys[i].split("/")[0] for i in range(len(store)))
    assert store[0]["image"] == (class_folder / keys[0]).read_bytes()

    # The same bytes from any worker count, and on a resumed run: test_convert.py and test_resume.py, whose image
    # folders are converted in this default order.


def test_a_shuffled_order_cuts_shards_by_count_and_a_job_with_another_order_is_refused(class_folder, tmp_path):
    out = tmp_path / "out"
    # 40 inputs of one size or another: an automatic size (the whole input in one shard, here) by count.
    result = convert(ImageFolderSource(class_folder), out, format="lmdb", workers=1, progress=False)
    assert sum(s.num_samples for s in result.manifest.shards) == CLASSES * PER_CLASS
    assert not (out / ".dali-pipes-job").exists()
    with pytest.raises(
        ConversionError, match=r"holds a different dataset \(written shuffled \(seed 0\), not in source"
    ):
        convert(ImageFolderSource(class_folder), out, format="lmdb", workers=1, order="source")
    with pytest.raises(ConversionError, match=r"\(written shuffled \(seed 0\), not shuffled \(seed 3\): --order\)"):
        convert(ImageFolderSource(class_folder), out, format="lmdb", workers=1, order_seed=3)
    again = convert(ImageFolderSource(class_folder), out, format="lmdb", workers=1, progress=False)
    assert again.already_complete


def _job_digest(source, order: SampleOrder) -> str:
    """What ``job.json`` records for a conversion of ``source`` in ``order`` by shards of :data:`PER_SHARD`."""
    inputs = plan_input(source, samples_per_shard=PER_SHARD, order=order)
    return f"{job_digest(source, 'lmdb', inputs.plans, inputs.identity)}:layout-{SHARD_LAYOUT_VERSION}"


def test_an_unfinished_job_resumed_with_another_order_or_seed_is_refused(class_folder, tmp_path):
    source = ImageFolderSource(class_folder)
    digests = {order: _job_digest(source, order) for order in (SOURCE_ORDER, SampleOrder("shuffled", 0))}
    assert len(set(digests.values())) == 2 and _job_digest(source, SampleOrder("shuffled", 1)) not in digests.values()
    out = tmp_path / "out"
    (out / ".dali-pipes-job").mkdir(parents=True)  # an unfinished job of seed 0, as a killed run leaves it
    (out / ".dali-pipes-job" / "job.json").write_text(json.dumps({"digest": digests[SampleOrder("shuffled", 0)]}))
    for order, seed in (("source", 0), ("shuffled", 1)):
        with pytest.raises(ConversionError, match="unfinished conversion of a different input, with other options"):
            convert(source, out, format="lmdb", samples_per_shard=PER_SHARD, order=order, order_seed=seed)
    result = convert(source, out, format="lmdb", samples_per_shard=PER_SHARD, workers=1, progress=False)
    assert result.manifest.order == SampleOrder("shuffled", 0)


def test_the_cli_keeps_the_source_order_on_request(class_folder, tmp_path):
    run_cli("convert", "imagefolder", class_folder, tmp_path / "out", "--order", "source", "--no-progress",
            "--samples-per-shard", PER_SHARD, "--workers", "1")  # fmt: skip
    assert load_manifest(tmp_path / "out").order == SOURCE_ORDER
    assert [set(labels) for labels in _labels_per_shard(tmp_path / "out")] == [{c} for c in range(CLASSES)]
    bad = run_cli("convert", "imagefolder", class_folder, tmp_path / "bad", "--order-seed", "-2", check=False)
    assert bad.returncode != 0 and "--order-seed must be a non-negative integer, got -2" in bad.stderr


def test_a_manifest_without_an_order_reads_as_unrecorded_and_a_bad_one_is_refused(class_folder, tmp_path):
    convert(ImageFolderSource(class_folder), tmp_path / "out", format="lmdb", workers=1, progress=False)
    data = json.loads((tmp_path / "out" / "index.json").read_text())
    del data["order"]  # as versions before the entry wrote it
    assert parse_manifest(data).order is None
    assert parse_manifest({**data, "order": {"kind": "source"}}).order == SOURCE_ORDER
    for bad in ({"kind": "sorted"}, {"kind": "shuffled"}, {"kind": "shuffled", "seed": -1}, "shuffled"):
        with pytest.raises(ManifestError, match="order"):
            parse_manifest({**data, "order": bad})


def test_from_dataset_keeps_the_index_unless_asked_to_shuffle(tmp_path):
    from dali_pipes.convert import Field, from_dataset

    rows = [(np.int64(i // 4),) for i in range(16)]  # 4 classes, in order
    fields = {"label": Field.array("int64", ())}
    kept = from_dataset(rows, tmp_path / "kept", fields=fields, workers=1, samples_per_shard=4, progress=False)
    mixed = from_dataset(rows, tmp_path / "mixed", fields=fields, workers=1, samples_per_shard=4, progress=False,
                         order="shuffled", order_seed=3)  # fmt: skip
    assert kept.manifest.order == SOURCE_ORDER and mixed.manifest.order == SampleOrder("shuffled", 3)
    assert [int(open_store(tmp_path / "kept")[i]["label"]) for i in range(16)] == [i // 4 for i in range(16)]
    labels = [int(open_store(tmp_path / "mixed")[i]["label"]) for i in range(16)]
    assert sorted(labels) == [i // 4 for i in range(16)] and labels != sorted(labels)


def test_a_report_line_says_how_the_samples_were_written():
    assert order_line(SampleOrder("shuffled", 7)) == "written in a shuffled order (convert's seed 7)"
    assert order_line(SOURCE_ORDER).startswith("written in source order")
    assert order_line(None).startswith("order not recorded")


def test_mixing_says_whether_the_samples_were_written_shuffled_or_in_source_order(class_folder, tmp_path, capsys):
    from dali_pipes.cli.command import main

    options = dict(format="lmdb", samples_per_shard=PER_SHARD, workers=1, progress=False)
    convert(ImageFolderSource(class_folder), tmp_path / "shuffled", **options)
    convert(ImageFolderSource(class_folder), tmp_path / "source", order="source", **options)
    said = {}
    for name in ("shuffled", "source"):
        assert main(["mixing", str(tmp_path / name), "--windows", "1", "--batch-size", "8"]) == 0
        said[name] = capsys.readouterr().out.splitlines()[0]
    assert said["shuffled"].endswith("; written in a shuffled order (convert's seed 0)"), said
    assert said["source"].endswith("; written in source order (convert --order shuffled mixes a class-ordered input)")
    assert main(["mixing", str(tmp_path / "source"), "--json", "--windows", "1", "--batch-size", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["order"].startswith("written in source order")
