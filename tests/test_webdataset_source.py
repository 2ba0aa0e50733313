"""``convert webdataset``: tar shards written by ``tarfile`` and by the ``webdataset`` package, read in place."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packed_helpers import assert_converted, assert_killed_conversion_resumes, error_inputs, photos

from converters.base import ConversionError
from converters.runner import convert
from converters.sources import WebDatasetSource
from converters.synth import make_imagefolder
from dali_pipes import open_store
from dali_pipes.dataset.manifest import load_manifest

from test_convert import run_cli


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A plain tar written by Python's ``tarfile``, members in the order given."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return path


def sample_members(key: str, image: bytes, label: int, ext: str = "jpg") -> list[tuple[str, bytes]]:
    return [(f"{key}.{ext}", image), (f"{key}.cls", str(label).encode())]


@pytest.fixture(scope="module")
def tars(imagenet_mini, tmp_path_factory) -> tuple[list[Path], list]:
    """The 47 photos in three tars: two by ``tarfile``, the last by ``webdataset.TarWriter``."""
    folder = tmp_path_factory.mktemp("wds")
    expected = photos(imagenet_mini)
    paths = []
    for n, part in enumerate((expected[:20], expected[20:35])):
        members = [m for key, image, label in part for m in sample_members(key, image, label)]
        paths.append(write_tar(folder / f"train-{n:06d}.tar", members))
    wds = pytest.importorskip("webdataset")
    with wds.TarWriter(str(folder / "train-000002.tar")) as sink:
        for key, image, label in expected[35:]:
            sink.write({"__key__": key, "jpg": image, "cls": label, "json": {"key": key}})
    paths.append(folder / "train-000002.tar")
    return paths, expected


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_tars_convert_byte_for_byte_into_shards_of_the_target_size(tars, tmp_path, fmt):
    paths, expected = tars
    classes = tmp_path / "classes.txt"
    classes.write_text("".join(f"class-{i}\n" for i in range(10)))
    pattern = str(paths[0].parent / "train-{000000..000002}.tar")
    run_cli("convert", "webdataset", pattern, tmp_path / "out", "--format", fmt, "--classes", classes, "--no-progress")
    assert_converted(tmp_path / "out", expected)
    manifest = load_manifest(tmp_path / "out")
    assert [s.num_samples for s in manifest.shards] == [47]  # 47 small samples fill one automatic shard of three tars
    assert manifest.classes[3] == "class-3"
    assert "json" in manifest.fields  # the webdataset tar's .json members are kept, empty where there is none
    store = open_store(tmp_path / "out")
    with tarfile.open(paths[2]) as tar:
        written = {key: tar.extractfile(f"{key}.json").read() for key, _, _ in expected[35:]}
    assert all(written.values())
    assert [store[i]["json"] for i in range(len(expected))] == [b""] * 35 + list(written.values())


def test_bad_members_are_listed_and_the_rest_converted(imagenet_mini, tmp_path):
    (key, image, label), *rest = photos(imagenet_mini)[:6]
    members = [
        *sample_members("truncated", image[: len(image) // 2], 1),
        *sample_members("badlabel", image, 0)[:1],
        ("badlabel.cls", b"seven"),
        ("nolabel.jpg", image),
        ("noimage.cls", b"2"),
        *(m for k, i, lab in rest for m in sample_members(k, i, lab)),
    ]
    tar = write_tar(tmp_path / "mixed.tar", members)
    result = convert(WebDatasetSource([tar]), tmp_path / "out", format="hdf5", workers=1, progress=False)
    assert_converted(tmp_path / "out", rest)
    errors = error_inputs(tmp_path / "out")
    assert set(errors) == {f"{tar}:{k}" for k in ("truncated", "badlabel", "nolabel", "noimage")}
    assert "truncated" in errors[f"{tar}:truncated"]
    assert "not an integer" in errors[f"{tar}:badlabel"]
    assert ".cls" in errors[f"{tar}:nolabel"] and "no image" in errors[f"{tar}:noimage"]
    assert len(result.errors) == 4


def test_compressed_or_missing_tars_are_refused_clearly(tmp_path):
    with pytest.raises(ConversionError, match="no such tar shard"):
        WebDatasetSource([tmp_path / "missing-{0..3}.tar"]).items()
    gz = tmp_path / "train.tar.gz"
    with tarfile.open(gz, "w:gz") as tar:
        tar.addfile(tarfile.TarInfo("a.cls"), io.BytesIO(b""))
    with pytest.raises(ConversionError, match="decompress it first"):
        WebDatasetSource([gz]).items()


def test_source_pickles_without_the_plan_of_every_tar(tars):
    import pickle

    paths, _ = tars
    source = WebDatasetSource(paths)
    items = source.items()
    small = len(pickle.dumps(source))
    assert small < 2000 and len(pickle.dumps(items)) > 10 * small
    assert pickle.loads(pickle.dumps(source)).fields() == source.fields()


def photo_parts(root: Path, seed: int) -> list[list[Path]]:
    """160 synthetic photos of 4 classes in 16 runs of 10, one packed file each: the input of a killed conversion."""
    images = make_imagefolder(root / "images", 160, size=(96, 64), classes=4, seed=seed)
    files = sorted(p for p in images.glob("*/*") if p.is_file())
    return [files[n * 10 : (n + 1) * 10] for n in range(16)]


@pytest.mark.timeout(300)
def test_killed_conversion_resumes_to_identical_output(tmp_path):
    for n, part in enumerate(photo_parts(tmp_path, seed=5)):
        write_tar(tmp_path / f"s-{n:02d}.tar", [(f"{f.stem}.jpg", f.read_bytes()) for f in part])
    # 7 samples a shard: most shards span two tars of 10, and each task reads them one after the other.
    options = ("--label-ext", "", "--format", "tfrecord", "--samples-per-shard", "7", "--no-progress")
    assert_killed_conversion_resumes("webdataset", str(tmp_path / "s-{00..15}.tar"), tmp_path, *options, shards=23)
    assert (tmp_path / "killed" / "index.json").read_bytes() == (tmp_path / "reference" / "index.json").read_bytes()


def test_on_error_fail_names_the_member_and_keeps_nothing(imagenet_mini, tmp_path):
    (key, image, label), *rest = photos(imagenet_mini)[:4]
    members = [m for k, i, lab in rest for m in sample_members(k, i, lab)] + [
        ("late.jpg", image[:500]),
        ("late.cls", b"1"),
    ]
    tar = write_tar(tmp_path / "t.tar", members)
    proc = run_cli("convert", "webdataset", tar, tmp_path / "out", "--on-error", "fail", "--no-progress", check=False)
    assert proc.returncode != 0 and f"{tar}:late" in proc.stderr and "nothing was kept" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_damaged_tar_keeps_the_samples_before_and_lists_the_damage(imagenet_mini, tmp_path):
    expected = photos(imagenet_mini)[:4]
    tar = write_tar(tmp_path / "t.tar", [m for k, i, lab in expected for m in sample_members(k, i, lab)])
    data = tar.read_bytes()
    with tarfile.open(tar) as t:
        third = t.getmember(f"{expected[2][0]}.jpg").offset  # the header of sample 2's image
    cases = {
        "garbage": data[:third] + b"x" * 512 + data[third + 512 :],  # tarfile alone stops here silently
        "cut": data[: third + 100],
        "no-end": data[:third],
    }
    for name, damaged in cases.items():
        path = tmp_path / f"{name}.tar"
        path.write_bytes(damaged)
        convert(WebDatasetSource([path]), tmp_path / name, format="lmdb", workers=1, progress=False)
        assert_converted(tmp_path / name, expected[:2])
        errors = error_inputs(tmp_path / name)
        assert list(errors) == [f"{path}:byte {third}"], name
        assert f"from byte {third} on cannot be read" in errors[f"{path}:byte {third}"]


_LOW_FILE_LIMIT = r"""
import os, resource, sys
from pathlib import Path
from converters.base import ConversionError
from converters.runner import convert
from converters.sources import WebDatasetSource
from converters.sources._inputs import OpenFiles

folder = Path(sys.argv[1])
tars = sorted(folder.glob("*.tar"))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
result = convert(WebDatasetSource(tars), folder / "out", format="hdf5", workers=1, progress=False)
print("errors", len(result.errors))
# Out of file descriptors: the job stops; no sample is blamed for it.
hog = []
try:
    while True:
        hog.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    OpenFiles().read(str(tars[0]), 0, 10, "first")
except ConversionError as exc:
    print("fatal", exc)
"""


def test_many_tars_with_one_worker_stay_within_the_open_file_limit(imagenet_mini, tmp_path):
    # One source serves every shard of a one-worker run: keeping each tar open ran past `ulimit -n`,
    # and every read past it was left out as a bad sample.
    key, image, label = photos(imagenet_mini)[0]
    for n in range(80):
        write_tar(tmp_path / f"part-{n:03d}.tar", sample_members(f"{key}-{n}", image, label))
    child = subprocess.run(
        [sys.executable, "-c", _LOW_FILE_LIMIT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert "errors 0" in child.stdout
    assert "fatal " in child.stdout and "part-000.tar" in child.stdout and "ulimit -n" in child.stdout
    assert len(open_store(tmp_path / "out")) == 80
