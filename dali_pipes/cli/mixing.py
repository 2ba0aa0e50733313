"""``dali-pipes mixing``: how well streaming's windowed order mixes a dataset's labels in batches.

Streaming (``DataOptions(stream=StreamOptions(cache_limit=...))``) shuffles samples within windows of ``W``
shards (:mod:`dali_pipes.sampling.windowed`); a dataset written class by class then puts few classes
in a batch. This command reads the dataset's labels (one fixed-shape field, ``label`` unless told)
and its shard sizes from the manifest, and prints, per window size, the classes per batch and the
label entropy of a batch, against a global shuffle (:func:`~dali_pipes.sampling.windowed.compare_mixing`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from dali_pipes.cli.words import counted

DEFAULT_WINDOWS = (1, 2, 4, 8, 16)


def add_mixing(commands: argparse._SubParsersAction) -> None:
    """``dali-pipes mixing DATA [--windows W ...] [--batch-size B] [--field NAME] [--json]``."""
    p = commands.add_parser(
        "mixing", help="classes per batch of streaming's windowed shuffle, per window size, vs a global shuffle"
    )
    p.add_argument("dataset", help="a dataset folder written by 'dali-pipes convert'")
    p.add_argument(
        "--windows",
        type=int,
        nargs="+",
        default=list(DEFAULT_WINDOWS),
        metavar="W",
        help=f"shards per window to measure (default: {' '.join(map(str, DEFAULT_WINDOWS))})",
    )
    p.add_argument("--batch-size", type=int, default=256, help="per-rank batch size (default: 256)")
    p.add_argument("--field", default="label", help="the label field, a fixed-shape integer array (default: label)")
    p.add_argument("--epoch", type=int, default=0, help="the epoch whose order is measured (default: 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(handler=_mixing)


def measure_mixing(
    dataset: Path, windows: list[int], batch_size: int, *, field: str = "label", epoch: int = 0, seed: int = 0
) -> dict[str, Any]:
    """A JSON-ready report: the dataset's counts and one row per window size, then the global shuffle's."""
    from dali_pipes.sampling.windowed import compare_mixing
    from dali_pipes.stores import open_store

    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if not windows or min(windows) < 1:
        raise ValueError(f"--windows must be shard counts of at least 1, got {windows}")
    if epoch < 0 or seed < 0:
        raise ValueError("--epoch and --seed must be at least 0")
    store = open_store(dataset)
    try:
        if field not in store.manifest.fields:
            raise ValueError(
                f"{dataset}: no field {field!r} (fields: {', '.join(store.manifest.fields)}); name one with --field"
            )
        labels = store.column(field)
    finally:
        store.close()
    if labels.ndim != 1 or labels.dtype.kind not in "iub":
        raise ValueError(f"{dataset}: field {field!r} is not one integer a sample (dtype {labels.dtype}, "
                         f"shape {labels.shape[1:]}); name the label field with --field")  # fmt: skip
    sizes = np.array([s.num_samples for s in store.manifest.shards], dtype=np.int64)
    shards = len(sizes)
    results = compare_mixing(labels, sizes, batch_size, windows, epoch=epoch, seed=seed)
    rows = []
    for w, (key, mix) in zip([*windows, shards], results.items()):
        used = min(w, shards)
        rows.append({
            "window": "global" if key == "global" else w,
            "shards_per_window": used,
            "samples_per_window": round(len(labels) * used / shards, 1),
            "classes_per_batch": round(mix.distinct_classes, 2),
            "entropy_bits": round(mix.entropy_bits, 3),
            "batches": mix.batches,
        })  # fmt: skip
    return {
        "path": str(dataset),
        "field": field,
        "num_samples": int(len(labels)),
        "num_shards": shards,
        "num_classes": int(len(np.unique(labels))),
        "batch_size": batch_size,
        "max_entropy_bits": round(math.log2(min(batch_size, len(labels))), 3),
        "epoch": epoch,
        "seed": seed,
        "rows": rows,
    }


def format_mixing(report: dict[str, Any]) -> str:
    """The table of :func:`measure_mixing`'s report."""
    lines = [
        f"{report['path']}: {counted(report['num_samples'], 'sample')} in {counted(report['num_shards'], 'shard')}, "
        f"{counted(report['num_classes'], 'class')} of {report['field']!r}; batches of {report['batch_size']} "
        f"(entropy at most {report['max_entropy_bits']:.2f} bits), epoch {report['epoch']}, seed {report['seed']}",
        f"{'window':>8}  {'shards':>6}  {'samples':>9}  {'classes/batch':>13}  {'entropy (bits)':>14}",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['window']!s:>8}  {row['shards_per_window']:>6}  {row['samples_per_window']:>9,.0f}  "
            f"{row['classes_per_batch']:>13.1f}  {row['entropy_bits']:>14.2f}"
        )
    return "\n".join(lines)


def _mixing(args) -> int:
    from dali_pipes.remote.urls import is_url

    if is_url(args.dataset):
        raise ValueError(f"{args.dataset}: mixing reads a local dataset folder; stage it first (dali-pipes stage)")
    report = measure_mixing(
        Path(args.dataset), args.windows, args.batch_size, field=args.field, epoch=args.epoch, seed=args.seed
    )
    print(json.dumps(report, indent=2) if args.json else format_mixing(report))
    return 0
