"""``dali-pipes mixing``: the window a stream cache gives, and how well it mixes a dataset's labels in batches.

Streaming (``DataOptions(stream=StreamOptions(cache_limit=...))``) shuffles samples within windows of
shards (:mod:`dali_pipes.sampling.windowed`), as many shards a window as fit in a rank's share of the
node's cache (:func:`~dali_pipes.sampling.windowed.rank_window`, the loader's own rule). A dataset
written class by class then puts few classes in a batch. ``--cache-limit 40GiB --node-ranks 8`` says
the window that cache gives each rank, and its classes per batch and label entropy against a global
shuffle (:func:`~dali_pipes.sampling.windowed.compare_mixing`); ``--windows`` measures other window sizes.
The dataset may be a folder or a URL: a URL's labels are read shard by shard, one on disk at a time
(:mod:`dali_pipes.cli.shard_labels`).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Mapping

from dali_pipes.cli.remote_args import add_storage_options, dataset_arg, storage_options
from dali_pipes.cli.words import counted
from dali_pipes.dataset.sample_order import order_line
from dali_pipes.dataset.sizes import size_flag

DEFAULT_WINDOWS = (1, 2, 4, 8, 16)


def add_mixing(commands: argparse._SubParsersAction) -> None:
    """``dali-pipes mixing DATA [--windows W ...] [--batch-size B] [--field NAME] [--json]``."""
    p = commands.add_parser(
        "mixing", help="classes per batch of streaming's windowed shuffle, per window size, vs a global shuffle"
    )
    p.add_argument("dataset", type=dataset_arg, help="a dataset folder written by 'dali-pipes convert', or its URL")
    p.add_argument(
        "--cache-limit",
        type=size_flag("GB"),
        metavar="SIZE",
        help="the node's stream cache (StreamOptions(cache_limit=...)), e.g. 40GiB or 400GB (a bare number is GB, "
        "10**9 bytes, as train_imagenet's --stream-cache): measure the window it gives each rank",
    )
    p.add_argument("--node-ranks", type=int, default=1, help="the ranks of a node sharing the cache (default: 1)")
    p.add_argument(
        "--windows",
        type=int,
        nargs="+",
        metavar="W",
        help="other window sizes to measure, in shards (default without --cache-limit: "
        f"{' '.join(map(str, DEFAULT_WINDOWS))})",
    )
    p.add_argument("--batch-size", type=int, default=256, help="per-rank batch size (default: 256)")
    p.add_argument("--field", default="label", help="the label field, a fixed-shape integer array (default: label)")
    p.add_argument("--epoch", type=int, default=0, help="the epoch whose order is measured (default: 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    add_storage_options(p)
    p.set_defaults(handler=_mixing)


def measure_mixing(
    dataset: Any,
    windows: list[int] | None,
    batch_size: int,
    *,
    field: str = "label",
    epoch: int = 0,
    seed: int = 0,
    cache: tuple[int, str] | None = None,
    node_ranks: int = 1,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A JSON-ready report: the dataset's counts, the window ``cache`` (bytes, the unit to show them in) gives one
    of ``node_ranks`` ranks, and one row per window size, then the global shuffle's."""
    from dali_pipes.cli.shard_labels import labels_and_shard_bytes
    from dali_pipes.remote.urls import redact

    windows = list(windows if windows is not None else ([] if cache else DEFAULT_WINDOWS))
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if windows and min(windows) < 1:
        raise ValueError(f"--windows must be shard counts of at least 1, got {windows}")
    if epoch < 0 or seed < 0 or node_ranks < 1:
        raise ValueError("--epoch and --seed must be at least 0, --node-ranks at least 1")

    windowed: list[dict[str, Any] | None] = [None]  # the cache's window, checked before a URL's labels are read

    def check_cache(shard_bytes: list[int]) -> None:
        windowed[0] = _stream_window(cache, shard_bytes, node_ranks) if cache else None

    manifest, labels, _ = labels_and_shard_bytes(dataset, field, storage_options, check_cache)
    stream = windowed[0]
    sizes = [s.num_samples for s in manifest.shards]
    shards = len(sizes)
    measured = ([stream["window"]] if stream else []) + [w for w in windows if not stream or w != stream["window"]]
    rows = _mixing_rows(labels, sizes, batch_size, measured, epoch=epoch, seed=seed)
    return {
        "path": redact(str(dataset), storage_options),
        "field": field,
        "num_samples": int(len(labels)),
        "num_shards": shards,
        "num_classes": int(len(set(labels.tolist()))),
        "batch_size": batch_size,
        "max_entropy_bits": round(math.log2(min(batch_size, len(labels))), 3),
        "epoch": epoch,
        "seed": seed,
        "order": order_line(manifest.order),  # how convert wrote the samples (shuffled or in source order)
        "stream": stream,
        "rows": rows,
    }


def _mixing_rows(labels: Any, sizes: list[int], batch_size: int, measured: list[int], *, epoch: int, seed: int) -> list:
    """One row per window size in ``measured``, then the global shuffle's."""
    from dali_pipes.sampling.windowed import compare_mixing

    shards = len(sizes)
    results = compare_mixing(labels, sizes, batch_size, measured, epoch=epoch, seed=seed)
    rows = []
    for w, (key, mix) in zip([*measured, shards], results.items()):
        used = min(w, shards)
        rows.append({
            "window": "global" if key == "global" else w,
            "shards_per_window": used,
            "samples_per_window": round(len(labels) * used / shards, 1),
            "classes_per_batch": round(mix.distinct_classes, 2),
            "entropy_bits": round(mix.entropy_bits, 3),
            "batches": mix.batches,
        })  # fmt: skip
    return rows


def _stream_window(cache: tuple[int, str], shard_bytes: list[int], node_ranks: int) -> dict[str, Any]:
    """The window, shards fetched ahead and bytes of one of ``node_ranks`` ranks sharing a cache of ``cache`` bytes
    (:func:`~dali_pipes.sampling.windowed.rank_window`); a cache too small is refused in the flags' words."""
    from dali_pipes.dataset.sizes import format_size
    from dali_pipes.sampling.windowed import rank_window

    limit, unit = cache
    try:
        plan = rank_window(limit, shard_bytes, node_ranks)
    except ValueError:  # rank_window's one refusal for a positive limit: less than two largest shards a rank
        least = format_size(2 * max(shard_bytes) * node_ranks, unit, up=True)
        raise ValueError(
            f"--cache-limit {format_size(limit, unit)} over --node-ranks {node_ranks} leaves "
            f"{format_size(limit // node_ranks, unit)} a rank, less than two of the dataset's largest shard "
            f"({format_size(max(shard_bytes), unit, up=True)}); give --cache-limit {least} or more"
        ) from None
    return {
        "cache_limit": limit,
        "cache_limit_shown": format_size(limit, unit),
        "node_ranks": node_ranks,
        "rank_share_shown": format_size(limit // node_ranks, unit),
        "window": plan.window,
        "fetched_ahead": plan.ahead,
    }


def format_mixing(report: dict[str, Any]) -> str:
    """The table of :func:`measure_mixing`'s report."""
    lines = [
        f"{report['path']}: {counted(report['num_samples'], 'sample')} in {counted(report['num_shards'], 'shard')}, "
        f"{counted(report['num_classes'], 'class')} of {report['field']!r}; batches of {report['batch_size']} "
        f"(entropy at most {report['max_entropy_bits']:.2f} bits), epoch {report['epoch']}, seed {report['seed']}",
    ]
    lines[0] += f"; {report['order']}"  # shuffled or in source order, from the manifest
    stream = report.get("stream")
    if stream:
        lines.append(
            f"a stream cache of {stream['cache_limit_shown']} over {counted(stream['node_ranks'], 'rank')} a node: "
            f"{stream['rank_share_shown']} a rank, a window of {counted(stream['window'], 'shard')} and "
            f"{stream['fetched_ahead']} fetched ahead (the first row)"
        )
    lines.append(f"{'window':>8}  {'shards':>6}  {'samples':>9}  {'classes/batch':>13}  {'entropy (bits)':>14}")
    for row in report["rows"]:
        lines.append(
            f"{row['window']!s:>8}  {row['shards_per_window']:>6}  {row['samples_per_window']:>9,.0f}  "
            f"{row['classes_per_batch']:>13.1f}  {row['entropy_bits']:>14.2f}"
        )
    return "\n".join(lines)


def _mixing(args) -> int:
    report = measure_mixing(
        args.dataset,
        args.windows,
        args.batch_size,
        field=args.field,
        epoch=args.epoch,
        seed=args.seed,
        cache=args.cache_limit,
        node_ranks=args.node_ranks,
        storage_options=storage_options(args),
    )
    print(json.dumps(report, indent=2) if args.json else format_mixing(report))
    return 0
