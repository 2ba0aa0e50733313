"""Instance masks: ``convert coco --masks`` and the InstanceSegmentation specs, on the real coco-mini annotations.

The sample annotations are polygons; compressed and uncompressed RLE versions of them are
made by pycocotools (``frPyObjects``/``merge``/``encode``) from the real masks, and each
uncompressed RLE is checked by pycocotools' decoder before use. The reference for every
output mask is pycocotools' ``COCO.annToMask`` of the annotation, pushed through the same
crop window, nearest-neighbour resize and flip by numpy and PIL.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from converters.runner import convert
from converters.sources.coco import CocoSource
from dali_pipes import DALILoader, RunOptions, open_store
from dali_pipes.pipelines import InstanceSegmentation, InstanceSegmentationVal

from loader_helpers import ordered_batches, real_rows, run_module_on_cpu

mask_api = pytest.importorskip("pycocotools.mask", reason="pycocotools is not installed (pip install -e '.[coco]')")
COCO = pytest.importorskip("pycocotools.coco", reason="pycocotools is not installed").COCO

#: coco-mini's three real degenerate annotations: 2-point polygons (area 0) from DALI_extra.
DEGENERATE = {8, 69, 79}
MIN_PIXELS = 32


def uncompressed_rle(mask: np.ndarray) -> dict:
    """COCO's uncompressed RLE of a binary mask: run lengths in column-major order, starting with a 0 run."""
    flat = mask.flatten(order="F")
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(flat)) + 1, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat[0]:
        counts = [0] + counts
    return {"size": list(mask.shape), "counts": [int(c) for c in counts]}


def rewrite_segmentations(data: dict) -> dict:
    """coco-mini with every third annotation as compressed RLE (crowd) and every third as uncompressed RLE."""
    sizes = {im["id"]: (im["height"], im["width"]) for im in data["images"]}
    annotations = []
    for i, ann in enumerate(a for a in data["annotations"] if a["id"] not in DEGENERATE):
        h, w = sizes[ann["image_id"]]
        rle = mask_api.merge(mask_api.frPyObjects(ann["segmentation"], h, w))
        mask = mask_api.decode(rle)
        ann = dict(ann)
        if i % 3 == 1:
            ann["segmentation"] = {"size": [h, w], "counts": rle["counts"].decode("ascii")}
            ann["iscrowd"] = 1
        elif i % 3 == 2:
            ann["segmentation"] = uncompressed_rle(mask)
            assert np.array_equal(mask_api.decode(mask_api.frPyObjects(ann["segmentation"], h, w)), mask)
        annotations.append(ann)
    return {**data, "annotations": annotations}


@pytest.fixture(scope="module")
def masks_json(coco_mini: Path, tmp_path_factory) -> Path:
    data = rewrite_segmentations(json.loads((coco_mini / "instances.json").read_text()))
    kinds = {type(a["segmentation"]).__name__ + str(type(a["segmentation"].get("counts", "")).__name__
             if isinstance(a["segmentation"], dict) else "") for a in data["annotations"]}  # fmt: skip
    assert kinds == {"list", "dictstr", "dictlist"}
    path = tmp_path_factory.mktemp("masks") / "instances.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def masks_lmdb(coco_mini: Path, masks_json: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("masks-lmdb") / "lmdb"
    convert(CocoSource(coco_mini / "images", masks_json, masks=True), out, format="lmdb", workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def reference(masks_json: Path):
    coco = COCO(str(masks_json))
    by_image = {i: coco.loadAnns(coco.getAnnIds(imgIds=[i])) for i in coco.getImgIds()}
    return coco, by_image


def iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def nearest_indices(size_in: int, size_out: int) -> np.ndarray:
    """The source pixel whose extent holds each output pixel's centre: ``floor((i + 0.5) * in / out)``.

    At an exact tie (the centre on a pixel border, which rational scales give every few
    pixels) this takes the right/lower pixel; PIL's NEAREST takes the other one there.
    """
    return np.floor((np.arange(size_out) + 0.5) * size_in / size_out).astype(np.int64)


def transform(mask: np.ndarray, window: tuple[int, int, int, int], out_hw: tuple[int, int], flip: bool) -> np.ndarray:
    """The independent reference: crop ``(x0, y0, x1, y1)``, nearest-neighbour resize to ``out_hw``, mirror."""
    x0, y0, x1, y1 = window
    crop = mask[y0:y1, x0:x1]
    out = crop[nearest_indices(crop.shape[0], out_hw[0])][:, nearest_indices(crop.shape[1], out_hw[1])]
    return out[:, ::-1] if flip else out


def convert_with_masks(coco_mini: Path, data: dict, tmp_path: Path) -> tuple[Path, list[dict]]:
    """``data`` as the instances JSON of coco-mini's images, converted with masks; the output and its errors."""
    (tmp_path / "instances.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    convert(
        CocoSource(coco_mini / "images", tmp_path / "instances.json", masks=True),
        out,
        format="lmdb",
        workers=1,
        progress=False,
    )
    return out, [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]


def test_the_reference_resize_is_pil_nearest_except_at_exact_ties():
    mask = (np.random.default_rng(0).random((321, 480)) > 0.5).astype(np.uint8)
    ours = transform(mask, (0, 0, 480, 321), (300, 400), flip=False)
    pil = np.asarray(Image.fromarray(mask).resize((400, 300), Image.Resampling.NEAREST))
    ties = ((np.arange(400) + 0.5) * 480 / 400) % 1 == 0
    assert (ours != pil).any(axis=0)[~ties].sum() == 0 and (ours != pil)[:, ties].any()
    assert np.array_equal(transform(mask, (7, 5, 400, 300), (295, 393), flip=False), mask[5:300, 7:400])


DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


class _Windowed(InstanceSegmentation):
    """InstanceSegmentation that also outputs its crop window, so the reference can apply the same one."""

    _emit_window = True


def check_sample(batch: dict, row: int, anns: list, coco, window, flip: bool) -> int:
    """Match each output mask to its annotation (in order) and compare with the reference; the count checked."""
    n = int(batch["num_boxes"][row])
    h, w = (int(v) for v in batch["image_size"][row])
    masks = batch["masks"][row]
    assert masks.dtype == np.uint8 and set(np.unique(masks)) <= {0, 1}
    assert not masks[n:].any() and not masks[:, h:].any() and not masks[:, :, w:].any()
    refs = [transform(coco.annToMask(a), window, (h, w), flip) for a in anns]
    checked, last = 0, -1
    for k in range(n):
        scores = [iou(masks[k, :h, :w], ref) if j > last else -1.0 for j, ref in enumerate(refs)]
        j = int(np.argmax(scores))
        assert scores[j] >= 0.5, f"output mask {k} matches no annotation (best IoU {scores[j]:.2f})"
        last = j  # masks come in the order of their annotations
        if refs[j].sum() >= MIN_PIXELS:
            assert scores[j] >= 0.98, f"annotation {anns[j]['id']}: IoU {scores[j]:.3f} with the reference"
            checked += 1
        assert bool(batch["iscrowd"][row][k]) == bool(anns[j]["iscrowd"])
    return checked


def test_stored_masks_are_annToMask_bit_for_bit(masks_lmdb, reference):
    coco, by_image = reference
    store = open_store(masks_lmdb)
    assert len(store) == 61 and {"masks", "mask_code"} <= set(store.fields)
    compared = 0
    for i in range(len(store)):
        sample = store[i]
        layers = np.asarray(Image.open(io.BytesIO(sample["masks"])))
        layers = layers[:, :, None] if layers.ndim == 2 else layers
        anns = by_image[int(sample["image_id"])]
        assert len(sample["mask_code"]) == len(anns)
        for code, ann in zip(sample["mask_code"], anns):
            got = layers[:, :, code // 256] == code % 256
            np.testing.assert_array_equal(got, coco.annToMask(ann).astype(bool), err_msg=f"annotation {ann['id']}")
            compared += 1
    assert compared == 88


@pytest.mark.parametrize("device", DEVICES)
def test_masks_follow_a_known_crop_and_a_forced_flip(masks_lmdb, reference, device):
    coco, by_image = reference
    ids = [int(open_store(masks_lmdb)[i]["image_id"]) for i in range(61)]
    spec = _Windowed(size=256, max_size=384, crop="ssd", flip=1.0, jitter=None, crowd="keep")
    checked = cropped = crowd = 0
    for batch, row in real_rows(ordered_batches(masks_lmdb, spec, epochs=2, device=device)):
        anns = by_image[ids[batch["index"][row]]]
        info = coco.imgs[ids[batch["index"][row]]]
        (ax, ay), (sw, sh) = batch["crop_anchor"][row], batch["crop_shape"][row]
        W, H = info["width"], info["height"]
        window = (round(ax * W), round(ay * H), round((ax + sw) * W), round((ay + sh) * H))
        cropped += window != (0, 0, W, H)
        checked += check_sample(batch, row, anns, coco, window, flip=True)
        crowd += int(batch["iscrowd"][row].sum())
    assert cropped > 20 and checked > 60 and crowd > 5, (cropped, checked, crowd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [(300, 400), 200], ids=["fixed", "shorter-side"])
def test_validation_masks_are_the_annotations_resized(masks_lmdb, reference, size, device):
    coco, by_image = reference
    ids = [int(open_store(masks_lmdb)[i]["image_id"]) for i in range(61)]
    checked = 0
    spec = InstanceSegmentationVal(size=size, crowd="keep")
    for batch, row in real_rows(ordered_batches(masks_lmdb, spec, device=device)):
        info = coco.imgs[ids[batch["index"][row]]]
        window = (0, 0, info["width"], info["height"])
        checked += check_sample(batch, row, by_image[info["id"]], coco, window, flip=False)
    assert checked >= 80


def test_masks_without_annotations_are_zero_and_crowd_drop_drops_their_masks(masks_lmdb, reference):
    coco, by_image = reference
    ids = [int(open_store(masks_lmdb)[i]["image_id"]) for i in range(61)]
    spec = InstanceSegmentation(size=(128, 160), crop=None, flip=0.0, jitter=None, crowd="drop")
    empty = 0
    for batch, row in real_rows(ordered_batches(masks_lmdb, spec)):
        anns = [a for a in by_image[ids[batch["index"][row]]] if not a["iscrowd"]]
        n = int(batch["num_boxes"][row])
        assert n == len(anns)
        assert not batch["masks"][row][n:].any()
        empty += n == 0
    assert empty > 0


def test_bad_segmentations_are_listed_and_the_rest_kept(coco_mini: Path, tmp_path: Path):
    data = json.loads((coco_mini / "instances.json").read_text())
    sizes = {im["id"]: (im["height"], im["width"]) for im in data["images"]}
    by_id = {a["id"]: a for a in data["annotations"]}
    odd, rle_size = by_id[1], by_id[2]
    odd["segmentation"] = [odd["segmentation"][0][:-1]]
    h, w = sizes[rle_size["image_id"]]
    rle = mask_api.merge(mask_api.frPyObjects(rle_size["segmentation"], h, w))
    rle_size["segmentation"] = {"size": [h + 1, w], "counts": rle["counts"].decode("ascii")}
    out, errors = convert_with_masks(coco_mini, data, tmp_path)
    left_out = [e for e in errors if "part" not in e]  # images; the parts are coco-mini's 2-point polygons
    reasons = " | ".join(e["reason"] for e in left_out)
    assert "odd number of coordinates" in reasons and "RLE size" in reasons
    assert sorted(e["part"] for e in errors if "part" in e) == sorted(f"annotation id {i}" for i in DEGENERATE)
    assert len(left_out) == 2
    assert len(open_store(out)) == 61 - 2


def test_masks_need_the_option_and_a_dataset_without_them_is_refused_by_name(coco_mini: Path, tmp_path: Path):
    out = tmp_path / "plain"
    convert(
        CocoSource(coco_mini / "images", coco_mini / "instances.json"), out, format="lmdb", workers=1, progress=False
    )
    assert "masks" not in open_store(out).fields
    with pytest.raises(ValueError, match="masks"):
        DALILoader(out, InstanceSegmentation(), batch_size=2, run=RunOptions(device="cpu"))


# ---------------------------------------------------------------- the example


def run_example(dataset: Path, *extra: str) -> subprocess.CompletedProcess:
    flags = ["--epochs", "1", "--batch-size", "8", "--size", "96", "--max-size", "128", "--workers", "0", *extra]
    return run_module_on_cpu("dali_pipes.examples.train_instance_segmentation", dataset, *flags, timeout=600)


def test_example_trains_the_tiny_mask_model_for_an_epoch_on_cpu(masks_lmdb):
    proc = run_example(masks_lmdb, "--model", "tiny")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"epoch 0: (\d+) images, loss ([0-9.]+).*\(tiny model\)", proc.stdout)
    assert found and int(found.group(1)) == 61 and 0 < float(found.group(2)) < 100, proc.stdout


def test_example_trains_torchvision_maskrcnn_for_an_epoch(masks_lmdb):
    pytest.importorskip(
        "torchvision",
        reason="torchvision is not installed (no build exists for this CPU-only torch); the Mask R-CNN path "
        "runs where it is, e.g. with a CUDA build of torch",
    )
    proc = run_example(masks_lmdb, "--model", "maskrcnn")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"epoch 0: (\d+) images, loss ([0-9.]+).*\(maskrcnn model\)", proc.stdout)
    assert found and int(found.group(1)) == 61 and float(found.group(2)) > 0, proc.stdout


def test_maskrcnn_targets_cut_padding_rows_and_samples():
    from dali_pipes.examples.train_instance_segmentation import maskrcnn_targets

    masks = torch.zeros((3, 2, 8, 10), dtype=torch.uint8)
    masks[0, 0, 1:3, 2:5] = 1
    batch = {
        "image": torch.randn(3, 3, 8, 10),
        "image_size": torch.tensor([[8, 10], [6, 7], [8, 10]]),
        "boxes": torch.tensor([[[2.0, 1.0, 5.0, 3.0], [0, 0, 1, 1]], [[0.0] * 4] * 2, [[0, 0, 4, 4], [0.0] * 4]]),
        "labels": torch.tensor([[0, 4], [-1, -1], [2, -1]]),
        "num_boxes": torch.tensor([2, 0, 1]),
        "masks": masks,
        "is_pad": torch.tensor([False, False, True]),
    }
    images, targets = maskrcnn_targets(batch)
    assert [tuple(i.shape) for i in images] == [(3, 8, 10), (3, 6, 7)]
    assert targets[0]["labels"].tolist() == [1, 5] and targets[1]["labels"].shape == (0,)
    assert targets[0]["masks"].shape == (2, 8, 10) and targets[1]["masks"].shape == (0, 6, 7)
    assert torch.equal(targets[0]["masks"][0], masks[0, 0]) and targets[1]["boxes"].shape == (0, 4)


def test_show_draws_the_masks_over_the_boxes(masks_lmdb, tmp_path):
    from dali_pipes.cli.show import show

    plain = np.asarray(Image.open(show(masks_lmdb, tmp_path / "d.png", pipeline="detection-val", num=4, device="cpu")))
    drawn = np.asarray(Image.open(show(masks_lmdb, tmp_path / "i.png", pipeline="instance-val", num=4, device="cpu")))
    assert plain.shape == drawn.shape == (300 + 14, 4 * 300, 3)
    changed = (plain != drawn).any(axis=2).mean()
    assert 0.05 < changed < 0.9  # the masked areas, not the whole grid


# ---------------------------------------------------------------- layers, bench and doctor


def test_layer_constants_agree_between_the_converter_and_the_loader():
    from converters.sources import coco_masks
    from dali_pipes.pipelines import instance_segmentation

    assert coco_masks.CODE_BASE == instance_segmentation.MASK_CODE_BASE
    assert coco_masks.MAX_LAYERS == instance_segmentation.MASK_LAYERS


def test_four_deep_overlaps_use_four_layers_and_a_fifth_is_refused(coco_mini: Path, tmp_path: Path):
    data = json.loads((coco_mini / "instances.json").read_text())
    base = max((a for a in data["annotations"] if a["id"] not in DEGENERATE), key=lambda a: a["area"])
    image = next(im for im in data["images"] if im["id"] == base["image_id"])
    others = [im for im in data["images"] if im["id"] != image["id"]][:2]

    def shifted(i: int, dx: float, image_id: int) -> dict:
        poly = [v + (dx if j % 2 == 0 else 0.0) for j, v in enumerate(base["segmentation"][0])]
        return {**base, "id": 1000 + i, "image_id": image_id, "segmentation": [poly], "iscrowd": 0}

    # Four copies 3 px apart on the base image: every pair overlaps; five on a copy of it refuse.
    anns = [shifted(i, 3.0 * i, image["id"]) for i in range(4)] + [
        shifted(10 + i, 3.0 * i, others[0]["id"]) for i in range(5)
    ]
    twin = {**others[0], "file_name": image["file_name"], "height": image["height"], "width": image["width"]}
    data = {**data, "images": [image, twin], "annotations": anns}
    out, errors = convert_with_masks(coco_mini, data, tmp_path)
    assert len(errors) == 1 and "overlaps instances in all 4 mask layers" in errors[0]["reason"]
    store = open_store(out)
    assert len(store) == 1 and Image.open(io.BytesIO(store[0]["masks"])).mode == "RGBA"
    assert sorted(store[0]["mask_code"] // 256) == [0, 1, 2, 3]
    coco = COCO(str(tmp_path / "instances.json"))
    (batch,) = ordered_batches(out, InstanceSegmentationVal(size=(300, 400), crowd="keep"))
    window = (0, 0, image["width"], image["height"])
    assert check_sample(batch, 0, coco.loadAnns([1000, 1001, 1002, 1003]), coco, window, flip=False) == 4


def test_bench_masks_suite_compares_with_and_without_masks(masks_lmdb):
    from dali_pipes.bench.suites import run_bench

    report = run_bench(masks_lmdb, suite="masks", batch_size=8, quick=True, progress=False)
    cpu = {row.name: row for row in report.rows if row.params["device"] == "cpu"}
    assert set(cpu) == {"without masks", "with masks"} and all(row.images_per_s > 0 for row in cpu.values())
    assert report.ratio(cpu["with masks"]) > 0 and "InstanceSegmentation vs Detection" in report.title


def test_doctor_runs_on_a_dataset_with_masks(masks_lmdb):
    from dali_pipes.bench.doctor import run_doctor

    report = run_doctor(masks_lmdb, model="tiny", batch_size=8, steps=3, quick=True, progress=False)
    assert report.context["augmentation"]["spec"] == "InstanceSegmentation"
    assert all(row.error is None and row.images_per_s > 0 for row in (report.loader, report.combined))


def test_max_size_resizes_the_masks_with_their_image(coco_mini, masks_json, reference, tmp_path):
    from converters.base import ImageOptions

    coco, by_image = reference
    out = tmp_path / "small"
    source = CocoSource(coco_mini / "images", masks_json, ImageOptions(max_size=200), masks=True)
    convert(source, out, format="lmdb", workers=1, progress=False)
    store = open_store(out)
    assert len(store) == 61
    for i in range(0, 61, 6):
        sample = store[i]
        size = Image.open(io.BytesIO(sample["image"])).size
        layers = np.asarray(Image.open(io.BytesIO(sample["masks"])))
        layers = layers[:, :, None] if layers.ndim == 2 else layers
        assert max(size) == 200 and layers.shape[:2] == size[::-1]
        info = coco.imgs[int(sample["image_id"])]
        for code, ann in zip(sample["mask_code"], by_image[info["id"]]):
            expected = transform(coco.annToMask(ann), (0, 0, info["width"], info["height"]), size[::-1], flip=False)
            if expected.sum() >= MIN_PIXELS:
                assert iou(layers[:, :, code // 256] == code % 256, expected) >= 0.98, ann["id"]


def test_cli_convert_coco_masks(coco_mini, masks_json, tmp_path):
    from dali_pipes.cli import main as cli

    out = tmp_path / "cli"
    args = ["convert", "coco", "--masks", "--images", str(coco_mini / "images"), "--annotations", str(masks_json)]
    assert cli([*args, str(out), "--workers", "1", "--no-progress", "--format", "hdf5"]) == 0
    store = open_store(out)
    assert store.manifest.source["masks"] is True and {"masks", "mask_code"} <= set(store.fields)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: InstanceSegmentation(flip=2.0), "flip"),
        (lambda: InstanceSegmentation(crowd="maybe"), "crowd"),
        (lambda: InstanceSegmentationVal(size=(1, 2, 3)), "size"),
    ],
)
def test_bad_arguments_name_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_masks_stay_in_their_boxes_under_random_crops_and_coin_flips(masks_lmdb):
    spec = InstanceSegmentation(size=(256, 320), crop="ssd", flip=0.5, crowd="keep")
    checked = 0
    for batch, row in real_rows(ordered_batches(masks_lmdb, spec, epochs=2)):
        for k in range(int(batch["num_boxes"][row])):
            mask = batch["masks"][row, k].astype(bool)
            if mask.sum() < MIN_PIXELS:
                continue
            x1, y1, x2, y2 = batch["boxes"][row, k]
            ys, xs = np.nonzero(mask)
            inside = (xs + 0.5 >= x1 - 1) & (xs + 0.5 <= x2 + 1) & (ys + 0.5 >= y1 - 1) & (ys + 0.5 <= y2 + 1)
            assert inside.mean() > 0.97, (batch["index"][row], k, inside.mean())
            checked += 1
    assert checked > 100
