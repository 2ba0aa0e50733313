"""The small datasets ``dali-pipes selftest`` runs on, made at run time with the package's own code.

Photograph-like JPEGs from :mod:`converters.synth`, a COCO-style set (the same
kind of images with boxes in an ``instances.json``) and a feature-array set,
each converted to shards by the real converters. Small on purpose: the test
checks that every pipeline runs and gives sane outputs, not how fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Images per set, their (width, height), and the classes of the classification set.
NUM_IMAGES = 12
IMAGE_SIZE = (96, 72)
CLASSES = 3
#: COCO category ids (not 0..K-1, as in COCO) and the feature arrays' width.
CATEGORY_IDS = (1, 3)
FEATURE_DIM = 8


@dataclass(frozen=True)
class SampleData:
    """The converted datasets, and what the selftest compares the feature outputs with."""

    classification: Path
    detection: Path
    features: Path
    feature_values: np.ndarray  # (NUM_IMAGES, FEATURE_DIM) float32, row i is sample i
    feature_labels: np.ndarray  # (NUM_IMAGES,) int64
    instance: Path | None = None  # the COCO set with masks; None without pycocotools
    semantic: Path | None = None  # the COCO set's images with label maps (classes: background + categories)


def make_sample_data(root: Path) -> SampleData:
    """Write the three datasets under ``root`` (a fresh folder) and return where they are."""
    from converters.runner import convert
    from converters.sources import ArraysSource, CocoSource, ImageFolderSource
    from converters.sources.coco_masks import has_pycocotools
    from converters.synth import make_imagefolder

    images = make_imagefolder(root / "imagefolder", NUM_IMAGES, size=IMAGE_SIZE, classes=CLASSES, workers=1)
    classification = root / "classification"
    convert(ImageFolderSource(images), classification, format="lmdb", workers=1, progress=False)

    coco_images, instances = _make_coco(root / "coco")
    detection = root / "detection"
    convert(CocoSource(coco_images, instances), detection, format="tfrecord", workers=1, progress=False)

    rng = np.random.default_rng(0)
    values = rng.standard_normal((NUM_IMAGES, FEATURE_DIM)).astype(np.float32)
    labels = (np.arange(NUM_IMAGES) % CLASSES).astype(np.int64)
    np.save(root / "features.npy", values)
    np.save(root / "label.npy", labels)
    features = root / "features"
    source = ArraysSource([root / "features.npy", root / "label.npy"])
    convert(source, features, format="hdf5", workers=1, progress=False)
    instance = None
    if has_pycocotools():
        instance = root / "instance"
        convert(CocoSource(coco_images, instances, masks=True), instance, format="lmdb", workers=1, progress=False)
    semantic = root / "semantic"
    convert(_make_label_maps(root / "maps", instances), semantic, format="hdf5", workers=1, progress=False)
    return SampleData(classification, detection, features, values, labels, instance, semantic)


def _make_label_maps(root: Path, instances: Path) -> Any:
    """A segmentation source over the COCO set's images: each box filled with its class, a strip of ignore."""
    from PIL import Image

    from converters.sources import SegmentationSource

    data = json.loads(instances.read_text())
    root.mkdir(parents=True)
    width, height = IMAGE_SIZE
    for image in data["images"]:
        labels = np.zeros((height, width), dtype=np.uint8)
        for ann in data["annotations"]:
            if ann["image_id"] == image["id"]:
                x, y, w, h = (int(round(v)) for v in ann["bbox"])
                labels[y : y + h, x : x + w] = 1 + CATEGORY_IDS.index(ann["category_id"])
        labels[:, :4] = 255
        Image.fromarray(labels).save(root / Path(image["file_name"]).with_suffix(".png").name)
    classes = root.parent / "classes.txt"
    classes.write_text("\n".join(["background"] + [f"category_{c}" for c in CATEGORY_IDS]) + "\n")
    return SegmentationSource(instances.parent / "images", root, classes_file=classes)


def _make_coco(root: Path) -> tuple[Path, Path]:
    """A COCO-style folder: synthetic JPEGs and an ``instances.json`` with 1 to 3 boxes per image."""
    from converters.synth import render

    images_dir = root / "images"
    images_dir.mkdir(parents=True)
    width, height = IMAGE_SIZE
    rng = np.random.default_rng(1)
    images, annotations = [], []
    for i in range(NUM_IMAGES):
        name = f"{i:06d}.jpg"
        render(i, IMAGE_SIZE, classes=len(CATEGORY_IDS)).save(images_dir / name, quality=90)
        images.append({"id": 100 + i, "file_name": name, "width": width, "height": height})
        for _ in range(1 + i % 3):
            w, h = rng.uniform(10, width / 2), rng.uniform(10, height / 2)
            x, y = rng.uniform(0, width - w), rng.uniform(0, height - h)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": 100 + i,
                    "category_id": CATEGORY_IDS[len(annotations) % len(CATEGORY_IDS)],
                    "bbox": [round(float(v), 2) for v in (x, y, w, h)],
                    "area": round(float(w * h), 2),
                    "iscrowd": 0,
                    "segmentation": [[round(float(v), 2) for v in (x, y, x + w, y, x + w, y + h, x, y + h)]],
                }
            )
    categories = [{"id": c, "name": f"category_{c}"} for c in CATEGORY_IDS]
    instances = root / "instances.json"
    instances.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return images_dir, instances
