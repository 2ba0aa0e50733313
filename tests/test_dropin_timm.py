"""timm's drop-in against timm's own rules: its class indices, its batches per rank under DDP, its signatures.

The references are timm's code itself, as installed (``pip install --no-deps timm``): its folder reader's
``find_images_and_targets`` and ``load_class_map`` and its ``natural_key`` run on the raw image folder, and
the signatures of ``create_loader``/``create_dataset`` are read from its source. timm's package ``__init__``
imports torchvision, which has no build for the pinned CPU torch, so :func:`_timm_reader` loads those modules
from their files under empty parent packages (their own imports are ``re``, ``os``, ``pickle``...). timm's
training sampler is torch's ``DistributedSampler`` under a ``DataLoader(drop_last=True)``: both are torch's own.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import pickle
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from converters.runner import convert
from converters.sources import ImageFolderSource
from converters.synth import make_imagefolder
from dali_pipes import load_manifest, num_batches, open_store, rank_indices

#: Class folders created in this order, the k-th holding k + 1 images: plain sorted order ('10' < '84' < '9',
#: 'Zebra' < 'apple', 'img10' < 'img2') and timm's natural order ('9' < '10' < '84' < 'apple' < 'img2' < 'img10'
#: < 'Zebra') differ, and so do the label counts under each (a permuted label is seen even in a shuffled epoch).
CLASS_NAMES = ("9", "84", "10", "Zebra", "apple", "img2", "img10")
N_IMAGES = sum(range(1, len(CLASS_NAMES) + 1))  # 28


def _timm_path() -> Path:
    found = importlib.util.find_spec("timm")  # finds the package without running its __init__ (torchvision)
    if found is None or not found.submodule_search_locations:
        pytest.skip("timm is not installed (pip install --no-deps timm): it is the reference these tests compare with")
    return Path(list(found.submodule_search_locations)[0])


def _timm_reader() -> types.SimpleNamespace:
    """timm's ``find_images_and_targets``, ``load_class_map`` and ``natural_key``, from its installed files."""
    base = _timm_path()
    saved = {name: module for name, module in sys.modules.items() if name == "timm" or name.startswith("timm.")}
    try:
        for name, folder in (("timm", ""), ("timm.utils", "utils"), ("timm.data", "data"), ("timm.data.readers", "data/readers")):  # fmt: skip
            package = types.ModuleType(name)
            package.__path__ = [str(base / folder)]  # a package whose __init__ is not run
            sys.modules[name] = package
        folder_reader = importlib.import_module("timm.data.readers.reader_image_folder")
        class_map = importlib.import_module("timm.data.readers.class_map")
        misc = importlib.import_module("timm.utils.misc")
    finally:  # nothing of this partial timm stays for other tests
        for name in [name for name in sys.modules if name == "timm" or name.startswith("timm.")]:
            del sys.modules[name]
        sys.modules.update(saved)
    return types.SimpleNamespace(
        find_images_and_targets=folder_reader.find_images_and_targets,
        load_class_map=class_map.load_class_map,
        natural_key=misc.natural_key,
    )


@pytest.fixture(scope="module")
def timm_reader():
    return _timm_reader()


@pytest.fixture(scope="module")
def named_classes(tmp_path_factory):
    """``(raw image folder, converted dataset)``: CLASS_NAMES' folders, the k-th with k + 1 JPEGs."""
    root = tmp_path_factory.mktemp("timm-classes")
    source = make_imagefolder(root / "source", N_IMAGES, size=(40, 40), classes=1, seed=5)
    files = iter(sorted((source / "class_000").glob("*.jpg")))
    raw = root / "images" / "train"
    for count, name in enumerate(CLASS_NAMES, start=1):
        (raw / name).mkdir(parents=True)
        for _ in range(count):
            image = next(files)
            shutil.copy(image, raw / name / image.name)
    convert(ImageFolderSource(raw), root / "shards" / "train", format="lmdb", workers=1, progress=False)
    return raw, root / "shards"


def _timm_labels(timm_reader, raw: Path, shards: Path, class_to_idx=None) -> tuple[list[int], dict[str, int]]:
    """The label timm's folder reader gives each sample, in the converted dataset's order; its class_to_idx."""
    samples, timm_class_to_idx = timm_reader.find_images_and_targets(str(raw), class_to_idx=class_to_idx)
    by_key = {os.path.relpath(path, raw).replace(os.sep, "/"): target for path, target in samples}
    store = open_store(shards / "train")
    keys = [bytes(store[i]["key"]).decode() for i in range(len(store))]  # the path under the image folder
    return [by_key[key] for key in keys], timm_class_to_idx


def _eval_labels(dataset) -> list[int]:
    from dali_pipes.dropin.timm_train import create_loader

    with create_loader(dataset, input_size=32, batch_size=7, is_training=False, device="cpu") as loader:
        return torch.cat([label for _, label in loader]).tolist()


# --- 1. timm's class indices -----------------------------------------------------------------------------------------


def test_the_class_indices_are_timms_natural_order_in_the_dataset_the_loader_and_its_labels(named_classes, timm_reader):
    from dali_pipes.dropin.timm_train import create_dataset, create_loader

    raw, shards = named_classes
    expected, timm_class_to_idx = _timm_labels(timm_reader, raw, shards)
    # The converted dataset keeps the package's rule (plain sorted order), which is not timm's here.
    assert list(load_manifest(shards / "train").classes) == sorted(CLASS_NAMES)
    assert sorted(CLASS_NAMES) != sorted(CLASS_NAMES, key=timm_reader.natural_key)

    dataset = create_dataset("", root=shards, split="train", is_training=False, class_map="")
    assert dataset.class_to_idx == timm_class_to_idx
    assert dataset.classes == sorted(CLASS_NAMES, key=timm_reader.natural_key)
    assert _eval_labels(dataset) == expected  # each image's label is the one timm's reader gives it

    # Training: shuffled, and mixed by timm's Mixup (here off, as at --mixup-off-epoch): the one-hot targets
    # are timm's indices, and loader.dataset is the dataset given, as timm's DataLoader keeps it.
    from recipe_helpers import timm_module

    fast = timm_module("mixup").FastCollateMixup(mixup_alpha=0.8, num_classes=len(CLASS_NAMES))
    train = create_dataset("", root=shards, split="train", is_training=True)
    with create_loader(train, input_size=32, batch_size=4, is_training=True, collate_fn=fast, device="cpu") as loader:
        loader.mixup_enabled = False
        assert not loader.mixup_enabled and loader.dataset is train
        targets = torch.cat([target for _, target in loader]).argmax(1)
    assert sorted(targets.tolist()) == sorted(expected)


def test_timms_class_map_is_honoured_as_txt_pkl_or_dict_and_one_missing_a_class_is_refused(
    named_classes, timm_reader, tmp_path
):
    from dali_pipes.dropin.timm_train import create_dataset

    raw, shards = named_classes
    # timm's --class-map: one class a line; here the reverse of the natural order, and a class this split lacks.
    names = [*sorted(CLASS_NAMES, key=timm_reader.natural_key, reverse=True), "absent"]
    (tmp_path / "map.txt").write_text("".join(f"{name}\n" for name in names), encoding="utf-8")
    mapping = {name: 10 + 2 * i for i, name in enumerate(names)}  # indices with gaps, as a dict or pickle may hold
    (tmp_path / "map.pkl").write_bytes(pickle.dumps(mapping))
    for class_map in (str(tmp_path / "map.txt"), str(tmp_path / "map.pkl"), mapping):
        timm_map = timm_reader.load_class_map(class_map, str(raw))
        expected, timm_class_to_idx = _timm_labels(timm_reader, raw, shards, class_to_idx=timm_map)
        dataset = create_dataset("", root=shards, split="train", class_map=class_map)
        assert dataset.class_to_idx == timm_class_to_idx
        assert _eval_labels(dataset) == expected

    # timm would leave out the images of a class missing from the map; the loader cannot, and says so.
    with pytest.raises(ValueError, match=r"create_dataset\(class_map=.*1 class\(es\).*'9'.*add them"):
        create_dataset("", root=shards, split="train", class_map={name: i for i, name in enumerate(CLASS_NAMES[1:])})
    with pytest.raises(ValueError, match=r"create_dataset\(class_map='nowhere.txt'\): no such file"):
        create_dataset("", root=shards, split="train", class_map="nowhere.txt")


# --- 3. timm's batches per rank under DDP ----------------------------------------------------------------------------


def _timm_train_batches(n: int, batch: int, world: int) -> int:
    """Batches per rank of timm's training loader: torch's DistributedSampler under DataLoader(drop_last=True)."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=0, shuffle=True)
    return len(DataLoader(range(n), batch_size=batch, sampler=sampler, drop_last=True))


def test_the_training_batch_count_per_rank_is_timms_for_every_size_batch_and_world():
    from dali_pipes.dropin.timm_train import train_last_batch

    for n in range(1, 61):
        for batch in range(1, 10):
            for world in range(1, 5):
                policy = train_last_batch(n, batch, world)
                count = num_batches(n, batch, world, policy)
                assert count == _timm_train_batches(n, batch, world), (n, batch, world, policy)
                for rank in range(world):  # every batch whole on every rank, as with drop_last
                    indices, _ = rank_indices(n, batch, rank, world, epoch=0, seed=0, last_batch=policy)
                    assert len(indices) == count * batch, (n, batch, world, rank)


@pytest.fixture(scope="module")
def shards_47(tmp_path_factory):
    root = tmp_path_factory.mktemp("timm-47")
    images = make_imagefolder(root / "images" / "train", 47, size=(32, 32), classes=3, seed=4)
    convert(ImageFolderSource(images), root / "shards" / "train", format="lmdb", workers=1, progress=False)
    return root / "shards"


def test_47_samples_batch_8_on_2_ranks_train_3_whole_batches_a_rank_as_timms_loader(shards_47, monkeypatch):
    from dali_pipes.dropin.timm_train import create_dataset, create_loader

    dataset = create_dataset("", root=shards_47, split="train", is_training=True, seed=3)
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        with create_loader(dataset, input_size=16, batch_size=8, is_training=True, device="cpu") as loader:
            assert len(loader) == _timm_train_batches(47, 8, 2) == 3 and loader.drop_last
            sizes = [len(label) for _, label in loader]
            assert sizes == [8, 8, 8]
            seen.append(loader.samples_per_epoch)
    assert sum(seen) == 48  # the epoch padded by one sample, as timm's DistributedSampler pads it
    for batch, world in ((5, 2), (8, 3)):  # 4 and 2 batches a rank: one dropped tail, one padded
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
        with create_loader(dataset, input_size=16, batch_size=batch, is_training=True, device="cpu") as loader:
            assert len(loader) == _timm_train_batches(47, batch, world), (batch, world)


# --- 6. every argument of timm's create_loader and create_dataset --------------------------------------------------


def _timm_parameters(relative: str, function: str) -> list[str]:
    """The parameter names of timm's ``function`` in ``timm/<relative>``, read from its source."""
    tree = ast.parse((_timm_path() / relative).read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return [arg.arg for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]


def test_every_argument_of_timms_create_loader_and_create_dataset_is_known_to_the_drop_in():
    from dali_pipes.dropin import timm_train

    loader_args = _timm_parameters("data/loader.py", "create_loader")
    known = {*timm_train._HONOURED, *timm_train._UNSUPPORTED, *timm_train._MACHINERY}
    assert loader_args[:4] == ["dataset", "input_size", "batch_size", "is_training"]
    assert set(loader_args[4:]) == known  # each one handled, and no name timm does not have

    dataset_args = _timm_parameters("data/dataset_factory.py", "create_dataset")
    assert [*inspect.signature(timm_train.create_dataset).parameters][:-1] == dataset_args
    # What timm hands on to its folder dataset and reader (ImageDataset's and ReaderImageFolder's arguments).
    for relative, function in (("data/dataset.py", "__init__"), ("data/readers/reader_image_folder.py", "__init__")):
        handed = set(_timm_parameters(relative, function)) - {"self", "root", "reader", "split", "class_map"}
        assert handed - {"load_bytes", "input_img_mode"} <= set(timm_train._DATASET_UNSUPPORTED), (relative, handed)


def test_unknown_and_unhonoured_arguments_are_refused_by_name(named_classes):
    from dali_pipes.dropin import timm_train
    from dali_pipes.dropin.timm_train import create_dataset, create_loader

    _, shards = named_classes
    with pytest.raises(TypeError, match=r"create_dataset\(\) got unexpected keyword argument\(s\) 'img_size'"):
        create_dataset("", root=shards, split="train", img_size=224)
    for name, value in (("load_bytes", True), ("num_samples", 10), ("repeats", 2), ("input_img_mode", "L"),
                        ("input_key", "jpg"), ("target_key", "cls"), ("transform", print)):  # fmt: skip
        with pytest.raises(ValueError, match=rf"create_dataset\({name}=.*leave it at"):
            create_dataset("", root=shards, split="train", **{name: value})
    with pytest.raises(Exception, match="not a dataset converted by dali-pipes"):  # search_split=False: root itself
        create_dataset("", root=shards, split="train", search_split=False)

    dataset = create_dataset("", root=shards, split="train")
    with pytest.raises(TypeError, match=r"create_loader\(\) got unexpected keyword argument\(s\) 'drop_last'"):
        create_loader(dataset, input_size=32, batch_size=4, drop_last=True)
    for name in timm_train._UNSUPPORTED:
        with pytest.raises(ValueError, match=rf"create_loader\({name}='x'\).*leave it at"):
            create_loader(dataset, input_size=32, batch_size=4, **{name: "x"})


def test_fp16_and_use_prefetcher_set_the_image_dtype_as_timms_prefetcher(named_classes):
    from dali_pipes.dropin.timm_train import create_dataset, create_loader

    _, shards = named_classes
    dataset = create_dataset("", root=shards, split="train")
    for options, dtype in (
        (dict(fp16=True), torch.float16),  # deprecated, and overriding img_dtype as in timm's PrefetchLoader
        (dict(img_dtype=torch.bfloat16, use_prefetcher=False), torch.float32),  # timm casts in its prefetcher only
    ):
        with create_loader(dataset, input_size=16, batch_size=4, device="cpu", **options) as loader:
            image, _ = next(iter(loader))
        assert image.dtype == dtype, options
