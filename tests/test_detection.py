"""The COCO-style detection specs through ``DALILoader`` on DALI's CPU backend.

Data: the real coco-mini photos and annotations (``conftest.coco_mini``),
converted with ``convert coco``; a tiny COCO JSON over some of those photos for
the edge cases (all-crowd, boxes outside the image, no annotations,
non-contiguous category ids); and synthetic PNGs of coloured rectangles, whose
pixels say where each box must be. References come from the JSON files
directly, not from the converted dataset.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from collections import Counter
from dataclasses import FrozenInstanceError
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from converters.runner import convert
from converters.sources.coco import CocoSource
from dali_pipes import DALILoader, RunOptions, load_manifest, open_store
from dali_pipes.pipelines import ColorJitter, Detection, DetectionVal, PipelineSpec

from loader_helpers import ordered_batches, real_rows, run_module_on_cpu

NO_AUG = dict(crop=None, flip=0.0, jitter=None)


# ---------------------------------------------------------------- data


def convert_coco(images: Path, annotations: Path, out: Path, fmt: str = "lmdb") -> Path:
    convert(CocoSource(images, annotations), out, format=fmt, workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def coco_json(coco_mini: Path) -> dict:
    return json.loads((coco_mini / "instances.json").read_text())


@pytest.fixture(scope="module")
def coco_lmdb(coco_mini: Path, tmp_path_factory) -> Path:
    return convert_coco(coco_mini / "images", coco_mini / "instances.json", tmp_path_factory.mktemp("det") / "lmdb")


@pytest.fixture(scope="module")
def edge_cases(coco_mini: Path, tmp_path_factory) -> tuple[Path, dict]:
    """Four real photos: all-crowd; a box wholly outside the image; no annotations; a normal and a crowd box.

    Category ids 3, 7 and 90 (contiguous labels 0, 1, 2).
    """
    images = json.loads((coco_mini / "instances.json").read_text())["images"][:4]
    w0, h0 = images[0]["width"], images[0]["height"]
    w1 = images[1]["width"]
    w3, h3 = images[3]["width"], images[3]["height"]
    data = {
        "images": [dict(im, id=i + 1) for i, im in enumerate(images)],
        "categories": [{"id": 90, "name": "ninety"}, {"id": 3, "name": "three"}, {"id": 7, "name": "seven"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 3, "iscrowd": 1, "bbox": [10, 10, w0 / 2, h0 / 2]},
            {"id": 2, "image_id": 1, "category_id": 7, "iscrowd": 1, "bbox": [w0 / 2, h0 / 2, 100, 100]},
            {"id": 3, "image_id": 2, "category_id": 7, "iscrowd": 0, "bbox": [w1 + 10, 20, 50, 50]},
            {"id": 4, "image_id": 4, "category_id": 90, "iscrowd": 0, "bbox": [w3 / 4, h3 / 4, w3 / 2, h3 / 2]},
            {"id": 5, "image_id": 4, "category_id": 7, "iscrowd": 1, "bbox": [0, 0, w3 / 8, h3 / 8]},
        ],
    }
    root = tmp_path_factory.mktemp("edge")
    (root / "instances.json").write_text(json.dumps(data))
    return convert_coco(coco_mini / "images", root / "instances.json", root / "lmdb"), data


COLOURS = {1: (230, 30, 30), 2: (30, 230, 30), 3: (30, 30, 230), 4: (230, 230, 30)}


@pytest.fixture(scope="module")
def rectangles(tmp_path_factory) -> Path:
    """Eight 320x240 PNGs, each with three rectangles of a category's colour in separate quadrants."""
    root = tmp_path_factory.mktemp("rects")
    (root / "images").mkdir()
    rng = np.random.default_rng(7)
    images, annotations = [], []
    for i in range(8):
        pixels = np.zeros((240, 320, 3), dtype=np.uint8)
        for cell in rng.choice(4, size=3, replace=False):
            cx, cy = (cell % 2) * 160, (cell // 2) * 120
            w, h = rng.integers(40, 130), rng.integers(40, 90)
            x, y = cx + 12 + rng.integers(0, 148 - 12 - w + 1), cy + 12 + rng.integers(0, 108 - 12 - h + 1)
            category = int(rng.integers(1, 5))
            pixels[y : y + h, x : x + w] = COLOURS[category]
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i,
                    "category_id": category,
                    "iscrowd": 0,
                    "bbox": [int(x), int(y), int(w), int(h)],
                }
            )
        Image.fromarray(pixels).save(root / "images" / f"rect-{i}.png")
        images.append({"id": i, "file_name": f"rect-{i}.png", "width": 320, "height": 240})
    data = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": k, "name": f"colour-{k}"} for k in COLOURS],
    }
    (root / "instances.json").write_text(json.dumps(data))
    return convert_coco(root / "images", root / "instances.json", root / "lmdb")


def expected_targets(data: dict, contiguous: bool = True) -> dict[int, tuple[np.ndarray, list[int]]]:
    """Per image id: the trainable boxes (non-crowd, clipped to the image, positive area) as xyxy pixels, and labels."""
    ids = sorted(c["id"] for c in data["categories"])
    sizes = {im["id"]: (im["width"], im["height"]) for im in data["images"]}
    out: dict[int, tuple[list, list]] = {im["id"]: ([], []) for im in data["images"]}
    for ann in data["annotations"]:
        if ann.get("iscrowd", 0):
            continue
        w, h = sizes[ann["image_id"]]
        x, y, bw, bh = ann["bbox"]
        box = np.clip([x, y, x + bw, y + bh], 0, [w, h, w, h])
        if box[2] > box[0] and box[3] > box[1]:
            out[ann["image_id"]][0].append(box)
            out[ann["image_id"]][1].append(ids.index(ann["category_id"]) if contiguous else ann["category_id"])
    return {k: (np.array(b, dtype=np.float64).reshape(-1, 4), labels) for k, (b, labels) in out.items()}


def run(path: Path, spec: PipelineSpec, *, epochs: int = 1, batch_size: int = 16, seed: int = 0) -> list[dict]:
    """Every batch of ``epochs`` epochs, in dataset order, as numpy, read in this process."""
    return ordered_batches(path, spec, epochs=epochs, batch_size=batch_size, seed=seed)


def image_ids(path: Path) -> list[int]:
    store = open_store(path)
    try:
        return [int(store[i]["image_id"]) for i in range(len(store))]
    finally:
        store.close()


def assert_valid_targets(batch: dict, row: int) -> int:
    """Boxes inside the valid image with positive area, padding as documented; returns the box count."""
    n = int(batch["num_boxes"][row])
    h, w = batch["image_size"][row]
    boxes, labels = batch["boxes"][row], batch["labels"][row]
    assert boxes.shape[0] == labels.shape[0] >= max(1, n)
    real = boxes[:n]
    assert np.all(real >= -1e-3) and np.all(real[:, [0, 2]] <= w + 1e-3) and np.all(real[:, [1, 3]] <= h + 1e-3), real
    assert np.all(real[:, 2] > real[:, 0]) and np.all(real[:, 3] > real[:, 1]), real
    assert np.all(boxes[n:] == 0) and np.all(labels[n:] == -1)
    return n


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Detection(size=0), "size"),
        (lambda: Detection(size=(300, 300, 3)), "size"),
        (lambda: Detection(size=(300, 300), max_size=500), "max_size"),
        (lambda: Detection(size=512, max_size=256), "max_size"),
        (lambda: Detection(crop="random"), "crop"),
        (lambda: Detection(flip=2.0), "flip"),
        (lambda: Detection(jitter=0.4), "jitter"),
        (lambda: Detection(crowd="ignore"), "crowd"),
        (lambda: Detection(contiguous_labels=1), "contiguous_labels"),
        (lambda: Detection(category_ids=[1, 1]), "category_ids"),
        (lambda: Detection(category_ids=[70000]), "category_ids"),
        (lambda: DetectionVal(dtype="int8"), "dtype"),
        (lambda: DetectionVal(layout="CHW"), "layout"),
    ],
)
def test_bad_arguments_name_the_argument(make, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        make()


def test_specs_are_frozen_hashable_and_keyword_only():
    spec = Detection(size=[320, 480], category_ids=[7, 3], jitter=ColorJitter(0.1, 0.1, 0.1, 0.0))
    assert spec.size == (320, 480) and spec.category_ids == (3, 7) and spec.num_classes == 2
    assert pickle.loads(pickle.dumps(spec)) == spec and hash(spec) == hash(pickle.loads(pickle.dumps(spec)))
    with pytest.raises(FrozenInstanceError):
        spec.flip = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        Detection(300)  # type: ignore[misc]
    assert isinstance(spec, PipelineSpec) and isinstance(DetectionVal(), PipelineSpec)
    assert Detection().required_fields == ("image", "boxes", "category_id", "iscrowd")
    assert DetectionVal().required_fields == ("image", "boxes", "category_id", "iscrowd", "image_id")


def test_bind_reads_sorted_category_ids_and_refuses_datasets_without_them(edge_cases):
    path, _ = edge_cases
    manifest = load_manifest(path)
    assert Detection().bind(manifest).category_ids == (3, 7, 90)
    assert Detection(category_ids=(1, 3, 7, 90)).bind(manifest).category_ids == (1, 3, 7, 90)
    with pytest.raises(ValueError, match="lacks"):
        Detection(category_ids=(3, 7)).bind(manifest)
    bare = dataclasses.replace(manifest, extra={})
    with pytest.raises(
        ValueError, match="has no categories in its index.json; convert .* 'dali-pipes convert coco'"
    ) as exc:
        Detection().bind(bare)
    # The message is also what the CLI prints: no Python method or argument names in it.
    assert ".bind" not in str(exc.value) and "category_ids" not in str(exc.value)
    # Ids the caller gives need nothing from the manifest.
    assert Detection(category_ids=(3, 7, 90)).bind(bare).category_ids == (3, 7, 90)


def test_the_loader_binds_an_unbound_spec_to_the_dataset_categories(edge_cases):
    path, data = edge_cases
    loader = DALILoader(
        path, Detection(crop=None, flip=0.0), batch_size=2, run=RunOptions(device="cpu", py_num_workers=0)
    )
    assert loader.pipeline.category_ids == tuple(sorted(c["id"] for c in data["categories"]))
    labels = {int(v) for batch in loader for v in batch["labels"].reshape(-1) if v >= 0}
    assert labels and labels <= {0, 1, 2}


# ---------------------------------------------------------------- behaviour on coco-mini


def test_after_crop_flip_and_resize_boxes_stay_inside_and_keep_their_labels(coco_lmdb, coco_json):
    spec = Detection(size=320, max_size=512, crop="ssd", flip=0.5)
    batches = run(coco_lmdb, spec, epochs=2)
    expected = expected_targets(coco_json)
    ids = image_ids(coco_lmdb)
    seen = fewer = reshaped = 0
    for batch, row in real_rows(batches):
        n = assert_valid_targets(batch, row)
        h, w = batch["image_size"][row]
        assert batch["image"].shape[1] == 3 and np.all(batch["image"][row][:, h:, :] == 0)
        assert np.all(batch["image"][row][:, :, w:] == 0)  # padding after normalisation is 0
        assert min(h, w) == 320 or max(h, w) == 512
        boxes, labels = expected[ids[batch["index"][row]]]
        got = Counter(batch["labels"][row][:n].tolist())
        want = Counter(labels)
        assert not got - want, f"labels {got} are not among the annotated {want}"
        if n == len(labels):
            assert got == want
        else:
            fewer += 1
        orig_h, orig_w = (coco_json["images"][ids[batch["index"][row]]][k] for k in ("height", "width"))
        reshaped += abs((w / h) / (orig_w / orig_h) - 1) > 0.05
        seen += 1
    assert seen == 2 * 61
    assert reshaped > 0, "no sample was cropped: the SSD crop did not run"


def test_flipped_output_is_the_mirrored_unflipped_output(coco_lmdb):
    common = dict(size=256, max_size=400, crop=None, jitter=None)
    plain = run(coco_lmdb, Detection(flip=0.0, **common), seed=3)
    flipped = run(coco_lmdb, Detection(flip=1.0, **common), seed=3)
    for (a, row), (b, _) in zip(real_rows(plain), real_rows(flipped)):
        h, w = a["image_size"][row]
        assert (b["image_size"][row] == (h, w)).all()
        np.testing.assert_allclose(b["image"][row][:, :h, :w], a["image"][row][:, :h, :w][:, :, ::-1], atol=1e-4)
        assert np.all(b["image"][row][:, :, w:] == 0) and np.all(b["image"][row][:, h:, :] == 0)
        n = int(a["num_boxes"][row])
        assert n == b["num_boxes"][row] and (a["labels"][row] == b["labels"][row]).all()
        ab, bb = a["boxes"][row][:n], b["boxes"][row][:n]
        mirrored = np.stack([w - ab[:, 2], ab[:, 1], w - ab[:, 0], ab[:, 3]], axis=1)
        np.testing.assert_allclose(bb, mirrored, atol=1e-3)
        assert n == 0 or not np.allclose(ab, bb)  # a flip moves boxes (no coco-mini box is centred exactly)


@pytest.mark.parametrize(
    "spec",
    [DetectionVal(size=320, max_size=480), DetectionVal(size=(300, 400)), Detection(size=(300, 400), **NO_AUG)],
    ids=["val-shorter-side", "val-fixed", "train-no-crop"],
)
def test_boxes_scaled_back_match_the_annotations_within_a_pixel(coco_lmdb, coco_json, spec):
    expected = expected_targets(coco_json)
    sizes = {im["id"]: (im["height"], im["width"]) for im in coco_json["images"]}
    ids = image_ids(coco_lmdb)
    checked = 0
    for batch, row in real_rows(run(coco_lmdb, spec)):
        image_id = ids[batch["index"][row]]
        if "image_id" in batch:
            assert batch["image_id"][row] == image_id
            assert tuple(batch["orig_size"][row]) == sizes[image_id]
        n = assert_valid_targets(batch, row)
        boxes, labels = expected[image_id]
        assert n == len(labels) and batch["labels"][row][:n].tolist() == labels
        (oh, ow), (h, w) = sizes[image_id], batch["image_size"][row]
        if isinstance(spec.size, tuple):
            assert (h, w) == spec.size and batch["image"].shape[2:] == spec.size
        back = batch["boxes"][row][:n] * np.array([ow / w, oh / h, ow / w, oh / h])
        np.testing.assert_allclose(back, boxes, atol=1.0)
        checked += n
    assert checked == sum(len(labels) for _, labels in expected.values())


@pytest.mark.parametrize("fmt", ["hdf5", "tfrecord"])
def test_every_format_gives_the_same_validation_batches(coco_mini, coco_lmdb, tmp_path, fmt):
    other = convert_coco(coco_mini / "images", coco_mini / "instances.json", tmp_path / fmt, fmt)
    spec = DetectionVal(size=160, max_size=240, dtype="uint8", layout="NHWC")
    for a, b in zip(run(coco_lmdb, spec, batch_size=32), run(other, spec, batch_size=32)):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# ---------------------------------------------------------------- boxes against pixels


def test_boxes_follow_the_pixels_through_crop_flip_and_resize(rectangles):
    """Each output box encloses pixels of its label's colour, with background just outside its edges."""
    colours = {label: np.array(COLOURS[cid]) for label, cid in enumerate(sorted(COLOURS))}
    spec = Detection(size=(320, 320), crop="ssd", flip=0.5, jitter=None, dtype="uint8", layout="NHWC")
    checked_inside = checked_edges = 0
    for batch, row in real_rows(run(rectangles, spec, epochs=6, batch_size=8, seed=1)):
        n = assert_valid_targets(batch, row)
        image = batch["image"][row].astype(int)
        for (x1, y1, x2, y2), label in zip(batch["boxes"][row][:n], batch["labels"][row][:n]):
            if x2 - x1 < 16 or y2 - y1 < 16:
                continue  # a sliver the crop left: too thin to judge against blur
            mx, my = max(6, (x2 - x1) / 4), max(6, (y2 - y1) / 4)
            inner = image[int(y1 + my) : int(np.ceil(y2 - my)), int(x1 + mx) : int(np.ceil(x2 - mx))]
            assert np.abs(inner - colours[int(label)]).max() <= 40, (label, inner.mean(axis=(0, 1)))
            checked_inside += 1
            # Just outside each edge that is not the image border: background (7 px clears the blur).
            ys = slice(int(y1 + my), int(np.ceil(y2 - my)))
            xs = slice(int(x1 + mx), int(np.ceil(x2 - mx)))
            strips = [
                image[ys, int(x1) - 7] if x1 >= 8 else None,
                image[ys, int(np.ceil(x2)) + 6] if x2 <= 312 else None,
                image[int(y1) - 7, xs] if y1 >= 8 else None,
                image[int(np.ceil(y2)) + 6, xs] if y2 <= 312 else None,
            ]
            for strip in strips:
                if strip is not None:
                    assert strip.max() <= 40, "a box edge is not where the rectangle ends"
                    checked_edges += 1
    assert checked_inside > 50 and checked_edges > 50


# ---------------------------------------------------------------- no boxes


def test_images_left_without_boxes_give_valid_samples(edge_cases):
    path, data = edge_cases
    for spec in (Detection(size=(128, 128)), Detection(size=96, max_size=160, crop=None), DetectionVal(size=96)):
        # batch 3: the first batch holds only the three images that end up without boxes.
        batches = run(path, spec, epochs=2, batch_size=3)
        for batch, row in real_rows(batches):
            n = assert_valid_targets(batch, row)
            image_id = batch["index"][row] + 1
            assert n == (1 if image_id == 4 else 0)
            if n:
                assert batch["labels"][row][:1].tolist() == [2]  # category 90 of (3, 7, 90)
        first = batches[0]
        assert first["boxes"].shape == (3, 1, 4) and first["num_boxes"].tolist() == [0, 0, 0]
        assert (first["labels"] == -1).all() and np.isfinite(first["image"]).all()


def test_crowd_keep_flags_crowd_boxes_and_keeps_their_labels(edge_cases):
    path, _ = edge_cases
    batches = run(path, DetectionVal(size=96, crowd="keep"), batch_size=4)
    (batch,) = batches
    assert batch["num_boxes"].tolist() == [2, 0, 0, 2]
    assert batch["iscrowd"].dtype == np.uint8
    assert batch["iscrowd"][0].tolist() == [1, 1] and batch["labels"][0].tolist() == [0, 1]
    assert batch["iscrowd"][3].tolist() == [0, 1] and batch["labels"][3].tolist() == [2, 1]
    assert batch["iscrowd"][1].tolist() == [0, 0] and batch["labels"][1].tolist() == [-1, -1]
    for row in range(4):
        assert_valid_targets(batch, row)


def test_contiguous_labels_false_keeps_category_ids(edge_cases):
    path, _ = edge_cases
    (batch,) = run(path, DetectionVal(size=96, contiguous_labels=False, crowd="keep"), batch_size=4)
    assert batch["labels"][0].tolist() == [3, 7] and batch["labels"][3].tolist() == [90, 7]


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_graph_matches_the_cpu_graph(coco_lmdb):
    spec = Detection(size=256, max_size=384, **NO_AUG).bind(load_manifest(coco_lmdb))
    outputs = {}
    for device in ("cpu", "gpu"):
        options = RunOptions(device=device, py_num_workers=0)
        with DALILoader(coco_lmdb, spec, batch_size=8, shuffle=False, run=options) as loader:
            batch = next(iter(loader))
        if device == "gpu":
            assert all(v.is_cuda for v in batch.values())
        outputs[device] = {k: v.cpu() for k, v in batch.items()}
    cpu, gpu = outputs["cpu"], outputs["gpu"]
    for key in ("image_size", "num_boxes", "labels"):
        assert torch.equal(cpu[key], gpu[key]), key
    torch.testing.assert_close(cpu["boxes"], gpu["boxes"], atol=1e-3, rtol=0)
    # The GPU decoder (nvJPEG) and resize differ from the CPU's by a few levels.
    assert (cpu["image"] - gpu["image"]).abs().mean() < 0.05


# ---------------------------------------------------------------- the example


def test_example_trains_one_epoch_on_cpu(coco_lmdb):
    args = (coco_lmdb, "--epochs", "1", "--batch-size", "16", "--size", "96", "--max-size", "128", "--workers", "0")
    proc = run_module_on_cpu("dali_pipes.examples.train_detection", *args, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"epoch 0: (\d+) images, loss ([0-9.]+)", proc.stdout)
    assert found and int(found.group(1)) == 61 and 0 < float(found.group(2)) < 100, proc.stdout


def test_example_targets_use_counts_valid_sizes_and_padding():
    from dali_pipes.examples.train_detection import IGNORE, grid_targets

    batch = {
        "boxes": torch.tensor(
            [
                [[0.0, 0.0, 20.0, 20.0], [40.0, 8.0, 60.0, 24.0]],
                [[0.0, 0.0, 0.0, 0.0]] * 2,
                [[0.0, 0.0, 32.0, 32.0], [0.0, 0.0, 0.0, 0.0]],
            ]
        ),
        "labels": torch.tensor([[1, 0], [-1, -1], [2, -1]]),
        "num_boxes": torch.tensor([2, 0, 1]),
        "image_size": torch.tensor([[64, 64], [32, 48], [64, 64]]),
        "is_pad": torch.tensor([False, False, True]),
    }
    classes, boxes, assigned = grid_targets(batch, (4, 4), num_classes=3)
    assert assigned.sum() == 2 and assigned[0, 0, 0] and assigned[0, 1, 3]
    assert classes[0, 0, 0] == 1 and classes[0, 1, 3] == 0 and classes[0, 3, 3] == 3  # background
    assert (classes[1, :2, :3] == 3).all()  # a 32x48 image covers 2x3 cells; the rest is padding
    assert (classes[1, 2:, :] == IGNORE).all() and (classes[1, :, 3:] == IGNORE).all()
    assert (classes[2] == IGNORE).all()  # a padded sample teaches nothing
    torch.testing.assert_close(boxes[0, 1, 3], torch.tensor([0.125, 0.0, float(np.log(1.25)), 0.0]))
