"""Make ``dali_pipes/sample_data`` from the full-size DALI_extra photos (run once; kept to show how).

    python tests/make_sample_data.py FULL_SIZE_DATA dali_pipes/sample_data

``FULL_SIZE_DATA`` holds ``imagenet-mini/`` and ``coco-mini/`` as taken from NVIDIA DALI_extra.
Every image is scaled by :data:`SCALE` (LANCZOS) so that the mix of sizes and aspect ratios
stays; JPEGs are re-encoded at quality :data:`QUALITY` (progressive where the original was),
RGBA PNGs stay RGBA PNGs. The COCO annotations' boxes, polygons and areas are scaled with
their image (by its own x and y factors after rounding); ids, categories and ``iscrowd`` are kept.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from PIL import Image

SCALE = 0.375  # 1280 px becomes 480, 640 becomes 240
QUALITY = 85


def scale_image(src: Path, dst: Path) -> tuple[float, float]:
    """Write ``src`` scaled to ``dst``; return the x and y factors actually applied."""
    with Image.open(src) as image:
        width, height = image.size
        size = (round(width * SCALE), round(height * SCALE))
        progressive = bool(image.info.get("progressive"))
        fmt = image.format
        small = image.resize(size, Image.Resampling.LANCZOS)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "PNG":
        small.save(dst, "PNG", optimize=True)
    else:
        small.save(dst, "JPEG", quality=QUALITY, progressive=progressive, optimize=True)
    return size[0] / width, size[1] / height


def make_imagenet(src: Path, dst: Path) -> None:
    for path in sorted(src.rglob("*")):
        if path.is_file():
            target = dst / path.relative_to(src)
            if path.suffix.lower() in (".jpg", ".jpeg", ".png"):
                scale_image(path, target)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)


def make_coco(src: Path, dst: Path) -> None:
    data = json.loads((src / "instances.json").read_text())
    factors = {}
    for image in data["images"]:
        fx, fy = scale_image(src / "images" / image["file_name"], dst / "images" / image["file_name"])
        image["width"], image["height"] = round(image["width"] * fx), round(image["height"] * fy)
        factors[image["id"]] = fx, fy
    for ann in data["annotations"]:
        fx, fy = factors[ann["image_id"]]
        x, y, w, h = ann["bbox"]
        ann["bbox"] = [round(x * fx, 2), round(y * fy, 2), round(w * fx, 2), round(h * fy, 2)]
        ann["segmentation"] = [
            [round(v * (fx if i % 2 == 0 else fy), 2) for i, v in enumerate(polygon)] for polygon in ann["segmentation"]
        ]
        ann["area"] = round(ann["area"] * fx * fy, 2)
    (dst / "instances.json").write_text(json.dumps(data, separators=(",", ":")))
    shutil.copyfile(src / "file_list.txt", dst / "file_list.txt")


def main(src: str, dst: str) -> None:
    make_imagenet(Path(src) / "imagenet-mini", Path(dst) / "imagenet-mini")
    make_coco(Path(src) / "coco-mini", Path(dst) / "coco-mini")
    shutil.copyfile(Path(src) / "LICENSE.DALI_extra", Path(dst) / "LICENSE.DALI_extra")


if __name__ == "__main__":
    main(*sys.argv[1:3])
