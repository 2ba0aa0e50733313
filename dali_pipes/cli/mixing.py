"""``dali-pipes mixing``: the window a stream cache gives, and how well it mixes a dataset's labels in batches.

Streaming (``DataOptions(stream=StreamOptions(cache_limit=...))``) reads the partitioned order
(:mod:`dali_pipes.sampling.partitioned`): a node reads a window of ``W`` shards of each of the partitions it
reads together, the samples of a window shuffled, so a batch mixes the samples of a *node window*: as many
shards as the node's cache holds for its reads (:func:`~dali_pipes.sampling.node_room.node_window`, the
loader's own rule: ``--loaders`` loaders of the dataset may read on the node at once, each in its share).
A dataset written class by class then puts few classes in a batch. ``--cache-limit 40GiB`` says the node
window that cache gives and the shards fetched ahead, and the classes per batch and label entropy of the
order one node reads with it (its partitions as one node holds them) against a global shuffle;
``--windows`` measures other node windows, in shards. The dataset may be a folder or a URL: a URL's
labels are read shard by shard, one on disk at a time (:mod:`dali_pipes.cli.shard_labels`).
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
from dali_pipes.sampling.node_room import DEFAULT_LOADERS

DEFAULT_WINDOWS = (1, 2, 4, 8, 16)


def add_mixing(commands: argparse._SubParsersAction) -> None:
    """``dali-pipes mixing DATA [--windows W ...] [--batch-size B] [--field NAME] [--json]``."""
    p = commands.add_parser(
        "mixing", help="classes per batch of streaming's windowed shuffle, per node window, vs a global shuffle"
    )
    p.add_argument("dataset", type=dataset_arg, help="a dataset folder written by 'dali-pipes convert', or its URL")
    p.add_argument(
        "--cache-limit",
        type=size_flag("GB"),
        metavar="SIZE",
        help="the node's stream cache (StreamOptions(cache_limit=...)), e.g. 40GiB or 400GB (a bare number is GB, "
        "10**9 bytes, as train_imagenet's --stream-cache): measure the node window it gives",
    )
    p.add_argument(
        "--loaders",
        type=int,
        default=DEFAULT_LOADERS,
        help="loaders of the dataset that may read on a node at once, each in its share of the cache "
        f"(StreamOptions(loaders=...); default: {DEFAULT_LOADERS})",
    )
    p.add_argument(
        "--windows",
        type=int,
        nargs="+",
        metavar="W",
        help="other node windows to measure, in shards read at once (default without --cache-limit: "
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
    loaders: int = DEFAULT_LOADERS,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A JSON-ready report: the dataset's counts, the node window ``cache`` (bytes, the unit to show them in) gives
    when ``loaders`` loaders of the dataset read on the node, and one row per node window, then the global
    shuffle's."""
    from dali_pipes.cli.shard_labels import labels_and_shard_bytes
    from dali_pipes.remote.urls import redact

    windows = list(windows if windows is not None else ([] if cache else DEFAULT_WINDOWS))
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if windows and min(windows) < 1:
        raise ValueError(f"--windows must be shard counts of at least 1, got {windows}")
    if epoch < 0 or seed < 0 or loaders < 1:
        raise ValueError("--epoch and --seed must be at least 0, --loaders at least 1")

    windowed: list[dict[str, Any] | None] = [None]  # the cache's window, checked before a URL's labels are read

    def check_cache(shard_bytes: list[int]) -> None:
        windowed[0] = _stream_window(cache, shard_bytes, loaders) if cache else None

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
    """One row per node window in ``measured`` (the partitioned order one node reads with it), then the global
    shuffle's."""
    from dali_pipes.sampling.rules import epoch_order
    from dali_pipes.sampling.windowed import batch_mixing

    shards = len(sizes)
    rows = []
    for w in [*measured, "global"]:
        if w == "global":
            used, mix = shards, batch_mixing(labels, epoch_order(len(labels), epoch, seed), batch_size)
        else:
            used, order = _node_order(sizes, w, batch_size, epoch=epoch, seed=seed)
            mix = batch_mixing(labels, order, batch_size)
        rows.append({
            "window": w,
            "shards_per_window": used,
            "samples_per_window": round(len(labels) * used / shards, 1),
            "classes_per_batch": round(mix.distinct_classes, 2),
            "entropy_bits": round(mix.entropy_bits, 3),
            "batches": mix.batches,
        })  # fmt: skip
    return rows


def _node_order(sizes: list[int], node_window: int, batch_size: int, *, epoch: int, seed: int) -> tuple[int, Any]:
    """The shards one node reads at once with windows of ``node_window`` shards (on average: a partition's shards
    are cut into windows as even as they go, at most ``W`` each), and the samples it reads in ``epoch``, in order:
    the loader's partitioned order (its default partitions, one node of one rank; a rank of several reads a slice
    of each step of the same stream)."""
    from dali_pipes.sampling.partitioned import (
        NodeLayout,
        PartitionedSampling,
        default_partitions,
        node_window_spans,
        partition_window,
        partitioned_rank_indices,
    )

    partitions = default_partitions(sizes)
    window, together = partition_window(node_window, partitions, 1)
    sampling = PartitionedSampling(sizes, window, partitions)
    layout = NodeLayout(1, 1, batch_size, "pad", together)
    indices, is_pad = partitioned_rank_indices(sampling, layout, 0, 0, epoch, seed)
    spans = node_window_spans(sampling, layout, 0, epoch, seed)
    held = round(sum(len(s.shards) for s in spans) / len(spans) * together)
    return min(held, len(sizes)), indices[~is_pad]


def _stream_window(cache: tuple[int, str], shard_bytes: list[int], loaders: int) -> dict[str, Any]:
    """The node window, shards fetched ahead and the bytes a loader's reads may pin in a node's cache of ``cache``
    bytes read by ``loaders`` loaders (:func:`~dali_pipes.sampling.node_room.node_window`); a cache too small is
    refused in the flags' words."""
    from dali_pipes.dataset.sizes import format_size
    from dali_pipes.sampling.node_room import least_cache_limit, node_window

    limit, unit = cache
    try:
        plan = node_window(limit, shard_bytes, loaders)
    except ValueError:  # node_window's one refusal without a fetch_ahead, said here in the flags' words
        raise ValueError(
            f"--cache-limit {format_size(limit, unit)} read by --loaders {loaders} leaves "
            f"{format_size(limit // loaders, unit)} a loader, less than three of the dataset's largest shard "
            f"({format_size(max(shard_bytes), unit, up=True)}: two windows of one shard and one read outside them); "
            f"give --cache-limit {format_size(least_cache_limit(shard_bytes, loaders), unit, up=True)} or more"
            + (", or --loaders 1 when one loader of the dataset reads on the node" if loaders > 1 else "")
        ) from None
    return {
        "cache_limit": limit,
        "cache_limit_shown": format_size(limit, unit),
        "loaders": loaders,
        "read_room_shown": format_size(plan.read_room, unit),
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
            f"a stream cache of {stream['cache_limit_shown']} a node, read by {counted(stream['loaders'], 'loader')} "
            f"at once ({stream['read_room_shown']} for each one's reads): a node window of "
            f"{counted(stream['window'], 'shard')} (a window of each partition the node reads together), "
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
        loaders=args.loaders,
        storage_options=storage_options(args),
    )
    print(json.dumps(report, indent=2) if args.json else format_mixing(report))
    return 0
