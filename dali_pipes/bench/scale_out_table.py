"""The scale-out suite's figures: from what each rank read (:mod:`dali_pipes.bench.scale_out_rank`) to a row.

:func:`row_figures` turns the rank results of one row (one loader, one node count) into:

- ``bytes_per_node`` and ``bytes_total`` per epoch, each also as a multiple of the dataset's shard bytes
  (``per_node_x``: the most any node downloaded; ``total_x``: all nodes together), counted by each simulated
  node's own latency proxy (the answers' bytes, HTTP headers included, index files and retries too);
- ``shards_downloaded`` per epoch where the cache's log tells it (this package's loader);
- ``classes_per_batch``: the distinct labels of a rank's full batch, the mean over all ranks and epochs,
  against ``global_classes`` (:func:`global_classes`: a global permutation of the same labels cut in batches of
  the same size), and their ratio;
- ``images_per_s`` per epoch: the images all ranks read over the slowest rank's seconds;
- ``cache_peak_x``: the largest node's cache peak over its limit;
- ``exactly_once`` per epoch: every sample read once across all ranks (``missing`` and ``repeated`` counts).

:func:`format_table` makes the markdown table; everything here is pure (numbers in, numbers out).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def global_classes(labels: Sequence[int], batch_size: int, epochs: int = 1, seed: int = 0) -> float:
    """Mean distinct labels a batch of ``batch_size`` of a global permutation of ``labels``, over ``epochs``."""
    from dali_pipes.sampling.rules import epoch_order
    from dali_pipes.sampling.windowed import batch_mixing

    values = [
        batch_mixing(labels, epoch_order(len(labels), e, seed), batch_size).distinct_classes for e in range(epochs)
    ]
    return float(np.mean(values))


def once(indices: Sequence[Sequence[int]], num_samples: int) -> dict[str, Any]:
    """Whether the ranks' ``indices`` of one epoch hold every sample of ``range(num_samples)`` exactly once."""
    counts = np.bincount(np.concatenate([np.asarray(i, np.int64) for i in indices]), minlength=num_samples)
    missing, repeated = int((counts == 0).sum()), int((counts > 1).sum())
    ok = missing == 0 and repeated == 0 and len(counts) == num_samples
    return {"ok": ok, "missing": missing, "repeated": repeated}


def _by_node(ranks: list[dict[str, Any]], epoch: int, key: str) -> dict[int, int]:
    """Per node, the figure ``key`` of ``epoch`` summed over its ranks that report it."""
    out: dict[int, int] = {}
    for rank in ranks:
        value = rank["epochs"][epoch][key]
        if value is not None:
            out[rank["node"]] = out.get(rank["node"], 0) + int(value)
    return out


def row_figures(ranks: list[dict[str, Any]], dataset_bytes: int, num_samples: int, global_mean: float) -> dict:
    """The figures of one row (see the module docstring) from its ranks' results."""
    epochs = min(len(rank["epochs"]) for rank in ranks)
    nodes = sorted({rank["node"] for rank in ranks})
    per_epoch = []
    for e in range(epochs):
        per_node = _by_node(ranks, e, "bytes")
        shards = _by_node(ranks, e, "shards")
        images = sum(rank["epochs"][e]["images"] for rank in ranks)
        seconds = max(rank["epochs"][e]["seconds"] for rank in ranks)
        per_epoch.append(
            {
                "bytes_per_node": [per_node.get(n) for n in nodes],
                "bytes_total": sum(per_node.values()),
                "per_node_x": max(per_node.values()) / dataset_bytes if per_node else None,
                "total_x": sum(per_node.values()) / dataset_bytes,
                "shards_downloaded": sum(shards.values()) if shards else None,
                "images": images,
                "images_per_s": images / seconds if seconds > 0 else None,
                "exactly_once": once([rank["epochs"][e]["indices"] for rank in ranks], num_samples),
            }
        )
    classes = [c for rank in ranks for epoch in rank["epochs"][:epochs] for c in epoch["classes"]]
    mean = float(np.mean(classes)) if classes else None
    peaks = [(r["peak"], r["limit"]) for r in ranks if r.get("peak") is not None and r.get("limit")]
    return {
        "nodes": len(nodes),
        "ranks": len(ranks),
        "epochs": per_epoch,
        "classes_per_batch": mean,
        "global_classes": global_mean,
        "classes_x": mean / global_mean if mean is not None and global_mean else None,
        "cache_peak_x": max(p / limit for p, limit in peaks) if peaks else None,
        "window": next((r["window"] for r in ranks if r.get("window")), None),
    }


def _xs(values: list[float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in values)


def _row_cells(row: dict[str, Any]) -> list[str]:
    f = row["figures"]
    epochs = f["epochs"]
    ok = all(e["exactly_once"]["ok"] for e in epochs)
    worst = max(epochs, key=lambda e: e["exactly_once"]["missing"] + e["exactly_once"]["repeated"])["exactly_once"]
    return [
        row["name"],
        f"{f['nodes']}x{f['ranks'] // f['nodes']}",
        _xs([e["per_node_x"] for e in epochs]),
        _xs([e["total_x"] for e in epochs]),
        "-" if f["classes_per_batch"] is None else f"{f['classes_per_batch']:.1f} ({f['classes_x']:.2f}x)",
        " / ".join("-" if e["images_per_s"] is None else f"{e['images_per_s']:,.0f}" for e in epochs),
        "-" if f["cache_peak_x"] is None else f"{f['cache_peak_x']:.2f}",
        "yes" if ok else f"no ({worst['missing']} missing, {worst['repeated']} repeated)",
    ]


def format_table(rows: list[dict[str, Any]], global_mean: float, batch_size: int) -> str:
    """The markdown table of the suite's ``rows`` (each ``{"name", "figures"}`` or ``{"name", "error"}``)."""
    head = [
        "row",
        "nodes x ranks",
        "downloaded a node, epoch 1 / 2 (x data)",
        "all nodes, epoch 1 / 2 (x data)",
        f"classes a batch of {batch_size} (x global {global_mean:.1f})",
        "images/s, epoch 1 / 2",
        "cache peak / limit",
        "exactly once",
    ]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 3) + " --- |"]
    for row in rows:
        if row.get("figures") is None:
            cells = [row["name"], row.get("layout", "-"), f"not run: {row.get('error') or row.get('skipped')}"]
            cells += [""] * (len(head) - len(cells))
        else:
            cells = _row_cells(row)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_lines(rows: list[dict[str, Any]], name: str) -> list[str]:
    """Issue 55's goals, checked on the rows named ``name`` (this package's default conversion): at the most nodes,
    all nodes together download at most 1.05x the dataset an epoch on average over the epochs measured (the next
    epoch's first windows, fetched ahead across the edge, count in the epoch before), every sample once; each row's
    batches hold at least 0.9x the classes of a global permutation."""
    measured = [row for row in rows if row["name"] == name and row.get("figures")]
    if not measured:
        return [f"goals: no measured row of {name}"]
    widest = max(measured, key=lambda row: row["figures"]["nodes"])
    f = widest["figures"]
    totals = [e["total_x"] for e in f["epochs"]]
    once_ok = all(e["exactly_once"]["ok"] for e in f["epochs"])
    mixing = min(row["figures"]["classes_x"] for row in measured)
    mean = sum(totals) / len(totals)
    return [
        f"goal: {widest['layout']}, all nodes download <= 1.05x an epoch and each sample once: "
        f"{_xs(totals)}x ({mean:.2f}x on average), {'exactly once' if once_ok else 'NOT exactly once'} -> "
        f"{'met' if once_ok and mean <= 1.05 else 'not met'}",
        f"goal: classes a batch >= 0.9x a global permutation's: {mixing:.2f}x at the least -> "
        f"{'met' if mixing >= 0.9 else 'not met'}",
    ]


__all__ = ["format_table", "global_classes", "goal_lines", "once", "row_figures"]
