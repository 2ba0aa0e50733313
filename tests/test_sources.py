"""Input sources and image checks, on the real photos of ``dali_pipes/sample_data`` and on files made in ``tmp_path``."""

from __future__ import annotations

import importlib
import io
import json
import pickle
import shutil
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image

from converters.base import ConversionError, ImageOptions, SampleError
from converters.images import check_image, load_image_file, prepare_image
from converters.sources import (
    PACKED_SOURCE_MODULES,
    SOURCES,
    ArraysSource,
    CocoSource,
    ImageFolderSource,
    ListFileSource,
    LmdbSource,
    ParquetSource,
    SegmentationSource,
    TFRecordSource,
    WebDatasetSource,
)


@pytest.fixture(scope="module")
def photos(imagenet_mini: Path) -> list[Path]:
    """The ImageNet-mini JPEGs, sorted by path."""
    return sorted(imagenet_mini.glob("*/*.jpg"))


@pytest.fixture(scope="module")
def rgba_png(coco_mini: Path) -> Path:
    """One of the RGBA PNGs among coco-mini's JPEGs."""
    return coco_mini / "images" / "bicycle-161524_1280.png"


def _jpeg(width: int, height: int, **save) -> bytes:
    rng = np.random.default_rng(width * 7 + height)
    # Smooth content with an edge: realistic enough that JPEG sizes and decoding behave normally.
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x > width // 2) * 200], axis=-1).astype(np.uint8)
    pixels = np.clip(pixels + rng.integers(0, 8, pixels.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90, **save)
    return out.getvalue()


def _decoded(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return im.copy()


def test_registry_names_every_source():
    assert SOURCES == {
        "imagefolder": ImageFolderSource,
        "list": ListFileSource,
        "coco": CocoSource,
        "arrays": ArraysSource,
        "webdataset": WebDatasetSource,
        "tfrecord": TFRecordSource,
        "lmdb": LmdbSource,
        "parquet": ParquetSource,
        "segmentation": SegmentationSource,
    }
    assert all(cls.kind == kind for kind, cls in SOURCES.items())
    # Each packed source's module declares its CLI arguments; the CLI registers it under its kind.
    from dali_pipes.cli import build_parser

    for name in PACKED_SOURCE_MODULES:
        kind = importlib.import_module(name).KIND
        assert kind in SOURCES
        assert build_parser().parse_args(["convert", kind, "in", "out"]).source_from_args is not None


# -- imagefolder ------------------------------------------------------------------------------------


def test_imagefolder_reads_imagenet_mini(imagenet_mini, photos):
    source = ImageFolderSource(imagenet_mini)
    items = source.items()
    expected_classes = sorted(p.name for p in imagenet_mini.iterdir() if p.is_dir())
    assert len(items) == len(photos) == 47
    assert source.classes() == expected_classes
    assert list(source.fields()) == ["image", "label", "key"]
    assert source.describe() == {
        "kind": "imagefolder",
        "root": str(imagenet_mini),
        "image_options": {"max_size": None, "quality": 90},
    }
    keys = []
    for item in items:
        sample = source.load(item)
        rel = sample["key"].decode()
        keys.append(rel)
        path = imagenet_mini / rel
        assert item.size == path.stat().st_size
        assert sample["image"] == path.read_bytes()
        assert sample["label"].dtype == np.int64 and sample["label"].shape == ()
        assert expected_classes[int(sample["label"])] == rel.split("/")[0]
    # Class by class, sorted inside each class.
    assert keys == sorted(keys, key=lambda k: (expected_classes.index(k.split("/")[0]), k))
    assert sorted(keys) == sorted(p.relative_to(imagenet_mini).as_posix() for p in photos)


def test_imagefolder_skips_hidden_files_lists_others_and_keeps_an_allowed_empty_class_index(
    tmp_path, photos, rgba_png, caplog
):
    photo, png = photos[0], rgba_png
    root = tmp_path / "train"
    (root / "b_cat").mkdir(parents=True)
    (root / "a_empty").mkdir()
    (root / "c_dog" / "sub").mkdir(parents=True)
    (root / ".cache").mkdir()
    shutil.copy(photo, root / "b_cat" / "X.JPG")
    shutil.copy(photo, root / "b_cat" / ".hidden.jpg")
    (root / "b_cat" / "notes.txt").write_text("not an image")
    shutil.copy(png, root / "c_dog" / "sub" / "y.png")
    shutil.copy(photo, root / ".cache" / "z.jpg")
    (root / "loose.jpg").write_bytes(photo.read_bytes())

    with pytest.raises(ConversionError, match="class folder 'a_empty' holds no files, yet it would take label 0"):
        ImageFolderSource(root).items()
    source = ImageFolderSource(root, allow_empty_classes=True)
    with caplog.at_level("WARNING", logger="converters.sources.imagefolder"):
        items = source.items()
    assert source.classes() == ["a_empty", "b_cat", "c_dog"]
    assert "class folder 'a_empty' holds no files; its label 0 stays reserved" in caplog.text
    assert "1 file(s) directly in the root belong to no class and are not converted: loose.jpg" in caplog.text
    samples, refused = [], {}
    for item in items:
        try:
            samples.append(source.load(item))
        except SampleError as exc:
            refused[Path(exc.name).name] = exc.reason
    assert [(s["key"].decode(), int(s["label"])) for s in samples] == [("b_cat/X.JPG", 1), ("c_dog/sub/y.png", 2)]
    assert samples[1]["image"] == png.read_bytes()
    # Not an image: an input all the same, left out with its reason rather than passed over.
    assert list(refused) == ["notes.txt"] and refused["notes.txt"].startswith("not an image file")


def test_imagefolder_refuses_missing_or_empty_input(tmp_path):
    with pytest.raises(ConversionError, match="no such folder") as exc:
        ImageFolderSource(tmp_path / "nope").items()
    assert str(tmp_path / "nope") in str(exc.value)
    with pytest.raises(ConversionError, match="no class folders"):
        ImageFolderSource(tmp_path).items()
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / ".DS_Store").write_text("x")
    with pytest.raises(ConversionError, match="class folders hold no files"):
        ImageFolderSource(tmp_path).items()


def test_imagefolder_reports_bad_files_as_sample_errors(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "text.jpg").write_text("hello, I am not a JPEG")
    (tmp_path / "a" / "cut.jpg").write_bytes(_jpeg(64, 48)[:700])
    source = ImageFolderSource(tmp_path)
    reasons = {}
    for item in source.items():
        with pytest.raises(SampleError) as exc:
            source.load(item)
        assert exc.value.name == item.name == str(tmp_path / "a" / Path(item.name).name)
        reasons[Path(item.name).name] = exc.value.reason
    assert reasons["text.jpg"].startswith("not an image file")
    assert reasons["cut.jpg"].startswith("truncated JPEG")


def test_sources_pickle_and_load_in_another_process(tmp_path, imagenet_mini):
    source = ImageFolderSource(imagenet_mini, ImageOptions(max_size=64))
    items = source.items()[:3]
    clone = pickle.loads(pickle.dumps(source))
    assert clone.describe() == source.describe()
    with ProcessPoolExecutor(max_workers=1) as pool:
        remote = list(pool.map(source.load, items))
    for item, sample in zip(items, remote):
        local = source.load(item)
        assert sample["image"] == local["image"] and sample["key"] == local["key"]
        assert max(_decoded(sample["image"]).size) == 64


# -- list files -------------------------------------------------------------------------------------


def test_list_file_with_keys_labels_relative_and_absolute_paths(tmp_path, photos):
    photos = photos[:3]
    (tmp_path / "imgs").mkdir()
    shutil.copy(photos[0], tmp_path / "imgs" / "a.jpg")
    shutil.copy(photos[1], tmp_path / "imgs" / "b.jpg")
    listing = tmp_path / "train.scp"
    listing.write_text(f"# key path label\n\nutt1 imgs/a.jpg 3\n  utt2\timgs/b.jpg   -1  \nutt3 {photos[2]} 7\n")
    source = ListFileSource(listing)
    assert list(source.fields()) == ["image", "label", "key"]
    items = source.items()
    assert [i.name for i in items] == [
        str(tmp_path / "imgs" / "a.jpg"),
        str(tmp_path / "imgs" / "b.jpg"),
        str(photos[2]),
    ]
    samples = [source.load(i) for i in items]
    assert [s["key"] for s in samples] == [b"utt1", b"utt2", b"utt3"]
    assert [int(s["label"]) for s in samples] == [3, -1, 7]
    assert [s["image"] for s in samples] == [p.read_bytes() for p in photos]
    assert [i.size for i in items] == [p.stat().st_size for p in photos]
    assert source.describe()["list_file"] == str(listing)


def test_list_file_without_labels_has_no_label_field(tmp_path, photos):
    photo = photos[0]
    listing = tmp_path / "list.txt"
    listing.write_text(f"first {photo}\nsecond {photo}\n")
    source = ListFileSource(listing)
    assert list(source.fields()) == ["image", "key"]
    samples = [source.load(i) for i in source.items()]
    assert [sorted(s) for s in samples] == [["image", "key"]] * 2
    assert samples[1]["key"] == b"second"


@pytest.mark.parametrize("labelled", [True, False])
def test_a_list_source_sent_to_a_worker_does_not_parse_the_list_again(tmp_path, photos, labelled):
    """Every shard task asks the source for its fields; a million-line list must not be re-read per shard."""
    import pickle

    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"k{i} {photos[0]}{' 3' if labelled else ''}\n" for i in range(3)))
    source = ListFileSource(listing)
    source.items()
    fields = source.fields()
    listing.unlink()  # a worker that parsed the list again would fail now
    assert pickle.loads(pickle.dumps(source)).fields() == fields
    assert ("label" in fields) == labelled


def test_two_column_path_label_list_of_imagenet_mini(imagenet_mini):
    listing = imagenet_mini / "image_list.txt"
    lines = [line.split() for line in listing.read_text().splitlines() if line.strip()]
    source = ListFileSource(listing)
    assert list(source.fields()) == ["image", "label", "key"]
    items = source.items()
    assert len(items) == len(lines) == 47
    for item, (path, label) in zip(items, lines):
        sample = source.load(item)
        assert sample["key"] == path.encode()
        assert int(sample["label"]) == int(label)
        assert sample["image"] == (imagenet_mini / path).read_bytes()


def test_two_column_rule_and_explicit_columns(tmp_path, photos):
    photo = photos[0]
    shutil.copy(photo, tmp_path / "123")  # a file whose name is an integer
    listing = tmp_path / "list.txt"
    listing.write_text("k1 123\nk2 123\n")
    assert "label" in ListFileSource(listing).fields()  # read as PATH LABEL by the rule ...
    source = ListFileSource(listing, columns="key path")  # ... unless told otherwise
    assert list(source.fields()) == ["image", "key"]
    assert source.load(source.items()[0])["image"] == photo.read_bytes()

    listing.write_text(f"{photo} 4\n{photo} n01440764\n")
    with pytest.raises(ConversionError) as exc:
        ListFileSource(listing).fields()
    assert f"{listing}:2" in str(exc.value) and "line 1" in str(exc.value)

    with pytest.raises(ConversionError, match="unknown list columns"):
        ListFileSource(listing, columns="label path")


@pytest.mark.parametrize(
    "text, where, what",
    [
        ("a x.jpg 1\nb y.jpg\n", ":2", "columns"),
        ("a x.jpg 1\nb y.jpg one\n", ":2", "not an integer"),
        ("a x.jpg 1 extra\n", ":1", "4 columns"),
        ("a x.jpg 1\n# c\na y.jpg 2\n", ":3", "repeats line 1"),
        ("# only a comment\n\n", "", "no entries"),
    ],
)
def test_list_file_malformed_lines_name_file_and_line(tmp_path, text, where, what):
    listing = tmp_path / "bad.scp"
    listing.write_text(text)
    with pytest.raises(ConversionError) as exc:
        ListFileSource(listing).items()
    assert f"{listing}{where}" in str(exc.value)
    assert what in str(exc.value)


def test_list_file_missing_inputs(tmp_path):
    with pytest.raises(ConversionError, match="no such list file"):
        ListFileSource(tmp_path / "missing.scp").items()
    listing = tmp_path / "list.scp"
    listing.write_text("a nowhere/x.jpg\nb nowhere/y.jpg\n")
    with pytest.raises(ConversionError, match="none of its 2 paths exists"):
        ListFileSource(listing).items()


def test_list_file_missing_image_is_a_sample_error(tmp_path, photos):
    listing = tmp_path / "list.scp"
    listing.write_text(f"a {photos[0]}\nb gone.jpg\n")
    source = ListFileSource(listing)
    items = source.items()
    assert items[1].size == 0
    with pytest.raises(SampleError, match="file not found") as exc:
        source.load(items[1])
    assert exc.value.name == str(tmp_path / "gone.jpg")


# -- COCO ---------------------------------------------------------------------------------------------


def _coco_json(coco_mini: Path) -> dict:
    return json.loads((coco_mini / "instances.json").read_text())


def test_coco_mini_boxes_categories_and_bytes(coco_mini):
    data = _coco_json(coco_mini)
    per_image = defaultdict(list)
    for ann in data["annotations"]:
        per_image[ann["image_id"]].append(ann)
    images = sorted(data["images"], key=lambda im: im["id"])

    source = CocoSource(coco_mini / "images", coco_mini / "instances.json")
    items = source.items()
    assert len(items) == len(images) == 61
    categories = sorted(data["categories"], key=lambda c: c["id"])
    assert source.classes() == [c["name"] for c in categories]
    assert source.extra() == {
        "categories": [{"id": c["id"], "name": c["name"], "supercategory": c["supercategory"]} for c in categories]
    }
    fields = source.fields()
    assert fields["boxes"].shape == (-1, 4) and fields["boxes"].dtype == "float32"
    pngs = 0
    for item, image in zip(items, images):
        sample = source.load(item)
        anns = per_image[image["id"]]
        assert int(sample["image_id"]) == image["id"]
        assert sample["key"].decode() == image["file_name"]
        assert sample["image_size"].tolist() == [image["height"], image["width"]]
        assert sample["boxes"].dtype == np.float32 and sample["boxes"].shape == (len(anns), 4)
        np.testing.assert_array_equal(sample["boxes"], np.array([a["bbox"] for a in anns], np.float32))
        assert sample["category_id"].dtype == np.int64
        assert sample["category_id"].tolist() == [a["category_id"] for a in anns]
        assert sample["iscrowd"].dtype == np.uint8
        assert sample["iscrowd"].tolist() == [a["iscrowd"] for a in anns]
        path = coco_mini / "images" / image["file_name"]
        assert sample["image"] == path.read_bytes()
        pngs += path.suffix == ".png"
    assert pngs == 3


def test_coco_images_without_annotations_have_zero_boxes(tmp_path, coco_mini):
    data = _coco_json(coco_mini)
    bare = {im["id"] for im in data["images"][:5]}
    data["annotations"] = [a for a in data["annotations"] if a["image_id"] not in bare]
    data["images"].reverse()  # the JSON's order does not matter: samples follow the image ids
    (tmp_path / "instances.json").write_text(json.dumps(data))
    source = CocoSource(coco_mini / "images", tmp_path / "instances.json")
    loaded = [source.load(item) for item in source.items()]
    assert [int(s["image_id"]) for s in loaded] == sorted(im["id"] for im in data["images"])
    samples = {int(s["image_id"]): s for s in loaded}
    assert len(samples) == 61
    for image_id in bare:
        assert samples[image_id]["boxes"].shape == (0, 4)
        assert samples[image_id]["category_id"].shape == (0,)
        assert samples[image_id]["iscrowd"].shape == (0,)
    assert all(len(s["boxes"]) > 0 for i, s in samples.items() if i not in bare)


def _broken(data: dict, how: str) -> dict:
    if how == "unknown image":
        data["annotations"][3]["image_id"] = 9999
    elif how == "negative box":
        data["annotations"][3]["bbox"][2] = -5.0
    elif how == "short box":
        data["annotations"][3]["bbox"] = [1.0, 2.0, 3.0]
    elif how == "unknown category":
        data["annotations"][3]["category_id"] = 77
    elif how == "duplicate image":
        data["images"][1]["id"] = data["images"][0]["id"]
    return data


@pytest.mark.parametrize(
    "how, what",
    [
        ("unknown image", "image id 9999"),
        ("negative box", "bbox"),
        ("short box", "bbox"),
        ("unknown category", "category_id 77"),
        ("duplicate image", "appears twice"),
    ],
)
def test_coco_bad_annotations_are_refused(tmp_path, how, what, coco_mini):
    data = _broken(_coco_json(coco_mini), how)
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConversionError) as exc:
        CocoSource(coco_mini / "images", path).items()
    assert str(path) in str(exc.value) and what in str(exc.value)
    if how not in ("duplicate image",):
        assert f"id {data['annotations'][3]['id']}" in str(exc.value)


def test_coco_missing_or_malformed_inputs(tmp_path):
    (tmp_path / "images").mkdir()
    with pytest.raises(ConversionError, match="no such annotations file"):
        CocoSource(tmp_path / "images", tmp_path / "none.json").items()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConversionError, match="not valid JSON"):
        CocoSource(tmp_path / "images", tmp_path / "bad.json").items()
    (tmp_path / "ok.json").write_text(json.dumps({"images": [], "annotations": [], "categories": []}))
    with pytest.raises(ConversionError, match="'images' is empty"):
        CocoSource(tmp_path / "images", tmp_path / "ok.json").items()
    with pytest.raises(ConversionError, match="no such image folder"):
        CocoSource(tmp_path / "nowhere", tmp_path / "ok.json").items()


# -- arrays -----------------------------------------------------------------------------------------


def _rows(source: ArraysSource) -> dict[str, np.ndarray]:
    """Every sample loaded and stacked per field, checking each row's dtype and shape against the schema."""
    fields = source.fields()
    samples = [source.load(item) for item in source.items()]
    for sample in samples:
        assert list(sample) == list(fields)
        for name, value in sample.items():
            # Native byte order: the manifest's dtype names ("float32") carry none.
            assert value.dtype == np.dtype(fields[name].dtype) and value.dtype.isnative
            assert value.shape == fields[name].shape
    return {name: np.stack([s[name] for s in samples]) for name in fields}


def test_arrays_npy_parts_are_concatenated_in_order(tmp_path):
    rng = np.random.default_rng(0)
    feats = [rng.standard_normal((n, 4, 16)).astype(np.float16) for n in (3, 5)]
    targets = [rng.integers(-100, 100, (n, 16), dtype=np.int8) for n in (3, 5)]
    files = []
    for part in (0, 1):
        folder = tmp_path / f"part{part}"
        folder.mkdir()
        np.save(folder / "feats.npy", feats[part])
        np.save(folder / "targets.npy", targets[part])
        files += [folder / "feats.npy", folder / "targets.npy"]
    source = ArraysSource(files)
    fields = source.fields()
    assert list(fields) == ["feats", "targets"]
    assert (fields["feats"].dtype, fields["feats"].shape) == ("float16", (4, 16))
    assert (fields["targets"].dtype, fields["targets"].shape) == ("int8", (16,))
    items = source.items()
    assert len(items) == 8 and items[0].size == 4 * 16 * 2 + 16
    rows = _rows(source)
    np.testing.assert_array_equal(rows["feats"], np.concatenate(feats))
    np.testing.assert_array_equal(rows["targets"], np.concatenate(targets))
    assert rows["feats"].dtype == np.float16 and rows["targets"].dtype == np.int8
    assert source.describe() == {"kind": "arrays", "files": [str(f) for f in files], "fields": None}


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_arrays_npz_members_are_fields(tmp_path, save):
    rng = np.random.default_rng(1)
    audio = rng.standard_normal((6, 2, 50)).astype(np.float32)
    labels = np.arange(6, dtype=np.uint16)
    fortran = np.asfortranarray(rng.standard_normal((6, 3)))
    save(tmp_path / "a.npz", audio=audio, labels=labels, fortran=fortran)
    source = ArraysSource([tmp_path / "a.npz"])
    assert list(source.fields()) == ["audio", "labels", "fortran"]
    rows = _rows(source)
    np.testing.assert_array_equal(rows["audio"], audio)
    np.testing.assert_array_equal(rows["labels"], labels)
    np.testing.assert_array_equal(rows["fortran"], fortran)
    assert rows["labels"].dtype == np.uint16
    # Members of an uncompressed archive are mapped, not read whole into each worker.
    opened = [source._array(part) for part in source._fields_plan()["audio"]]  # noqa: SLF001
    assert isinstance(opened[0], np.memmap) == (save is np.savez)
    only = ArraysSource([tmp_path / "a.npz"], fields=["labels"])
    assert list(only.fields()) == ["labels"]
    with pytest.raises(ConversionError, match="no field named 'nope'"):
        ArraysSource([tmp_path / "a.npz"], fields=["nope"]).fields()


def test_arrays_hdf5_nested_groups_and_parts(tmp_path):
    rng = np.random.default_rng(2)
    mel = [rng.standard_normal((n, 8)).astype(">f4") for n in (4, 2)]  # big-endian on disk
    ids = [np.arange(n, dtype=np.int64) + 10 * k for k, n in enumerate((4, 2))]
    for k in (0, 1):
        with h5py.File(tmp_path / f"p{k}.h5", "w") as f:
            f.create_dataset("feats/mel", data=mel[k], chunks=(1, 8))
            f.create_dataset("id", data=ids[k])
    source = ArraysSource([tmp_path / "p0.h5", tmp_path / "p1.h5"])
    fields = source.fields()
    assert set(fields) == {"feats.mel", "id"}
    assert fields["feats.mel"].dtype == "float32" and fields["id"].shape == ()
    rows = _rows(source)
    np.testing.assert_array_equal(rows["feats.mel"], np.concatenate(mel).astype(np.float32))
    assert rows["id"].tolist() == [0, 1, 2, 3, 10, 11]
    # Open HDF5 handles stay behind when the source travels to a worker.
    clone = pickle.loads(pickle.dumps(source))
    np.testing.assert_array_equal(clone.load(source.items()[5])["feats.mel"], mel[1][1])


def test_arrays_mismatches_and_refusals(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((5, 3), np.float32))
    np.save(tmp_path / "y.npy", np.zeros((4,), np.int64))
    with pytest.raises(ConversionError) as exc:
        ArraysSource([tmp_path / "x.npy", tmp_path / "y.npy"]).items()
    assert "'x': 5" in str(exc.value) and "'y': 4" in str(exc.value)

    (tmp_path / "b").mkdir()
    np.save(tmp_path / "b" / "x.npy", np.zeros((2, 3), np.float64))
    with pytest.raises(ConversionError, match="field 'x' is float32 .* float64"):
        ArraysSource([tmp_path / "x.npy", tmp_path / "b" / "x.npy"]).fields()

    np.save(tmp_path / "obj.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ConversionError, match="obj.npy: dtype object cannot be stored"):
        ArraysSource([tmp_path / "obj.npy"]).fields()
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f.create_dataset("names", data=["a", "bb"], dtype=h5py.string_dtype())
    with pytest.raises(ConversionError, match="names: dtype object"):
        ArraysSource([tmp_path / "s.h5"]).fields()
    np.save(tmp_path / "scalar.npy", np.float32(3))
    with pytest.raises(ConversionError, match="no sample axis"):
        ArraysSource([tmp_path / "scalar.npy"]).fields()
    with pytest.raises(ConversionError, match="no such file"):
        ArraysSource([tmp_path / "missing.npy"]).fields()
    (tmp_path / "t.csv").write_text("1,2\n")
    with pytest.raises(ConversionError, match="unknown array file type"):
        ArraysSource([tmp_path / "t.csv"]).fields()


def test_arrays_planning_reads_headers_only(tmp_path):
    # A header promising 4 GB over a file of a few bytes: planning must not touch the data.
    path = tmp_path / "huge.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (10_000, 100_000)})
        f.write(b"\0" * 16)
    source = ArraysSource([path])
    items = source.items()
    assert len(items) == 10_000 and items[0].size == 400_000
    assert source.fields()["huge"].shape == (100_000,)
    with pytest.raises((SampleError, ValueError, OSError)):
        source.load(items[-1])


# -- image checks -----------------------------------------------------------------------------------


def test_check_image_describes_real_photos(photos, rgba_png):
    for path in (photos[0], rgba_png):
        data = path.read_bytes()
        info = check_image(data, str(path))
        with Image.open(path) as im:
            assert (info.format, info.width, info.height, info.mode) == (im.format, *im.size, im.mode)


@pytest.mark.parametrize("cut", [0.5, 0.9, 0.999])
def test_truncated_jpeg_is_refused(cut, photos):
    data = photos[0].read_bytes()
    with pytest.raises(SampleError) as exc:
        check_image(data[: int(len(data) * cut)], "cut.jpg")
    assert exc.value.name == "cut.jpg" and exc.value.reason.startswith("truncated JPEG")
    # The resize path decodes at reduced scale: it must still see the truncation.
    with pytest.raises(SampleError, match="truncated JPEG"):
        prepare_image(data[: int(len(data) * cut)], "cut.jpg", ImageOptions(max_size=100))


def test_truncated_png_is_refused(rgba_png):
    data = (rgba_png).read_bytes()
    with pytest.raises(SampleError, match="truncated PNG"):
        check_image(data[: len(data) // 2], "cut.png")


def test_empty_text_and_unsupported_files_are_refused(tmp_path):
    (tmp_path / "zero.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("this is a caption, not a picture\n")
    gif = io.BytesIO()
    Image.new("RGB", (8, 8)).save(gif, format="GIF")
    (tmp_path / "anim.jpg").write_bytes(gif.getvalue())
    reasons = {}
    for name in ("zero.jpg", "text.jpg", "anim.jpg", "missing.jpg"):
        with pytest.raises(SampleError) as exc:
            load_image_file(tmp_path / name, name, ImageOptions())
        reasons[name] = exc.value.reason
    assert reasons["zero.jpg"] == "empty file (0 bytes)"
    assert reasons["text.jpg"].startswith("not an image file (")
    assert reasons["anim.jpg"].startswith("a GIF file, not a format DALI's decoder reads")
    assert reasons["missing.jpg"] == "file not found"


def test_decompression_bomb_guard():
    data = _jpeg(200, 100)
    assert check_image(data, "ok.jpg").width == 200
    with pytest.raises(SampleError, match="200x100 pixels, more than the limit of 10000"):
        check_image(data, "bomb.jpg", max_pixels=10_000)


def test_prepare_image_keeps_small_images_byte_identical():
    data = _jpeg(120, 80)
    for options in (ImageOptions(), ImageOptions(max_size=120), ImageOptions(max_size=4000, quality=50)):
        assert prepare_image(data, "small.jpg", options) is data


@pytest.mark.parametrize("max_size", [256, 97])
def test_prepare_image_resizes_large_photos_deterministically(max_size, photos):
    path = photos[4]
    data = path.read_bytes()
    with Image.open(path) as im:
        width, height = im.size
    out = prepare_image(data, str(path), ImageOptions(max_size=max_size, quality=85))
    assert out == prepare_image(data, str(path), ImageOptions(max_size=max_size, quality=85))
    assert out != prepare_image(data, str(path), ImageOptions(max_size=max_size, quality=60))
    image = _decoded(out)
    assert image.format is None or image.format == "JPEG"
    assert Image.open(io.BytesIO(out)).format == "JPEG" and image.mode == "RGB"
    assert max(image.size) == max_size
    assert abs(image.size[0] / image.size[1] - width / height) < 2 / min(image.size)
    # The pixels are the photo's, not just any image of the right size.
    reference = np.asarray(_decoded(data).convert("RGB").resize(image.size, Image.Resampling.BILINEAR), np.float32)
    assert np.abs(np.asarray(image, np.float32) - reference).mean() < 12


def test_prepare_image_turns_rgba_png_into_rgb_jpeg(rgba_png):
    path = rgba_png
    data = path.read_bytes()
    out = prepare_image(data, str(path), ImageOptions(max_size=300))
    with Image.open(io.BytesIO(out)) as im:
        assert (im.format, im.mode, max(im.size)) == ("JPEG", "RGB", 300)
    assert prepare_image(data, str(path), ImageOptions(max_size=2000)) is data


def test_prepare_image_applies_exif_orientation():
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: viewers rotate it by 90 degrees
    data = _jpeg(400, 200, exif=exif.tobytes())
    out = _decoded(prepare_image(data, "sideways.jpg", ImageOptions(max_size=100)))
    assert out.size == (50, 100)


def test_a_list_line_that_is_not_utf8_is_named_by_its_number(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"x")
    (tmp_path / "list.txt").write_bytes(b"k1 a.jpg 0\n# a comment\nk\xe9 a.jpg 1\n")
    with pytest.raises(ConversionError, match=r"list.txt:3: not UTF-8 text"):
        ListFileSource(tmp_path / "list.txt").fields()
