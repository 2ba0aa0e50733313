"""Shared parts of the packed-input tests (WebDataset, TFRecord, Parquet, LMDB): the photos, the checks, a kill."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dali_pipes import open_store
from dali_pipes.cli.verify import verify_dataset


def photos(imagenet_mini: Path) -> list[tuple[str, bytes, int]]:
    """``(key, jpeg bytes, label)`` of the 47 real photos, the label being the index of the class folder."""
    classes = sorted(p.name for p in imagenet_mini.iterdir() if p.is_dir())
    files = sorted(p for p in imagenet_mini.glob("*/*") if p.is_file())
    return [(f"{f.parent.name}_{f.stem}", f.read_bytes(), classes.index(f.parent.name)) for f in files]


def assert_converted(out: Path, expected: list[tuple[str, bytes, int]]) -> None:
    """The dataset at ``out`` holds exactly ``expected`` in order: keys, images byte for byte, labels."""
    store = open_store(out)
    assert len(store) == len(expected)
    for i, (key, image, label) in enumerate(expected):
        sample = store[i]
        assert sample["key"].decode() == key, f"sample {i}"
        assert sample["image"] == image, f"sample {i} ({key}): the image bytes differ"
        assert sample["label"].dtype == np.int64 and int(sample["label"]) == label, f"sample {i} ({key})"
    assert verify_dataset(out, progress=False).ok


def assert_killed_conversion_resumes(kind: str, source: object, tmp_path: Path, *options: str, shards: int) -> None:
    """``convert KIND SOURCE OPTIONS``, killed in two workers once 3 of its ``shards`` are recorded, resumes in one
    worker to the shards of an uninterrupted run, byte for byte."""
    from test_resume import _kill_after_shards, _records

    from test_convert import run_cli, shard_digests

    run_cli("convert", kind, source, tmp_path / "reference", "--workers", "2", *options)
    out = tmp_path / "killed"
    _kill_after_shards(["convert", kind, source, out, "--workers", "2", *options], out, shards=3)
    assert 3 <= _records(out) < shards and not (out / "index.json").exists()
    proc = run_cli("convert", kind, source, out, "--workers", "1", *options)
    assert "kept from an earlier run" in proc.stdout
    assert shard_digests(out) == shard_digests(tmp_path / "reference")


def error_inputs(out: Path) -> dict[str, str]:
    """``errors.jsonl`` as ``{input: reason}``."""
    lines = (out / "errors.jsonl").read_text().splitlines()
    return {e["input"]: e["reason"] for e in map(json.loads, lines)}


class PhotoDataset:
    """A map-style dataset of image files, as a user writes one: paths in, ``{image, label, key}`` out.

    Importable by spawned worker processes (``tests/`` is on their path). Index ``fail_at`` raises.
    """

    def __init__(self, rows: list[tuple[str, str, int]], fail_at: int | None = None) -> None:
        self.rows = rows  # (key, path, label)
        self.fail_at = fail_at
        self.classes = [f"class-{i}" for i in range(10)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        if index == self.fail_at:
            raise OSError(f"cannot fetch sample {index}")
        key, path, label = self.rows[index]
        return {"image": Path(path).read_bytes(), "label": label, "key": key}


class CountedPickles(PhotoDataset):
    """A :class:`PhotoDataset` that counts how often this process pickles it (``CountedPickles.pickled``)."""

    pickled = 0

    def __getstate__(self) -> dict:
        CountedPickles.pickled += 1
        return dict(self.__dict__)
