"""timm's drop-in against timm's own rules: its class indices, its batches per rank under DDP, its signatures.

Class indices are renumbered only where timm's folder reader defines them (a dataset converted from an image
folder, or a ``class_map``); a dataset converted from a WebDataset, TFRecord, Hugging Face or Python dataset keeps
its own numbering, its labels exactly as stored; repeated class names and labels without a class are refused.

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
import io
import os
import pickle
import shutil
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from converters.runner import convert
from converters.sources import ImageFolderSource, WebDatasetSource
from converters.synth import make_imagefolder
from dali_pipes import load_manifest, num_batches, open_store, rank_indices
from dali_pipes.convert import from_dataset

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
        remap_labels=getattr(class_map, "remap_labels", None),  # its Hugging Face readers' class_map (newer timm)
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


# --- 2. datasets whose labels are their source's own numbering -------------------------------------------------------

#: Class names as a classes file lists them (line i is class i): neither natural nor plain sorted order, and with
#: ImageNet's repeated names in the duplicated variant.
PACKED_NAMES = ("Zebra", "10", "apple", "9", "img10", "84", "img2")
REPEATED_NAMES = ("crane", "maillot", "9", "crane", "10", "maillot", "apple")
#: The stored label of each sample, in the dataset's order: class k has k + 1 samples, interleaved.
PACKED_LABELS = [k for k in range(len(PACKED_NAMES)) for _ in range(k + 1)][::2] + [
    k for k in range(len(PACKED_NAMES)) for _ in range(k + 1)
][1::2]


def _convert_packed(kind: str, root: Path, labels: list[int], names: tuple[str, ...]) -> Path:
    """A converted dataset (in ``root/shards/train``) of a source that is not an image folder, with these labels and
    class names: a WebDataset tar with a classes file (``convert webdataset --classes``), or a Python dataset (the
    Hugging Face path: ``from_dataset`` with its ``classes``)."""
    source = make_imagefolder(root / "source", len(labels), size=(40, 40), classes=1, seed=6)
    images = [path.read_bytes() for path in sorted((source / "class_000").glob("*.jpg"))]
    out = root / "shards" / "train"
    if kind == "webdataset":
        with tarfile.open(root / "train.tar", "w") as tar:
            for i, (image, label) in enumerate(zip(images, labels)):
                for name, data in ((f"s{i:03d}.jpg", image), (f"s{i:03d}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        (root / "classes.txt").write_text("".join(f"{name}\n" for name in names), encoding="utf-8")
        source = WebDatasetSource([root / "train.tar"], classes_file=root / "classes.txt")
        convert(source, out, format="lmdb", workers=1, progress=False)
    else:
        rows = [(image, label, f"s{i:03d}") for i, (image, label) in enumerate(zip(images, labels))]
        from_dataset(rows, out, fields=["image", "label", "key"], classes=list(names), workers=1, progress=False)
    manifest = load_manifest(out)
    assert manifest.source["kind"] == kind and list(manifest.classes) == list(names)
    assert [int(open_store(out)[i]["label"]) for i in range(len(labels))] == labels
    return root / "shards"


@pytest.fixture(scope="module", params=["webdataset", "dataset"])
def packed(request, tmp_path_factory):
    """``(kind, converted dataset)``: PACKED_LABELS under PACKED_NAMES, from a source that is not an image folder."""
    root = tmp_path_factory.mktemp(f"timm-{request.param}")
    return request.param, _convert_packed(request.param, root, PACKED_LABELS, PACKED_NAMES)


def test_a_dataset_not_converted_from_an_image_folder_keeps_its_labels_and_class_order(packed, timm_reader):
    from dali_pipes.dropin.timm_train import create_dataset, create_loader

    kind, shards = packed
    # The names are in neither timm's natural order nor plain sorted order: renumbering would move every label.
    assert list(PACKED_NAMES) != sorted(PACKED_NAMES, key=timm_reader.natural_key)
    dataset = create_dataset("", root=shards, split="train", is_training=False)
    assert _eval_labels(dataset) == PACKED_LABELS  # each sample's label exactly as stored
    assert dataset.classes == list(PACKED_NAMES)  # line i is class i, as stored
    assert dataset.class_to_idx == {name: i for i, name in enumerate(PACKED_NAMES)}
    assert dataset.source_kind == kind and dataset.label_map is None

    train = create_dataset("", root=shards, split="train", is_training=True)
    with create_loader(train, input_size=32, batch_size=4, is_training=True, device="cpu") as loader:
        labels = torch.cat([label for _, label in loader]).tolist()
    # Shuffled, but every sample once (28 = 7 batches of 4): class k has k + 1 of them, so a renumbering shows.
    assert sorted(labels) == sorted(PACKED_LABELS)


def test_a_class_map_renumbers_a_packed_dataset_by_each_stored_labels_name_as_timms_remap(
    packed, timm_reader, tmp_path
):
    from dali_pipes.dropin.timm_train import create_dataset

    _, shards = packed
    names = [*sorted(PACKED_NAMES, key=timm_reader.natural_key, reverse=True), "absent"]
    (tmp_path / "map.txt").write_text("".join(f"{name}\n" for name in names), encoding="utf-8")
    class_to_idx = {name: i for i, name in enumerate(names)}
    expected = [class_to_idx[PACKED_NAMES[label]] for label in PACKED_LABELS]
    if timm_reader.remap_labels is not None:  # timm's own: a stored class index, through its name, into the map
        source_names = dict(enumerate(PACKED_NAMES))
        assert [timm_reader.remap_labels(label, class_to_idx, source_names) for label in PACKED_LABELS] == expected
    dataset = create_dataset("", root=shards, split="train", class_map=str(tmp_path / "map.txt"))
    assert dataset.class_to_idx == class_to_idx
    assert _eval_labels(dataset) == expected


def test_repeated_class_names_keep_their_labels_and_are_refused_wherever_a_name_decides_an_index(tmp_path):
    from dali_pipes.dropin.timm_classes import timm_class_to_idx
    from dali_pipes.dropin.timm_train import create_dataset

    shards = _convert_packed("webdataset", tmp_path, PACKED_LABELS, REPEATED_NAMES)
    dataset = create_dataset("", root=shards, split="train")
    # Nothing to renumber: the two cranes keep their two labels, and classes names each label.
    assert _eval_labels(dataset) == PACKED_LABELS
    assert dataset.classes == list(REPEATED_NAMES) and dataset.label_map is None
    # No dict can hold both cranes: class_to_idx is refused, naming them, rather than giving them one index.
    with pytest.raises(
        ValueError, match=r"2 class name\(s\) repeat \('crane' at labels 0, 3; 'maillot' at labels 1, 5\)"
    ):
        dataset.class_to_idx  # noqa: B018 - reading it is the test
    # A class map looks the stored labels up by name: two classes of one name cannot be told apart.
    with pytest.raises(ValueError, match=r"create_dataset\(class_map=.*'crane' at labels 0, 3"):
        create_dataset("", root=shards, split="train", class_map={name: i for i, name in enumerate(REPEATED_NAMES)})
    with pytest.raises(ValueError, match=r"'crane' at labels 0, 3"):
        timm_class_to_idx(REPEATED_NAMES)
    # The plain loader's DataLoader-style dataset by the same rule.
    from dali_pipes import ClassificationVal, DALILoader, RunOptions

    with DALILoader(shards / "train", ClassificationVal(size=16), batch_size=4, run=RunOptions(device="cpu")) as loader:
        assert loader.dataset.classes == list(REPEATED_NAMES)
        with pytest.raises(ValueError, match=r"'crane' at labels 0, 3; 'maillot' at labels 1, 5"):
            loader.dataset.class_to_idx  # noqa: B018 - reading it is the test
    # A .txt class map naming a class twice (timm silently keeps the last line): refused, its lines named.
    (tmp_path / "map.txt").write_text("apple\n9\ncrane\n\n\nmaillot\ncrane\n10\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"class_map=.*1 class name\(s\) repeat \('crane' at lines 3, 7\)"):
        create_dataset("", root=shards, split="train", class_map=str(tmp_path / "map.txt"))


def test_labels_no_class_name_covers_pass_unchanged_and_are_named_where_they_would_be_renumbered(tmp_path):
    from dali_pipes.dropin.timm_classes import Relabel
    from dali_pipes.dropin.timm_train import create_dataset

    # ImageNet's TFRecords number their 1000 classes 1..1000 beside a 1000-line classes file: here 1..7 and 7 names.
    shifted = [label + 1 for label in PACKED_LABELS]
    shards = _convert_packed("dataset", tmp_path, shifted, PACKED_NAMES)
    dataset = create_dataset("", root=shards, split="train")
    assert _eval_labels(dataset) == shifted  # not renumbered: label 7 passes as stored, as the data numbers it
    # With a class map each label needs a name; label 7 has none. Said naming the label and the dataset, whether
    # or not the map moves the other labels (an identity map too), and before any lookup could go out of range.
    for class_map in (
        {name: i for i, name in enumerate(PACKED_NAMES)},
        {name: 6 - i for i, name in enumerate(PACKED_NAMES)},
    ):
        mapped = create_dataset("", root=shards, split="train", class_map=class_map)
        with pytest.raises(
            ValueError, match=rf"{shards / 'train'}: a sample has label 7, but the dataset names 7 classes"
        ):
            _eval_labels(mapped)
    # A negative label would wrap around to the table's last entry without a word: it is named too.
    relabel = Relabel((2, 0, 1), dataset="somewhere")
    assert relabel(None, torch.tensor([0, 1, 2]))[1].tolist() == [2, 0, 1]
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=rf"somewhere: a sample has label {bad}, but the dataset names 3 classes"):
            relabel(None, torch.tensor([0, bad, 1], dtype=torch.int32))
    assert relabel(None, torch.tensor([], dtype=torch.int64))[1].numel() == 0


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
