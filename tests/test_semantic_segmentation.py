"""Label maps: ``convert segmentation`` and the SemanticSegmentation specs.

The label maps are real: coco-mini's annotations rasterised by pycocotools into one class
index per pixel (crowd regions as the ignore value), saved by PIL as VOC-style palette
PNGs, grey 8-bit PNGs and 16-bit PNGs. The geometry check uses images and maps whose
pixels encode their own source coordinates.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from converters.base import ImageOptions
from converters.runner import convert
from converters.sources import SegmentationSource
from dali_pipes import BatchFormat, DALILoader, RunOptions, open_store
from dali_pipes.cli import main as cli
from dali_pipes.pipelines import (
    InstanceSegmentation,
    InstanceSegmentationVal,
    SemanticSegmentation,
    SemanticSegmentationVal,
)

mask_api = pytest.importorskip("pycocotools.mask", reason="pycocotools is not installed (pip install -e '.[coco]')")

IGNORE = 255
MODES = ("P", "L", "I;16")


def class_map(data: dict, image: dict, classes: list[int]) -> np.ndarray:
    """One class index per pixel (0 background, k + 1 for the k-th category id), crowd as IGNORE."""
    h, w = image["height"], image["width"]
    out = np.zeros((h, w), dtype=np.uint16)
    for ann in data["annotations"]:
        if ann["image_id"] != image["id"] or len(ann["segmentation"][0]) < 6:
            continue
        m = mask_api.decode(mask_api.merge(mask_api.frPyObjects(ann["segmentation"], h, w))).astype(bool)
        out[m] = IGNORE if ann["iscrowd"] else classes.index(ann["category_id"]) + 1
    return out


def save_map(labels: np.ndarray, path: Path, mode: str) -> None:
    if mode == "P":
        image = Image.fromarray(labels.astype(np.uint8), mode="P")
        image.putpalette([v for i in range(256) for v in ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256)])
    elif mode == "L":
        image = Image.fromarray(labels.astype(np.uint8), mode="L")
    else:
        image = Image.fromarray(labels.astype(np.uint16))
    image.save(path)


@pytest.fixture(scope="module")
def voc(coco_mini: Path, tmp_path_factory) -> tuple[Path, dict[str, np.ndarray], Path]:
    """``images/`` (coco-mini's), ``masks/`` (real label maps in three PNG kinds) and a classes file."""
    data = json.loads((coco_mini / "instances.json").read_text())
    classes = sorted(c["id"] for c in data["categories"])
    root = tmp_path_factory.mktemp("voc")
    (root / "masks").mkdir()
    maps = {}
    for i, image in enumerate(data["images"]):
        labels = class_map(data, image, classes)
        stem = Path(image["file_name"]).stem
        save_map(labels, root / "masks" / f"{stem}.png", MODES[i % 3])
        maps[stem] = labels
    (root / "classes.txt").write_text("\n".join(["background"] + [f"c{c}" for c in classes]) + "\n")
    return root, maps, coco_mini / "images"


@pytest.fixture(scope="module")
def voc_lmdb(voc, tmp_path_factory) -> Path:
    root, _, images = voc
    out = tmp_path_factory.mktemp("voc-lmdb") / "lmdb"
    source = SegmentationSource(images, root / "masks", classes_file=root / "classes.txt")
    convert(source, out, format="lmdb", workers=1, progress=False)
    return out


def decoded(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png))).astype(np.int64)


def test_label_maps_are_stored_losslessly_whatever_their_png_kind(voc, voc_lmdb):
    _, maps, _ = voc
    store = open_store(voc_lmdb)
    assert len(store) == 61 and set(store.fields) == {"image", "mask", "key"}
    assert store.manifest.extra == {"ignore_index": IGNORE, "num_classes": 18}
    assert store.manifest.classes[0] == "background"
    for i in range(len(store)):
        sample = store[i]
        np.testing.assert_array_equal(decoded(sample["mask"]), maps[sample["key"].decode()])


def test_bad_label_maps_are_listed_and_the_rest_kept(voc, tmp_path):
    root, maps, images = voc
    masks = tmp_path / "masks"
    shutil.copytree(root / "masks", masks)
    stems = sorted(maps)
    (masks / f"{stems[0]}.png").unlink()  # an image without a label map
    Image.fromarray(np.zeros((10, 12), np.uint8)).save(masks / f"{stems[1]}.png")  # wrong size
    too_high = maps[stems[2]].copy()
    too_high[0, 0] = 40  # 18 classes, ignore 255
    save_map(too_high, masks / f"{stems[2]}.png", "L")
    Image.new("RGB", Image.open(masks / f"{stems[3]}.png").size).save(masks / f"{stems[3]}.png")  # colours
    out = tmp_path / "out"
    source = SegmentationSource(images, masks, classes_file=root / "classes.txt")
    convert(source, out, format="tfrecord", workers=1, progress=False)
    errors = {Path(e["input"]).stem: e["reason"] for e in map(json.loads, (out / "errors.jsonl").open())}
    assert set(errors) == set(stems[:4])
    assert "no label map" in errors[stems[0]]
    assert "is 12x10, the image is" in errors[stems[1]]
    assert "value(s) [40] at or above the class count 18" in errors[stems[2]]
    assert "RGB image (colours, not class indices)" in errors[stems[3]]
    assert len(open_store(out)) == 61 - 4


def test_cli_pairs_file_and_folders_give_the_same_samples(voc, voc_lmdb, tmp_path):
    root, maps, images = voc
    names = sorted(p.name for p in images.iterdir())
    # Blank and '#' lines between the pairs, relative paths, and shards of 7 read by 2 workers: each task reads
    # its own lines from a byte offset in the middle of the file.
    masks = os.path.relpath(root / "masks", tmp_path)
    ends = ["\n\n# next\n" if i % 5 == 0 else "\n" for i in range(len(names))]
    lines = [f"{images / n} {masks}/{Path(n).stem}.png{end}" for n, end in zip(names, ends)]
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("# image mask\n" + "".join(lines))
    out = tmp_path / "pairs"
    argv = ["convert", "segmentation", "--pairs", str(pairs), str(out), "--samples-per-shard", "7", "--workers", "2"]
    assert cli([*argv, "--no-progress"]) == 0
    assert len(open_store(out).manifest.shards) == 9
    a, b = open_store(out), open_store(voc_lmdb)
    assert len(a) == len(b) == 61
    got = {a[i]["image"]: decoded(a[i]["mask"]) for i in range(61)}
    for i in range(61):
        np.testing.assert_array_equal(got[b[i]["image"]], decoded(b[i]["mask"]))


def coordinate_data(root: Path, count: int = 6, size: tuple[int, int] = (120, 160)) -> tuple[Path, Path]:
    """PNG images with R = x, G = y and 16-bit maps with value y * width + x (no classes file, so no value check)."""
    h, w = size
    (root / "img").mkdir(parents=True)
    (root / "map").mkdir()
    ys, xs = np.mgrid[0:h, 0:w]
    for i in range(count):
        sub = slice(0, h - 8 * i)  # several sizes in one batch
        Image.fromarray(np.stack([xs, ys, np.zeros_like(xs)], -1).astype(np.uint8)[sub]).save(root / "img" / f"{i}.png")
        Image.fromarray((ys * w + xs).astype(np.uint16)[sub]).save(root / "map" / f"{i}.png")
    return root / "img", root / "map"


def interior(where: np.ndarray, radius: int = 1) -> np.ndarray:
    """``where`` is true in the whole square of pixels up to ``radius`` away (wrapping at the edges: stricter)."""
    out = where.copy()
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            out &= np.roll(where, (dy, dx), axis=(1, 2))
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_image_and_map_point_back_to_the_same_source_pixel(tmp_path, device):
    images, maps = coordinate_data(tmp_path / "coords")
    out = tmp_path / "coords-lmdb"
    convert(SegmentationSource(images, maps, ignore_index=65535), out, format="lmdb", workers=1, progress=False)
    spec = SemanticSegmentation(
        size=(96, 128), scale=(0.3, 1.8), ratio=(0.6, 1.6), flip=0.5, jitter=None, dtype="uint8", layout="NHWC",
        ignore_index=65535,
    )  # fmt: skip
    flipped = padded = checked = 0
    run = RunOptions(device=device, py_num_workers=0)
    with DALILoader(out, spec, batch_size=6, shuffle=False, seed=3, run=run) as loader:
        for epoch in range(4):
            loader.set_epoch(epoch)
            for batch in loader:
                assert batch["mask"].is_cuda == (device == "gpu")
                image, mask = batch["image"].cpu().numpy().astype(np.int64), batch["mask"].cpu().numpy()
                assert image.shape == (6, 96, 128, 3) and mask.shape == (6, 96, 128) and mask.dtype == np.int64
                valid = mask != 65535
                # Pixels next to the padding blend with it in the image's (antialiased) linear resize: left out.
                inner, outer = interior(valid), interior(~valid, radius=2)
                sx, sy = mask % 160, mask // 160
                assert np.abs(image[..., 0] - sx)[inner].max() <= 1
                assert np.abs(image[..., 1] - sy)[inner].max() <= 1
                assert (image[outer] == 0).all()
                padded += int((~valid).any(axis=(1, 2)).sum())
                flipped += int((np.diff(sx, axis=2)[inner[:, :, 1:]] < 0).sum() > 0)
                checked += int(inner.sum())
    assert padded > 0 and flipped > 0 and checked > 100_000


def nearest(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Nearest source index of each output pixel (``floor((i + 0.5) * in / out)``) and where that is a tie."""
    centre = (np.arange(size_out) + 0.5) * size_in / size_out
    return np.floor(centre).astype(int), np.abs(centre - np.round(centre)) < 1e-3


def assert_nearest(resized: np.ndarray, labels: np.ndarray) -> None:
    """``resized`` is ``labels`` resized with nearest neighbour (either neighbour at an exact tie)."""
    (ys, y_ties), (xs, x_ties) = nearest(labels.shape[0], resized.shape[0]), nearest(labels.shape[1], resized.shape[1])
    exact = resized == labels[ys][:, xs]
    assert exact[~(y_ties[:, None] | x_ties[None, :])].all()
    either = [labels[a][:, b] for a in (ys, np.maximum(ys - y_ties, 0)) for b in (xs, np.maximum(xs - x_ties, 0))]
    assert np.any([resized == other for other in either], axis=0).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("size", [(64, 80), 48], ids=["fixed", "shorter-side"])
def test_validation_resizes_map_like_image_and_pads_with_ignore(voc, voc_lmdb, size, device):
    _, maps, _ = voc
    spec = SemanticSegmentationVal(size=size)
    store = open_store(voc_lmdb)
    with DALILoader(
        voc_lmdb, spec, batch_size=8, shuffle=False, batch_format=BatchFormat(with_index=True),
        run=RunOptions(device=device, py_num_workers=0),
    ) as ld:  # fmt: skip
        for batch in ld:
            for row in range(len(batch["index"])):
                labels = maps[store[int(batch["index"][row])]["key"].decode()]
                mask = batch["mask"][row].cpu().numpy()
                h, w = batch["image_size"][row].tolist() if "image_size" in batch else size
                assert_nearest(mask[:h, :w], labels)
                assert (mask[h:] == IGNORE).all() and (mask[:, w:] == IGNORE).all()
                if isinstance(size, int):
                    assert min(h, w) == size


def test_show_draws_the_label_maps(voc_lmdb, tmp_path):
    from dali_pipes.cli.show import show

    path = show(voc_lmdb, tmp_path / "s.png", pipeline="semantic-val", num=4, size=64, device="cpu")
    grid = np.asarray(Image.open(path))
    assert grid.shape == (64 + 14, 4 * 64, 3)


def test_bench_and_doctor_cover_label_maps(voc_lmdb):
    from dali_pipes.bench.doctor import run_doctor
    from dali_pipes.bench.suites import run_bench

    report = run_bench(voc_lmdb, suite="masks", batch_size=8, quick=True, progress=False)
    assert "SemanticSegmentation vs its image half" in report.title
    assert all(row.images_per_s > 0 for row in report.rows if row.params["device"] == "cpu")
    doctor = run_doctor(voc_lmdb, model="tiny", batch_size=8, steps=3, quick=True, progress=False)
    assert doctor.context["augmentation"]["spec"] == "SemanticSegmentation"
    assert doctor.combined.error is None and doctor.combined.images_per_s > 0


@pytest.mark.parametrize(
    "spec",
    [
        InstanceSegmentation(size=64, max_size=96, category_ids=(1, 2)),
        InstanceSegmentationVal(size=(64, 96), category_ids=(1, 2)),
        SemanticSegmentation(size=64),
        SemanticSegmentationVal(size=64),
    ],
    ids=lambda spec: type(spec).__name__,
)
def test_every_operator_of_the_gpu_graphs_has_an_implementation_for_its_device(spec):
    # No GPU needed: the graph is defined, not built; DALI's registry says which device each operator runs on.
    from nvidia.dali import Pipeline, backend, fn

    pipe = Pipeline(batch_size=2, num_threads=1, device_id=0)
    with pipe:
        outputs = spec.build({name: fn.external_source(name=name) for name in spec.required_fields}, device="gpu")
    assert all(node.device == "gpu" for node in outputs.values())
    registered = {"gpu": set(backend.RegisteredGPUOps()), "mixed": set(backend.RegisteredMixedOps())}
    registered["cpu"] = set(backend.RegisteredCPUOps()) | {"ExternalSource"}
    ops, todo = {}, list(outputs.values())
    while todo:
        source = todo.pop().source
        if source is not None and id(source) not in ops:
            name = getattr(source._op, "schema_name", None) or type(source._op).__name__  # ExternalSource
            ops[id(source)] = (name, source._op.device)
            todo += list(source.inputs)
    missing = [(name, device) for name, device in ops.values() if name not in registered[device]]
    assert not missing
    on_gpu = {name for name, device in ops.values() if device == "gpu"}
    assert {"Resize", "Cast"} <= on_gpu, on_gpu  # the map or masks are resized there, not on the CPU


def test_max_size_resizes_the_label_map_with_its_image(voc, tmp_path):
    root, maps, images = voc
    out = tmp_path / "small"
    source = SegmentationSource(images, root / "masks", image_options=ImageOptions(max_size=200))
    convert(source, out, format="lmdb", workers=1, progress=False)
    store = open_store(out)
    for i in range(0, len(store), 7):
        sample = store[i]
        image = Image.open(io.BytesIO(sample["image"]))
        labels = maps[sample["key"].decode()]
        assert max(image.size) == 200
        stored = decoded(sample["mask"])
        assert stored.shape == image.size[::-1]
        assert_nearest(stored, labels)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SemanticSegmentation(scale=(0.5, 0.2)), "SemanticSegmentation.scale"),
        (lambda: SemanticSegmentation(ratio=(0, 1)), "SemanticSegmentation.ratio"),
        (lambda: SemanticSegmentation(flip=-1), "SemanticSegmentation.flip"),
        (lambda: SemanticSegmentation(size=(64, 0)), "SemanticSegmentation.size"),
        (lambda: SemanticSegmentationVal(ignore_index=70000), "SemanticSegmentationVal.ignore_index"),
        (lambda: SegmentationSource("a"), "either an image folder and a label-map folder, or --pairs"),
        (lambda: SegmentationSource("s3://b/images", "s3://b/masks"), "s3://b/images: segmentation reads local"),
        (lambda: SegmentationSource(pairs="gs://b/pairs.txt?sig=abcdefgh"), r"pairs.txt\?\*\*\*: .* copy them"),
    ],
)
def test_bad_arguments_name_the_argument(make, match):
    from converters.base import ConversionError

    with pytest.raises((ValueError, ConversionError), match=match):
        make()
