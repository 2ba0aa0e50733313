"""Real sample photographs shipped with the package, for the tests, examples and notebooks.

Two small sets from NVIDIA DALI_extra (Apache-2.0, ``LICENSE.DALI_extra`` beside them),
downscaled to 3/8 of their size (see ``README.md`` here): :func:`imagenet_mini` and
:func:`coco_mini`. Treat them as read-only: copy them before writing next to them.
"""

from __future__ import annotations

from pathlib import Path

#: The folder holding the sample sets (inside the installed package).
SAMPLE_DATA = Path(__file__).resolve().parent


def imagenet_mini() -> Path:
    """47 JPEG photos (longest side 240 to 720 px) in 19 ImageNet class-id folders, with ``image_list.txt``."""
    return _existing(SAMPLE_DATA / "imagenet-mini")


def coco_mini() -> Path:
    """61 images (58 JPEG, 3 RGBA PNG) in ``images/`` with COCO ``instances.json``: 91 boxes, 17 categories."""
    return _existing(SAMPLE_DATA / "coco-mini")


def _existing(path: Path) -> Path:
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path}: the sample data is missing from this installation of dali-pipes; reinstall it "
            "(pip install -e . from a clone, or pip install dali-pipes)"
        )
    return path
