"""``dali-pipes mixing``: on a dataset converted class by class, bigger windows put more classes in a batch."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import pytest

from test_convert import run_cli  # noqa: E402 - shared helpers


def test_bigger_windows_mix_more_and_the_global_shuffle_is_last(tmp_path):
    images, shards = tmp_path / "images", tmp_path / "shards"
    run_cli("synth", images, "--num", "240", "--classes", "12", "--size", "16x16", "--workers", "1")
    # Class folders converted in their order (not the default shuffle): 24 shards of 10 samples, each of one class.
    run_cli("convert", "imagefolder", images, shards, "--samples-per-shard", "10", "--workers", "1", "--no-progress",
            "--order", "source")  # fmt: skip

    report = json.loads(run_cli("mixing", shards, "--windows", "1", "4", "24", "--batch-size", "16", "--json").stdout)
    assert (report["num_samples"], report["num_shards"], report["num_classes"]) == (240, 24, 12)
    rows = report["rows"]
    assert [r["window"] for r in rows] == [1, 4, 24, "global"]
    assert [r["shards_per_window"] for r in rows] == [1, 4, 24, 24]
    classes = [r["classes_per_batch"] for r in rows]
    entropy = [r["entropy_bits"] for r in rows]
    assert classes[0] < classes[1] < classes[2] and entropy[0] < entropy[1] < entropy[2], rows
    assert classes[0] <= 3  # a batch of 16 spans at most 3 one-class shards of 10
    assert classes[3] > classes[1] and all(r["batches"] == 15 for r in rows), rows
    assert report["max_entropy_bits"] == 4.0 and max(entropy) <= 4.0

    table = run_cli("mixing", shards, "--windows", "1", "4", "--batch-size", "16").stdout.splitlines()
    assert "240 samples in 24 shards, 12 classes of 'label'; batches of 16" in table[0], table
    assert table[1].split() == ["window", "shards", "samples", "classes/batch", "entropy", "(bits)"], table
    assert [line.split()[0] for line in table[2:]] == ["1", "4", "global"], table


def test_a_missing_field_is_one_line(tmp_path):
    images, shards = tmp_path / "images", tmp_path / "shards"
    run_cli("synth", images, "--num", "4", "--classes", "2", "--size", "16x16", "--workers", "1")
    run_cli("convert", "imagefolder", images, shards, "--workers", "1", "--no-progress")
    proc = run_cli("mixing", shards, "--field", "klass", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "no field 'klass'" in proc.stderr and "--field" in proc.stderr, proc.stderr
    proc = run_cli("mixing", shards, "--windows", "0", check=False)
    assert proc.returncode != 0 and "--windows must be" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def by_class(tmp_path_factory) -> Path:
    """120 images of 6 classes converted class by class: 12 LMDB shards of 10, each of one class."""
    from converters.runner import convert
    from converters.sources import ImageFolderSource
    from converters.synth import make_imagefolder

    root = tmp_path_factory.mktemp("by-class")
    images = make_imagefolder(root / "images", 120, size=(16, 16), classes=6, seed=0, workers=1)
    convert(ImageFolderSource(images), root / "shards", format="lmdb", workers=1, progress=False, samples_per_shard=10,
            order="source")  # fmt: skip
    return root / "shards"


def mixing(capsys, *args) -> str:
    from dali_pipes.cli.command import main

    assert main(["mixing", *map(str, args)]) == 0
    return capsys.readouterr().out


@pytest.mark.slow  # a conversion of 120 images, and each shard downloaded once
def test_a_url_and_a_cache_limit_give_the_loaders_window_and_its_mixing(
    by_class, s3, tmp_path, monkeypatch, capsys, caplog
):
    from test_remote_stage import upload

    from dali_pipes.dataset.manifest import load_manifest
    from dali_pipes.dataset.sizes import format_size
    from dali_pipes.sampling.node_room import node_window

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where the shards pass through, one at a time
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    url = upload(s3, by_class)
    options = [f"--storage-option={key}={value}" for key, value in s3.options.items() if isinstance(value, str)]
    largest = max(s.bytes for s in load_manifest(by_class).shards)
    limit = f"{16 * largest // 1000}KB"  # 8 largest shards a loader of 2
    common = ["--cache-limit", limit, "--loaders", "2", "--batch-size", "16", "--json"]
    remote = json.loads(mixing(capsys, url, *common, *options))
    local = json.loads(mixing(capsys, by_class, *common))
    expected = node_window(16 * largest // 1000 * 1000, [s.bytes for s in load_manifest(by_class).shards], 2)
    assert remote["stream"]["window"] == expected.window == local["stream"]["window"] > 1
    assert remote["stream"]["fetched_ahead"] == expected.ahead and remote["stream"]["cache_limit_shown"] == limit
    assert remote["rows"] == local["rows"] and [r["window"] for r in remote["rows"]] == [expected.window, "global"]
    assert (
        remote["num_classes"] == 6 and remote["rows"][0]["classes_per_batch"] < remote["rows"][1]["classes_per_batch"]
    )
    assert list((tmp_path / "tmp").iterdir()) == []  # the shards read went as they came
    caplog.set_level(logging.INFO, logger="dali_pipes.cli.shard_labels")
    table = mixing(capsys, url, "--cache-limit", limit, *options).splitlines()  # --loaders 2 by default
    total = sum(s.bytes + ((by_class / s.index_path).stat().st_size if s.index_path else 0)
                for s in load_manifest(by_class).shards)  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    assert any(f"downloading {format_size(total, 'GB')} ({total:,} bytes)" in m for m in said), said
    assert said.index(next(m for m in said if "downloading" in m)) < said.index(
        next(m for m in said if "reading the label of shard 1 of 12" in m)
    )
    caplog.clear()  # a cache too small for 2 loaders is refused from the manifest's sizes, before any download
    from dali_pipes.cli.command import main

    assert main(["mixing", url, "--cache-limit", f"{5 * largest}B", "--loaders", "2", *options]) != 0
    assert "read by --loaders 2 leaves" in capsys.readouterr().err  # 2.5 largest shards a loader, 3 needed
    assert not [r for r in caplog.records if "reading the label" in r.getMessage() or "downloading" in r.getMessage()]
    assert table[1].startswith(f"a stream cache of {limit} a node, read by 2 loaders at once") and (
        f"a node window of {expected.window} shards" in table[1]
    ), table
    assert s3.options["secret"] not in "".join(table)


@pytest.mark.slow  # the conversion of by_class
def test_a_cache_limit_below_three_shards_a_loader_is_one_line_in_its_own_words(by_class, capsys):
    from dali_pipes.cli.command import main

    assert main(["mixing", str(by_class), "--cache-limit", "1KB", "--loaders", "8"]) != 0
    err = capsys.readouterr().err
    assert "--cache-limit 1KB read by --loaders 8 leaves" in err and "give --cache-limit" in err, err
    assert "--loaders 1" in err and len(err.strip().splitlines()) == 1 and "StreamOptions" not in err, err
