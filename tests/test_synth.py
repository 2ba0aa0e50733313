"""The synthetic ImageNet-like image folder: layout, sizes, determinism, photo-likeness, class signal."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from converters.base import ConversionError
from converters.sources import ImageFolderSource
from converters.synth import image_path, make_imagefolder, parse_size, render


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _grey(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("L"), dtype=np.float64)


def _lag1_correlation(grey: np.ndarray) -> float:
    """Correlation of each pixel with its right-hand neighbour: about 0 for noise, near 1 for photos."""
    return float(np.corrcoef(grey[:, :-1].ravel(), grey[:, 1:].ravel())[0, 1])


@pytest.fixture(scope="module")
def default_set(tmp_path_factory) -> Path:
    """12 images of the default size (500x375, quality 90) in 3 classes."""
    return make_imagefolder(tmp_path_factory.mktemp("synth") / "train", 12, classes=3, workers=1)


def test_layout_names_and_dimensions(default_set):
    files = _files(default_set)
    expected = {f"class_{i % 3:03d}/img_{i:06d}.jpg" for i in range(12)}
    assert set(files) == expected  # no temporary files left behind
    assert image_path(default_set, 7, 3) == default_set / "class_001" / "img_000007.jpg"
    for data in files.values():
        with Image.open(io.BytesIO(data)) as im:
            assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (500, 375))


def test_sizes_are_those_of_imagenet_photos(default_set):
    sizes = [len(data) for data in _files(default_set).values()]
    assert all(60_000 <= s <= 110_000 for s in sizes), sizes


def test_images_are_not_noise(default_set):
    rng = np.random.default_rng(0)
    noise = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (375, 500, 3), dtype=np.uint8)).save(noise, format="JPEG", quality=90)
    noise_size = len(noise.getvalue())
    for data in _files(default_set).values():
        assert len(data) < 0.5 * noise_size
        grey = _grey(data)
        assert _lag1_correlation(grey) > 0.75
        # Not flat either: real contrast and texture.
        assert grey.std() > 10
    assert abs(_lag1_correlation(_grey(noise.getvalue()))) < 0.1


def test_same_seed_same_bytes_whatever_the_workers(tmp_path):
    # 40 images make three chunks, so two workers really split the work.
    one = make_imagefolder(tmp_path / "one", 40, size=(64, 48), classes=4, seed=3, workers=1)
    two = make_imagefolder(tmp_path / "two", 40, size=(64, 48), classes=4, seed=3, workers=2)
    other = make_imagefolder(tmp_path / "other", 40, size=(64, 48), classes=4, seed=4, workers=1)
    a, b, c = _files(one), _files(two), _files(other)
    assert len(a) == 40 and a == b
    assert a.keys() == c.keys() and all(a[k] != c[k] for k in a)
    # A re-run over a finished folder rewrites the same files.
    make_imagefolder(one, 40, size=(64, 48), classes=4, seed=3, workers=1)
    assert _files(one) == a


def test_classes_are_distinguishable():
    classes, per_class = 5, 4
    features, labels = [], []
    for i in range(classes * per_class):
        pixels = np.asarray(render(i, (128, 96), classes, seed=11), dtype=np.float64).reshape(-1, 3)
        mean = pixels.mean(axis=0)
        features.append(mean / mean.sum())  # chromaticity: the class palette, not the brightness
        labels.append(i % classes)
    x, y = np.array(features), np.array(labels)
    correct = 0
    for k in range(len(y)):  # leave-one-out nearest class centroid
        others = np.arange(len(y)) != k
        centroids = np.array([x[others & (y == c)].mean(axis=0) for c in range(classes)])
        correct += int(np.argmin(((centroids - x[k]) ** 2).sum(axis=1)) == y[k])
    assert correct / len(y) >= 0.8


def test_output_reads_as_an_image_folder(tmp_path):
    root = make_imagefolder(tmp_path / "set", 6, size=(40, 30), classes=4, workers=1)
    source = ImageFolderSource(root)
    assert source.classes() == ["class_000", "class_001", "class_002", "class_003"]
    samples = [source.load(item) for item in source.items()]
    assert [int(s["label"]) for s in samples] == [0, 0, 1, 1, 2, 3]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ConversionError, match="--num"):
        make_imagefolder(tmp_path / "a", 0)
    with pytest.raises(ConversionError, match="--classes"):
        make_imagefolder(tmp_path / "a", 4, classes=0)
    with pytest.raises(ConversionError, match="too small"):
        make_imagefolder(tmp_path / "a", 4, size=(4, 4))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="not a folder"):
        make_imagefolder(tmp_path / "file", 4)


def test_parse_size():
    assert parse_size("500x375") == (500, 375)
    assert parse_size(" 64X48 ") == (64, 48)
    for bad in ("500", "0x10", "axb", "500x375x3"):
        with pytest.raises(ConversionError, match="WIDTHxHEIGHT"):
            parse_size(bad)


# --- crops of real photos (benchmark data that decodes like photographs) -------------------


def test_photo_crops_are_distinct_whole_crops_in_their_photos_classes(tmp_path, imagenet_mini):
    from converters.photo_crops import make_photo_crops, photo_paths

    photos = photo_paths(imagenet_mini)
    out = make_photo_crops(tmp_path / "crops", len(photos) + 5, size=(200, 150), workers=1)
    files = _files(out)
    assert len(files) == len(photos) + 5 and all(name.endswith(".jpg") for name in files)
    for i, photo in enumerate(photos[:3]):
        name = f"{photo.parent.name}/crop_{i:06d}.jpg"  # crop i comes from photo i % len(photos)
        with Image.open(io.BytesIO(files[name])) as crop:
            assert crop.size == (200, 150)
    # Photo 0 gives crops 0 and len(photos): other zooms, windows or flips, not the same bytes.
    first = photos[0].parent.name
    assert files[f"{first}/crop_000000.jpg"] != files[f"{first}/crop_{len(photos):06d}.jpg"]
    assert all(_lag1_correlation(_grey(data)) > 0.8 for data in list(files.values())[:5])  # photographs, not noise
    assert len(ImageFolderSource(out).items()) == len(photos) + 5


def test_photo_crops_repeat_whatever_the_workers_and_refuse_a_folder_without_photos(tmp_path, imagenet_mini):
    from converters.photo_crops import make_photo_crops

    one = _files(make_photo_crops(tmp_path / "one", 70, workers=1))
    two = _files(make_photo_crops(tmp_path / "two", 70, workers=2))
    assert one == two
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(ConversionError, match="no photos found"):
        make_photo_crops(tmp_path / "x", 4, photos=tmp_path / "empty")


def test_synth_photos_cli(tmp_path, capsys):
    from dali_pipes.cli import main

    assert main(["synth", str(tmp_path / "c"), "--num", "3", "--size", "64x48", "--photos", "--workers", "1"]) == 0
    assert "3 crops of real photos" in capsys.readouterr().out
    crops = sorted((tmp_path / "c").glob("*/crop_*.jpg"))
    assert len(crops) == 3 and all(Image.open(p).size == (64, 48) for p in crops)


def test_fewer_photo_crops_than_photos_leave_no_empty_class_folder(tmp_path, imagenet_mini):
    # `synth DIR --num 40 --photos` with 47 sample photos: the classes of the 7 photos not drawn must not appear as
    # empty folders, which `convert imagefolder` (and `demo --data`) refuses.
    from converters.photo_crops import make_photo_crops, photo_paths

    photos = photo_paths(imagenet_mini)
    out = make_photo_crops(tmp_path / "crops", 10, size=(64, 48), workers=1)
    folders = [p for p in out.iterdir() if p.is_dir()]
    assert folders and all(any(folder.iterdir()) for folder in folders)
    assert len(folders) == len({p.parent.name for p in photos[:10]})
    assert len(ImageFolderSource(out).items()) == 10
