"""The scale-out suite's data: a class-ordered image folder of photo crops, written three ways.

- :func:`make_image_folder`: ``images`` JPEG crops of the package's sample photos
  (:func:`converters.photo_crops.make_photo_crops`), dealt round-robin into ``classes`` folders
  ``c000``, ``c001``, ...: an ImageNet-like folder, which a converter reads class after class;
- :func:`convert_both`: ``dali-pipes convert imagefolder`` with its defaults (the samples in a seeded shuffled
  order) and with ``--order source`` (class after class), ``--samples-per-shard`` as the plan says;
- :func:`write_mds`: the same files as MosaicML Streaming's MDS shards of about the same bytes, class after
  class, written by the peer's own Python (:mod:`dali_pipes.bench.scale_out_mds`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The two conversions: the name of each copy, and the flags added to ``dali-pipes convert imagefolder``.
ORDERS: dict[str, tuple[str, ...]] = {"shuffled": (), "source": ("--order", "source")}


def make_image_folder(out: Path, images: int, classes: int, size: tuple[int, int], seed: int = 0) -> Path:
    """``out`` as ``classes`` folders of ``images`` photo crops of ``size`` in all (see the module docstring)."""
    from converters.photo_crops import make_photo_crops

    if classes < 1 or images < classes:
        raise ValueError(f"scale-out: need at least one image a class, got {images} images for {classes} classes")
    raw = out.with_name(out.name + ".crops")
    shutil.rmtree(raw, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    make_photo_crops(raw, images, size=size, seed=seed, workers=1)
    crops = sorted(raw.glob("*/*.jpg"), key=lambda p: p.name)  # crop_000000.jpg ...: their index
    for i, crop in enumerate(crops):
        folder = out / f"c{i % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        crop.rename(folder / crop.name)
    shutil.rmtree(raw)
    return out


def labels_of(images: Path) -> list[int]:
    """Each image's label (its sorted folder's position), class after class: the multiset a permutation draws from."""
    folders = sorted(p for p in images.iterdir() if p.is_dir())
    return [label for label, folder in enumerate(folders) for f in folder.iterdir() if f.is_file()]


def convert_both(images: Path, out: Path, plan: Any) -> dict[str, Path]:
    """``images`` converted by ``dali-pipes convert imagefolder`` once per :data:`ORDERS`, ``plan.samples_per_shard``
    a shard: ``{"ours-ORDER": folder}``."""
    done = {}
    for order, flags in ORDERS.items():
        dest = out / f"ours-{order}"
        shutil.rmtree(dest, ignore_errors=True)
        command = [sys.executable, "-m", "dali_pipes", "convert", "imagefolder", str(images), str(dest)]
        command += ["--samples-per-shard", str(plan.samples_per_shard), "--workers", "1", "--no-progress", *flags]
        _run(command, f"dali-pipes convert ({order})")
        done[dest.name] = dest
    return done


def write_mds(python: str, images: Path, out: Path, size_limit: int) -> str:
    """``images`` as MDS shards of at most ``size_limit`` bytes in ``out``, written by ``python``; Streaming's version."""
    shutil.rmtree(out, ignore_errors=True)
    command = [python, "-m", "dali_pipes.bench.scale_out_mds", "write", str(images), str(out), str(size_limit)]
    return _run(command, "the MDS writer").strip().splitlines()[-1]


def folder_bytes(folder: Path, suffix: str) -> int:
    """Bytes of the files in ``folder`` whose names end in ``suffix``."""
    return sum(p.stat().st_size for p in folder.rglob(f"*{suffix}") if p.is_file())


def _run(command: list[str], what: str) -> str:
    """Run ``command`` (with this tree first on the path, as the parent has it); its output, or a one-line error."""
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ), timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"scale-out: {what} failed (exit {done.returncode}): {last}")
    return done.stdout


__all__ = ["ORDERS", "convert_both", "folder_bytes", "labels_of", "make_image_folder", "write_mds"]
