"""The Numba resize of the CPU pipelines (issue 38) against PIL's, OpenCV's and DALI's own, on real photo crops."""

from __future__ import annotations

import numpy as np
import pytest

from dali_pipes import ClassificationTrain, DALILoader, RunOptions
from dali_pipes.pipelines import cpu_resize

pytest.importorskip("numba", reason='the Numba resize needs the "cpu" extra (pip install "dali-pipes[cpu]")')


def _crops(count: int = 12) -> list[np.ndarray]:
    """Windows of the package's sample photos, from 40 px to whole images, shrunk and enlarged to 224."""
    from PIL import Image

    from dali_pipes import sample_data

    rng = np.random.default_rng(0)
    photos = sorted(p for p in sample_data.imagenet_mini().rglob("*") if p.suffix.lower() in (".jpeg", ".jpg"))
    crops = []
    for path in photos[:count]:
        image = np.asarray(Image.open(path).convert("RGB"))
        h, w = int(rng.integers(40, image.shape[0] + 1)), int(rng.integers(40, image.shape[1] + 1))
        crops.append(np.ascontiguousarray(image[:h, :w]))
    return crops


def _resized(crop: np.ndarray, antialias: bool) -> np.ndarray:
    from dali_pipes.pipelines.cpu_resize_kernels import resize_uint8_hwc3

    out = np.empty((224, 224, 3), np.uint8)
    resize_uint8_hwc3(crop, out, antialias)
    return out


def test_the_antialiased_resize_gives_pils_bilinear_pixels_within_one_level():
    from PIL import Image

    for crop in _crops():
        expected = np.asarray(Image.fromarray(crop).resize((224, 224), Image.BILINEAR))
        diff = np.abs(_resized(crop, True).astype(int) - expected)
        assert diff.max() <= 1, crop.shape


def test_without_antialiasing_it_is_opencvs_linear_resize_within_one_level():
    cv2 = pytest.importorskip("cv2", reason="OpenCV comes with the bench extra (Albumentations)")
    for crop in _crops():
        expected = cv2.resize(crop, (224, 224), interpolation=cv2.INTER_LINEAR)
        diff = np.abs(_resized(crop, False).astype(int) - expected)
        assert diff.max() <= 1, crop.shape


def test_the_training_pipeline_on_the_cpu_takes_it_and_gives_what_dalis_resize_gives(
    tmp_path, imagenet_mini, numba_resize
):
    from converters.runner import convert
    from converters.sources.imagefolder import ImageFolderSource

    dataset = tmp_path / "shards"
    convert(ImageFolderSource(imagenet_mini), dataset, format="lmdb", workers=1, progress=False)
    spec = ClassificationTrain(size=224, dtype="float32", jitter=None, flip=0.0)

    def batch() -> np.ndarray:
        with DALILoader(dataset, spec, batch_size=8, run=RunOptions(device="cpu"), shuffle=False, seed=3) as loader:
            return next(iter(loader))["image"].numpy()

    assert cpu_resize.available()
    ours = batch()
    with cpu_resize.dali_resize_only():
        assert not cpu_resize.available()
        dalis = batch()
    # The same random crops (the same seeds), resized by two implementations of one filter: a few levels
    # apart at most (normalised by std 0.229 * 255: 0.05 is about 3 levels).
    assert ours.shape == dalis.shape == (8, 3, 224, 224)
    assert not np.array_equal(ours, dalis), "both batches came from the same resize"
    assert np.abs(ours - dalis).mean() < 0.01
    assert np.abs(ours - dalis).max() < 0.15


def test_the_environment_can_keep_dalis_resize_and_a_wrong_value_is_named(monkeypatch):
    monkeypatch.setenv("DALI_PIPES_CPU_RESIZE", "dali")
    assert not cpu_resize.available()
    monkeypatch.setenv("DALI_PIPES_CPU_RESIZE", "numba")
    assert cpu_resize.available()
    monkeypatch.setenv("DALI_PIPES_CPU_RESIZE", "fast")
    with pytest.raises(ValueError, match=r"DALI_PIPES_CPU_RESIZE='fast': expected one of numba, dali"):
        cpu_resize.available()
