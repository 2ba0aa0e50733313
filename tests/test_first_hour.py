"""What a new user hit in the first hour (issue 39): every failure says why in one line, and leaves nothing behind."""

from __future__ import annotations

import shutil

import pytest

from dali_pipes.cli import main


@pytest.fixture
def folder(tmp_path, imagenet_mini):
    """Two class folders of real photos."""
    root = tmp_path / "photos"
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for photo in sorted(imagenet_mini.glob("*/*.jpg"))[:2]:
            shutil.copy(photo, root / name / photo.name)
    return root


def _spoil(path):
    path.write_bytes(path.read_bytes()[:200])  # a truncated JPEG


def test_when_every_input_fails_the_reasons_are_shown_and_no_output_is_left(folder, tmp_path, capsys):
    for photo in folder.glob("*/*.jpg"):
        _spoil(photo)
    out = tmp_path / "out"
    assert main(["convert", "imagefolder", str(folder), str(out), "--workers", "1", "--allow-empty-classes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "all 4 inputs failed: 4 x " in err[0] and "(e.g. " in err[0], err
    assert "Traceback" not in err[0] and "see the messages above" not in err[0]
    assert not out.exists()  # the job made the folder: nothing half-made stays


def test_a_class_whose_files_are_all_bad_is_refused_with_the_reason(folder, tmp_path, capsys):
    for photo in (folder / "a").glob("*.jpg"):
        _spoil(photo)
    assert main(["convert", "imagefolder", str(folder), str(tmp_path / "out"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    first = sorted(p.name for p in (folder / "a").glob("*.jpg"))[0]
    assert "class folder 'a' holds no image" in err and f"a/{first}: " in err and "--allow-empty-classes" in err


def test_an_output_path_that_is_a_file_is_one_line_naming_it(folder, tmp_path, capsys):
    taken = tmp_path / "afile"
    taken.write_text("mine")
    for out in (taken, taken / "below"):
        assert main(["convert", "imagefolder", str(folder), str(out), "--workers", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(out) in err[0] and "must be a folder" in err[0], err
    assert taken.read_text() == "mine"


def test_load_manifest_takes_a_url_as_every_dataset_path_does(tmp_path, s3):
    """The README's 20-line script on s3://: load_manifest reads the manifest there (it once folded s3:// into s3:/)."""
    from test_remote_stage import upload

    import dali_pipes

    from loader_helpers import write_dataset

    source = write_dataset(tmp_path / "src", 9, samples_per_shard=4)
    url = upload(s3, source)
    remote = dali_pipes.load_manifest(url, storage_options=s3.options)
    assert remote == dali_pipes.load_manifest(source) and remote.num_samples == 9
    with pytest.raises(dali_pipes.RemoteError, match="no-such"):
        dali_pipes.load_manifest(f"{url}-no-such", storage_options=s3.options)
