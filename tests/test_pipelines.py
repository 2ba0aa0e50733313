"""The classification pipeline specs on DALI's CPU backend, checked against numpy/PIL.

Every graph is built the way the loader builds it: encoded file bytes from an
external source go through ``spec.build(inputs, device="cpu")``. The inputs are
real photos from the package's sample data (the ``imagenet_mini`` and ``coco_mini``
fixtures of ``conftest.py``: JPEG, and RGBA PNG); references are computed
independently with PIL and numpy.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import FrozenInstanceError
from pathlib import Path

import numpy as np
import pytest
from nvidia.dali import Pipeline, fn
from PIL import Image

from dali_pipes.pipelines import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ClassificationTrain,
    ClassificationVal,
    ColorJitter,
    DecoderHints,
    PipelineSpec,
)

from pipeline_helpers import run_spec_batch  # noqa: E402 - shared test helper

# ITU-R BT.601 luma, the Y of the YIQ space in which DALI's color_twist rotates hue.
LUMA = np.array([0.299, 0.587, 0.114])
YIQ_I = np.array([0.596, -0.274, -0.322])
YIQ_Q = np.array([0.211, -0.523, 0.312])

#: The commonest size among the sample photos (14 of them; 1280 x 853 before downscaling to 3/8).
SAME_SHAPE = (480, 320)
NO_AUG = dict(jitter=None, flip=0.0, dtype="uint8", layout="NHWC")


# ---------------------------------------------------------------- data and running


@pytest.fixture(scope="module")
def photos(imagenet_mini: Path) -> list[Path]:
    """Eight ImageNet-mini JPEGs of mixed sizes, the same every run."""
    files = sorted(imagenet_mini.glob("*/*.jpg"))
    return files[::6][:8]


@pytest.fixture(scope="module")
def same_shape_photos(imagenet_mini: Path) -> list[Path]:
    """Six JPEGs of SAME_SHAPE: one aspect ratio, so a full-image crop is one fixed ``ratio``."""
    files = [f for f in sorted(imagenet_mini.glob("*/*.jpg")) if Image.open(f).size == SAME_SHAPE]
    assert len(files) >= 6, f"sample data changed: expected at least six {SAME_SHAPE} photos"
    return files[:6]


@pytest.fixture(scope="module")
def rgba_pngs(coco_mini: Path) -> list[Path]:
    """The coco-mini PNGs, all RGBA."""
    files = sorted((coco_mini / "images").glob("*.png"))
    assert files and all(Image.open(f).mode == "RGBA" for f in files), "sample data changed: expected RGBA PNGs"
    return files


def encoded(files: list[Path]) -> list[np.ndarray]:
    return [np.fromfile(f, dtype=np.uint8) for f in files]


def run_spec(spec: PipelineSpec, data: list[np.ndarray], *, seed: int = 42) -> tuple[list[np.ndarray], list[int]]:
    """Run one batch of ``data`` (encoded files) through ``spec`` on the CPU: images and labels."""
    images, labels, _, _ = run_spec_batch(spec, data, device="cpu", seed=seed)
    return images, labels


def val_reference(path: Path | bytes, *, size: int, resize: int) -> np.ndarray:
    """torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` with PIL, as torchvision computes them.

    The longer side is ``int(long * resize / short)`` (truncated), the whole image is resized
    onto that, and the crop starts ``int(round((n - size) / 2))`` pixels in, Python's round
    (halves to even). ``tests/test_eval_crop.py`` checks every margin of that offset.
    """
    img = Image.open(io.BytesIO(path) if isinstance(path, bytes) else path).convert("RGB")
    width, height = img.size
    if width <= height:
        width, height = resize, int(resize * height / width)
    else:
        width, height = int(resize * width / height), resize
    top, left = int(round((height - size) / 2)), int(round((width - size) / 2))
    return np.asarray(img.resize((width, height), Image.BILINEAR))[top : top + size, left : left + size]


def assert_close_interp(out: np.ndarray, ref: np.ndarray, *, max_diff: int, mean_diff: float) -> None:
    diff = np.abs(out.astype(np.int16) - ref.astype(np.int16))
    assert diff.max() <= max_diff and diff.mean() <= mean_diff, (diff.max(), diff.mean())


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: ClassificationTrain(size=0), "size"),
        (lambda: ClassificationTrain(size=22.5), "size"),
        (lambda: ClassificationTrain(scale=(0.5, 0.2)), "scale"),
        (lambda: ClassificationTrain(scale=(0.0, 1.0)), "scale"),
        (lambda: ClassificationTrain(scale=(0.5, 1.5)), "scale"),
        (lambda: ClassificationTrain(scale=0.5), "scale"),
        (lambda: ClassificationTrain(ratio=(4 / 3, 3 / 4)), "ratio"),
        (lambda: ClassificationTrain(ratio=(0.75, float("inf"))), "ratio"),
        (lambda: ClassificationTrain(flip=1.5), "flip"),
        (lambda: ClassificationTrain(flip=True), "flip"),
        (lambda: ClassificationTrain(jitter=0.4), "jitter"),
        (lambda: ClassificationTrain(auto_augment="autoaugment"), "auto_augment"),
        (lambda: ClassificationTrain(dtype="float64"), "dtype"),
        (lambda: ClassificationTrain(layout="CHW"), "layout"),
        (lambda: ClassificationTrain(mean=(0.5, 0.5)), "mean"),
        (lambda: ClassificationTrain(std=(0.2, 0.0, 0.2)), "std"),
        (lambda: ClassificationTrain(decoder={"hw_decoder_load": 0.5}), "decoder"),
        (lambda: ClassificationVal(size=256, resize=224), "resize"),
        (lambda: ClassificationVal(resize=-1), "resize"),
        (lambda: ClassificationVal(std=(0.1, float("nan"), 0.1)), "std"),
        (lambda: ColorJitter(brightness=-0.1), "brightness"),
        (lambda: ColorJitter(hue=0.6), "hue"),
        (lambda: ColorJitter(contrast="0.4"), "contrast"),
        (lambda: DecoderHints(hw_decoder_load=1.5), "hw_decoder_load"),
        (lambda: DecoderHints(preallocate_width_hint=-1), "preallocate_width_hint"),
    ],
)
def test_bad_arguments_name_the_argument(make, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        make()


def test_specs_are_frozen_hashable_picklable_and_normalise_their_values():
    spec = ClassificationTrain(mean=[0.5, 0.5, 0.5], std=np.array([0.25, 0.25, 0.25]), scale=[0.2, 1])
    assert spec.mean == (0.5, 0.5, 0.5) and spec.std == (0.25, 0.25, 0.25) and spec.scale == (0.2, 1.0)
    assert pickle.loads(pickle.dumps(spec)) == spec and hash(spec) == hash(pickle.loads(pickle.dumps(spec)))
    with pytest.raises(FrozenInstanceError):
        spec.size = 128  # type: ignore[misc]
    with pytest.raises(TypeError):
        ClassificationTrain(224)  # type: ignore[misc]  # keyword-only, so no argument is misread


def test_defaults_and_contract():
    train, val = ClassificationTrain(), ClassificationVal()
    assert (train.size, train.scale, train.ratio, train.flip) == (224, (0.08, 1.0), (0.75, 4 / 3), 0.5)
    assert train.jitter == ColorJitter(0.4, 0.4, 0.4, 0.1)
    assert (val.size, val.resize) == (224, 256)
    for spec in (train, val):
        assert isinstance(spec, PipelineSpec)
        assert spec.required_fields == ("image", "label")
        assert (spec.mean, spec.std) == (IMAGENET_MEAN, IMAGENET_STD)
        assert spec.needs_conditionals is False
    assert ClassificationTrain(auto_augment="rand_augment").needs_conditionals is True


def test_color_jitter_ranges_follow_torchvision():
    jitter = ColorJitter(brightness=0.4, contrast=1.5, saturation=0.0, hue=0.1)
    assert jitter.brightness_range == pytest.approx((0.6, 1.4))
    assert jitter.contrast_range == pytest.approx((0.0, 2.5))  # clamped at 0, as torchvision does
    assert jitter.saturation_range == (1.0, 1.0)
    assert jitter.hue_degrees == pytest.approx((-36.0, 36.0))  # fraction of the wheel -> degrees
    assert not jitter.is_identity and ColorJitter(0, 0, 0, 0).is_identity


def test_build_rejects_bad_device_and_missing_fields(photos):
    pipe = Pipeline(batch_size=1, num_threads=1, device_id=None)
    with pipe:
        image = fn.external_source(source=lambda: encoded(photos[:1]), batch=True)
        with pytest.raises(ValueError, match="device"):
            ClassificationVal().build({"image": image, "label": image}, device="auto")
        with pytest.raises(ValueError, match="'label'"):
            ClassificationTrain().build({"image": image}, device="cpu")


def test_auto_augment_without_conditionals_says_what_to_enable(photos):
    pipe = Pipeline(batch_size=1, num_threads=1, device_id=None)
    with pipe:
        image = fn.external_source(source=lambda: encoded(photos[:1]), batch=True)
        label = fn.external_source(source=lambda: [np.array(0, np.int64)], batch=True)
        with pytest.raises(ValueError, match="enable_conditionals=True"):
            ClassificationTrain(auto_augment="trivial_augment").build({"image": image, "label": label}, device="cpu")


# ---------------------------------------------------------------- geometry


def test_val_matches_pil_resize_and_centre_crop(photos, rgba_pngs):
    files = photos[:6] + rgba_pngs[:2]
    images, labels = run_spec(ClassificationVal(size=224, resize=256, dtype="uint8", layout="NHWC"), encoded(files))
    assert labels == [10 + i for i in range(len(files))]  # the label passes through untouched
    for path, out in zip(files, images):
        assert out.shape == (224, 224, 3) and out.dtype == np.uint8
        # DALI and PIL both apply a triangle (antialiased bilinear) filter; they
        # differ only in fixed- vs floating-point accumulation and rounding, so
        # 2 levels at most. A one-pixel shift of the window costs far more on
        # these photos (mean > 2, max > 50).
        assert_close_interp(out, val_reference(path, size=224, resize=256), max_diff=2, mean_diff=0.5)


def test_val_other_sizes(photos):
    images, _ = run_spec(ClassificationVal(size=160, resize=200, dtype="uint8", layout="NHWC"), encoded(photos[:2]))
    for path, out in zip(photos[:2], images):
        assert_close_interp(out, val_reference(path, size=160, resize=200), max_diff=2, mean_diff=0.5)


def test_train_full_image_crop_is_the_resized_photo(same_shape_photos):
    width, height = SAME_SHAPE
    spec = ClassificationTrain(size=224, scale=(1.0, 1.0), ratio=(width / height,) * 2, **NO_AUG)
    images, _ = run_spec(spec, encoded(same_shape_photos))
    for path, out in zip(same_shape_photos, images):
        assert out.shape == (224, 224, 3)
        ref = np.asarray(Image.open(path).convert("RGB").resize((224, 224), Image.BILINEAR))
        # Inside, the same filter as above (+-2 levels plus JPEG ROI-decoding
        # noise). On the outermost pixels PIL renormalises the filter weights cut
        # off by the image edge while DALI repeats the edge pixel, so the border
        # is only held to the mean. A crop one pixel short gives mean >= 0.6.
        diff = np.abs(out.astype(np.int16) - ref.astype(np.int16))
        assert diff[1:-1, 1:-1].max() <= 4, diff[1:-1, 1:-1].max()
        assert diff.mean() <= 0.35, diff.mean()


@pytest.mark.parametrize("make", [lambda: ClassificationVal(antialias=1), lambda: ClassificationTrain(antialias="no")])
def test_antialias_must_be_a_bool(make):
    with pytest.raises(ValueError, match="antialias"):
        make()


def test_train_without_antialias_resizes_as_opencv_inter_linear(same_shape_photos):
    """``antialias=False`` is OpenCV's (Albumentations') bilinear; the default is PIL's antialiased one."""
    cv2 = pytest.importorskip("cv2", reason='OpenCV comes with the bench extra: pip install -e ".[bench]"')
    width, height = SAME_SHAPE
    full_crop = dict(size=224, scale=(1.0, 1.0), ratio=(width / height,) * 2, **NO_AUG)
    plain, _ = run_spec(ClassificationTrain(antialias=False, **full_crop), encoded(same_shape_photos[:3]))
    filtered, _ = run_spec(ClassificationTrain(**full_crop), encoded(same_shape_photos[:3]))
    for path, out, out_filtered in zip(same_shape_photos, plain, filtered):
        rgb = np.asarray(Image.open(path).convert("RGB"))
        ref = cv2.resize(rgb, (224, 224), interpolation=cv2.INTER_LINEAR)
        diff = np.abs(out.astype(np.int16) - ref.astype(np.int16))
        # The same 2x2 bilinear taps: rounding only (measured: max 1, mean 0.08 to 0.12 inside);
        # the antialiased output is 1.4 to 2.6 levels away on average, up to 79.
        assert diff[1:-1, 1:-1].max() <= 2 and diff.mean() <= 0.25, (diff.max(), diff.mean())
        assert np.abs(out_filtered.astype(np.int16) - ref.astype(np.int16)).mean() > 1.0


def test_val_without_antialias_resizes_as_opencv_inter_linear(same_shape_photos):
    cv2 = pytest.importorskip("cv2", reason='OpenCV comes with the bench extra: pip install -e ".[bench]"')
    width, height = SAME_SHAPE  # 480 x 320: shorter side to 160 is exactly half, the centre crop 40 px in
    spec = ClassificationVal(size=160, resize=160, antialias=False, dtype="uint8", layout="NHWC")
    images, _ = run_spec(spec, encoded(same_shape_photos[:2]))
    for path, out in zip(same_shape_photos, images):
        rgb = np.asarray(Image.open(path).convert("RGB"))
        ref = cv2.resize(rgb, (width // 2, height // 2), interpolation=cv2.INTER_LINEAR)[:, 40:200]
        assert_close_interp(out, ref, max_diff=2, mean_diff=0.25)


def gradient_png(width: int = 1024, height: int = 768) -> bytes:
    """A lossless image whose pixels say where they are: R = x / 4, G = y / 3."""
    x = np.arange(width) * 256 // width
    y = np.arange(height) * 256 // height
    rgb = np.zeros((height, width, 3), np.uint8)
    rgb[..., 0] = x[None, :]
    rgb[..., 1] = y[:, None]
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def crop_window(out: np.ndarray, width: int, height: int) -> tuple[float, float, float, float]:
    """Recover the crop window ``(x0, y0, w, h)`` from a resized crop of :func:`gradient_png`."""
    size = out.shape[1]
    centres = np.arange(size) + 0.5  # output pixel centres
    # Mean over the other axis removes the 8-bit steps' phase; a line fit over
    # all output pixels then gives the window to about a pixel.
    slope_x, icpt_x = np.polyfit(centres, out[..., 0].mean(axis=0) + 0.5, 1)
    slope_y, icpt_y = np.polyfit(centres, out[..., 1].mean(axis=1) + 0.5, 1)
    px_x, px_y = width / 256, height / 256
    return icpt_x * px_x, icpt_y * px_y, slope_x * size * px_x, slope_y * size * px_y


def test_train_random_crops_respect_scale_and_ratio():
    width, height = 1024, 768
    scale, ratio = (0.2, 0.5), (0.6, 1.6)
    spec = ClassificationTrain(size=128, scale=scale, ratio=ratio, **NO_AUG)
    images, _ = run_spec(spec, [np.frombuffer(gradient_png(width, height), np.uint8)] * 16, seed=3)
    windows = []
    for out in images:
        assert out.shape == (128, 128, 3)
        x0, y0, w, h = crop_window(out, width, height)
        windows.append((x0, y0, w, h))
        # Within ~1% (the window is recovered from 8-bit steps of 3-4 pixels).
        assert scale[0] * 0.98 <= w * h / (width * height) <= scale[1] * 1.02, (x0, y0, w, h)
        assert ratio[0] * 0.99 <= w / h <= ratio[1] * 1.01, (x0, y0, w, h)
        assert -2 <= x0 and x0 + w <= width + 2 and -2 <= y0 and y0 + h <= height + 2, (x0, y0, w, h)
    windows = np.array(windows)
    assert windows[:, 2].std() > 20 and windows[:, 0].std() > 20, "crops are not random"


def test_crop_window_recovery_is_sound():
    """The helper above finds a known window, so its checks can fail."""
    img = Image.open(io.BytesIO(gradient_png())).convert("RGB")
    out = np.asarray(img.resize((128, 128), Image.BILINEAR, box=(100, 50, 612, 434)))
    x0, y0, w, h = crop_window(out, 1024, 768)
    assert (x0, y0, w, h) == pytest.approx((100, 50, 512, 384), abs=3)


# ---------------------------------------------------------------- flip


def test_flip_one_is_the_exact_mirror_of_flip_zero(photos):
    data = encoded(photos)
    base = dict(jitter=None, dtype="float16", layout="NCHW")
    plain, _ = run_spec(ClassificationTrain(flip=0.0, **base), data, seed=5)
    mirrored, _ = run_spec(ClassificationTrain(flip=1.0, **base), data, seed=5)
    for a, b in zip(plain, mirrored):
        assert a.shape == (3, 224, 224)
        assert not np.array_equal(a, b)
        np.testing.assert_array_equal(b, a[..., ::-1])  # NCHW: width is the last axis


def test_flip_half_mirrors_some_images_and_not_others(same_shape_photos):
    data = encoded(same_shape_photos) * 2
    fixed = dict(
        scale=(1.0, 1.0), ratio=(SAME_SHAPE[0] / SAME_SHAPE[1],) * 2, jitter=None, dtype="uint8", layout="NHWC"
    )
    plain, _ = run_spec(ClassificationTrain(flip=0.0, **fixed), data, seed=9)
    coin, _ = run_spec(ClassificationTrain(flip=0.5, **fixed), data, seed=9)
    flipped = []
    for a, b in zip(plain, coin):
        if np.array_equal(a, b):
            flipped.append(False)
        else:
            np.testing.assert_array_equal(b, a[:, ::-1])  # NHWC: width is axis 1
            flipped.append(True)
    assert any(flipped) and not all(flipped), flipped


# ---------------------------------------------------------------- normalisation, dtype, layout


@pytest.mark.parametrize(
    "dtype, layout, atol",
    [
        # float32: the op computes (x - mean) * (1 / std) in float; 1e-5 is ~40 ulp at |x| < 3.
        ("float32", "NCHW", 1e-5),
        # float16: half an ulp is 2**-10 ~ 1e-3 for values in [2, 4); 2e-3 leaves room for
        # the float32 -> float16 cast after the float computation.
        ("float16", "NHWC", 2e-3),
    ],
)
def test_normalisation_dtype_and_layout(photos, dtype, layout, atol):
    data = encoded(photos[:4])
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    raw, _ = run_spec(ClassificationVal(mean=mean, std=std, dtype="uint8", layout="NHWC"), data)
    norm, _ = run_spec(ClassificationVal(mean=mean, std=std, dtype=dtype, layout=layout), data)
    for r, n in zip(raw, norm):
        assert r.dtype == np.uint8 and r.shape == (224, 224, 3)
        assert n.dtype == np.dtype(dtype)
        assert n.shape == ((3, 224, 224) if layout == "NCHW" else (224, 224, 3))
        expected = (r.astype(np.float64) - np.array(mean) * 255) / (np.array(std) * 255)
        if layout == "NCHW":
            expected = expected.transpose(2, 0, 1)
        np.testing.assert_allclose(n.astype(np.float64), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_train_uint8_output_is_the_unnormalised_float_output(photos, layout):
    """Same seed, same crop, flip and jitter: only the final normalisation differs."""
    data = encoded(photos[:4])
    raw, _ = run_spec(ClassificationTrain(dtype="uint8", layout=layout), data, seed=8)
    norm, _ = run_spec(ClassificationTrain(dtype="float32", layout="NHWC"), data, seed=8)
    mean, std = np.array(IMAGENET_MEAN) * 255, np.array(IMAGENET_STD) * 255
    for r, n in zip(raw, norm):
        assert r.dtype == np.uint8
        assert r.shape == ((3, 224, 224) if layout == "NCHW" else (224, 224, 3))
        hwc = r.transpose(1, 2, 0) if layout == "NCHW" else r
        # On the CPU the float output keeps the jittered pixels unrounded (uint8 is only
        # for the uint8 output), so the two may differ by half a level, never more.
        diff = np.abs(n - (hwc - mean) / std) * std
        assert diff.max() <= 0.5 + 1e-3, diff.max()
    assert max(r.max() for r in raw) > 200 and min(r.min() for r in raw) < 50  # 0..255, not normalised


def test_train_default_output_is_normalised_float32_nchw(photos):
    images, labels = run_spec(ClassificationTrain(), encoded(photos))
    assert labels == [10 + i for i in range(len(photos))]
    stacked = np.stack(images)
    assert stacked.dtype == np.float32 and stacked.shape == (len(photos), 3, 224, 224)
    # Normalised by ImageNet statistics: roughly zero-centred, unit-scale, bounded.
    lo = min((0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    hi = max((1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    assert lo - 1e-4 <= stacked.min() and stacked.max() <= hi + 1e-4
    assert abs(stacked.mean()) < 0.6 and 0.5 < stacked.std() < 1.6


# ---------------------------------------------------------------- colour jitter


def jitter_pair(photos: list[Path], jitter: ColorJitter) -> list[tuple[np.ndarray, np.ndarray]]:
    """(unjittered, jittered) uint8 images with the same deterministic full-image crop.

    Each photo goes in twice, so twelve independent draws: enough that a range
    half as wide as configured would show (all twelve landing in one half of the
    range has probability ~3e-3 over seeds; with the fixed seed it is fixed).
    """
    fixed = dict(scale=(1.0, 1.0), ratio=(SAME_SHAPE[0] / SAME_SHAPE[1],) * 2, flip=0.0, dtype="uint8", layout="NHWC")
    data = encoded(photos) * 2
    plain, _ = run_spec(ClassificationTrain(jitter=None, **fixed), data, seed=11)
    jittered, _ = run_spec(ClassificationTrain(jitter=jitter, **fixed), data, seed=11)
    return [(a.astype(np.float64), b.astype(np.float64)) for a, b in zip(plain, jittered)]


def test_brightness_only_scales_each_image_by_a_factor_in_range(same_shape_photos):
    factors = []
    for x, y in jitter_pair(same_shape_photos, ColorJitter(brightness=0.4, contrast=0, saturation=0, hue=0)):
        # Pixels that cannot clip at the largest factor (180 * 1.4 = 252).
        ok = (x >= 20) & (x <= 180)
        k = float(np.median(y[ok] / x[ok]))
        factors.append(k)
        assert 0.6 - 0.01 <= k <= 1.4 + 0.01
        assert 0.6 - 0.01 <= y.mean() / x.mean() <= 1.4 + 0.01  # the per-image mean ratio, too
        # It is a brightness change: every pixel is the same multiple (then clipped).
        residual = np.abs(y - np.clip(np.round(k * x), 0, 255))
        assert np.percentile(residual, 99) <= 1.0
    assert max(factors) - min(factors) > 0.4, f"factors do not span [0.6, 1.4]: {factors}"


def test_contrast_only_is_linear_around_mid_grey_with_factor_in_range(same_shape_photos):
    factors = []
    for x, y in jitter_pair(same_shape_photos, ColorJitter(brightness=0, contrast=0.4, saturation=0, hue=0)):
        ok = (y > 0) & (y < 255)
        slope, intercept = np.polyfit(x[ok], y[ok], 1)
        factors.append(slope)
        assert 0.6 - 0.01 <= slope <= 1.4 + 0.01
        # DALI scales contrast around mid-grey (documented on ColorJitter).
        if abs(1 - slope) > 0.05:
            assert intercept / (1 - slope) == pytest.approx(128, abs=3)
        # Every pixel follows the same line (then clipped): a contrast change, nothing else.
        assert np.percentile(np.abs(y - np.clip(np.round(slope * x + intercept), 0, 255)), 99) <= 1.0
    assert max(factors) - min(factors) > 0.4, f"factors do not span [0.6, 1.4]: {factors}"


def chroma_changes(photos: list[Path], jitter: ColorJitter) -> list[tuple[float, float]]:
    """Per photo, how ``jitter`` changed its colours: the median chroma ratio and hue turn (degrees) of its strongly
    coloured pixels. Asserts that luma is kept, as saturation and hue changes must (up to clipping)."""
    changes = []
    for x, y in jitter_pair(photos, jitter):
        assert np.abs(y @ LUMA - x @ LUMA).mean() <= 1.5
        before, after = x @ YIQ_I + 1j * (x @ YIQ_Q), y @ YIQ_I + 1j * (y @ YIQ_Q)  # chroma as a complex number
        strong = np.abs(before) > 10
        turn = after[strong] / before[strong]
        changes.append((float(np.median(np.abs(turn))), float(np.median(np.angle(turn, deg=True)))))
    return changes


def test_saturation_only_keeps_luma_and_scales_chroma_in_range(same_shape_photos):
    jitter = ColorJitter(brightness=0, contrast=0, saturation=0.4, hue=0)
    ratios = [ratio for ratio, _ in chroma_changes(same_shape_photos, jitter)]
    assert all(0.6 - 0.03 <= ratio <= 1.4 + 0.03 for ratio in ratios), ratios
    assert max(ratios) - min(ratios) > 0.4, f"factors do not span [0.6, 1.4]: {ratios}"


def test_hue_only_keeps_luma_and_rotates_within_range(same_shape_photos):
    angles = [
        angle
        for _, angle in chroma_changes(same_shape_photos, ColorJitter(brightness=0, contrast=0, saturation=0, hue=0.1))
    ]
    assert all(abs(angle) <= 36 + 2 for angle in angles), angles  # hue=0.1 of the wheel is 36 degrees
    assert max(angles) - min(angles) > 36, f"shifts do not span [-36, 36] degrees: {angles}"


def test_default_jitter_changes_colours_but_keeps_the_picture(same_shape_photos):
    for x, y in jitter_pair(same_shape_photos, ColorJitter()):
        assert not np.array_equal(x, y)
        # Same scene: the jittered luma still correlates strongly with the original.
        assert np.corrcoef((x @ LUMA).ravel(), (y @ LUMA).ravel())[0, 1] > 0.9


def test_float_output_jitter_stays_in_the_uint8_range(photos):
    """The CPU float path twists in float; it must still clamp to 0..255 like the uint8 twist."""
    data = encoded(photos[:6])
    strong = ColorJitter(brightness=0.9, contrast=0.9, saturation=0.9, hue=0.0)
    out, _ = run_spec(ClassificationTrain(jitter=strong, dtype="float32", layout="NHWC"), data, seed=3)
    mean, std = np.array(IMAGENET_MEAN) * 255, np.array(IMAGENET_STD) * 255
    pixels = np.concatenate([(o * std + mean).reshape(-1, 3) for o in out])
    # Without the clamp, factors up to 1.9 push bright pixels of these photos past 255.
    assert pixels.min() >= -1e-3 and pixels.max() <= 255 + 1e-3


# ---------------------------------------------------------------- determinism


def test_fixed_seed_repeats_and_other_seeds_differ(photos):
    data, spec = encoded(photos), ClassificationTrain(dtype="float16")
    first, _ = run_spec(spec, data, seed=123)
    again, _ = run_spec(spec, data, seed=123)
    other, _ = run_spec(spec, data, seed=124)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert sum(not np.array_equal(a, c) for a, c in zip(first, other)) >= len(data) - 1


def test_crops_alone_follow_the_pipeline_seed(photos):
    """With jitter and flip off, only the crop is random: it too must follow the seed."""
    data, spec = encoded(photos), ClassificationTrain(**NO_AUG)
    first, _ = run_spec(spec, data, seed=123)
    again, _ = run_spec(spec, data, seed=123)
    other, _ = run_spec(spec, data, seed=124)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert sum(not np.array_equal(a, c) for a, c in zip(first, other)) >= len(data) - 1


# ---------------------------------------------------------------- odd inputs


def greyscale_jpeg(path: Path) -> bytes:
    buf = io.BytesIO()
    Image.open(path).convert("L").save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_rgba_png_and_greyscale_jpeg_come_out_rgb(photos, rgba_pngs):
    grey = greyscale_jpeg(photos[0])
    data = [np.frombuffer(grey, np.uint8)] + encoded(rgba_pngs[:1] + photos[1:2])
    for spec in (ClassificationTrain(**NO_AUG), ClassificationVal(dtype="uint8", layout="NHWC")):
        images, _ = run_spec(spec, data)
        for out in images:
            assert out.shape == (224, 224, 3)
        grey_out = images[0]
        assert np.array_equal(grey_out[..., 0], grey_out[..., 1]) and np.array_equal(grey_out[..., 1], grey_out[..., 2])
    # The PNG's alpha is dropped, not blended: the colour channels match PIL's RGB view.
    assert_close_interp(images[1], val_reference(rgba_pngs[0], size=224, resize=256), max_diff=2, mean_diff=0.5)
    assert_close_interp(images[0], val_reference(grey, size=224, resize=256), max_diff=2, mean_diff=0.5)


# ---------------------------------------------------------------- auto-augment


@pytest.mark.parametrize("policy", ["rand_augment", "trivial_augment"])
def test_auto_augment_builds_and_runs_with_conditionals(same_shape_photos, policy, numba_resize):
    # With the Numba resize, the CPU default: the policies' operators need the layout its output is given.
    data = encoded(same_shape_photos)
    fixed = dict(
        scale=(1.0, 1.0),
        ratio=(SAME_SHAPE[0] / SAME_SHAPE[1],) * 2,
        dtype="uint8",
        layout="NCHW",
        flip=0.0,
        jitter=None,
    )
    plain, _ = run_spec(ClassificationTrain(**fixed), data, seed=2)
    augmented, labels = run_spec(ClassificationTrain(auto_augment=policy, **fixed), data, seed=2)
    assert labels == [10 + i for i in range(len(data))]
    for out in augmented:
        assert out.shape == (3, 224, 224) and out.dtype == np.uint8
    changed = sum(not np.array_equal(a, b) for a, b in zip(plain, augmented))
    assert changed >= len(data) // 2, f"{policy} changed only {changed} of {len(data)} images"
