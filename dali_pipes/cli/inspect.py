"""``dali-pipes inspect``: a summary of a dataset, for people (text) or machines (JSON)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from dali_pipes.dataset.manifest import ERRORS_NAME, human_bytes, load_manifest
from dali_pipes.remote.urls import is_url, redact

_SHOWN_CLASSES = 8
_SHOWN_SHARDS = 10


def summarize(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-ready summary: format, counts, sizes, fields, classes, source, shards and errors.

    ``path`` may be a URL of object storage: its manifest and ``errors.jsonl`` are read over the network, as a
    read-only look (:data:`~dali_pipes.remote.fs.LOOK`): a server that does not answer is reported within
    seconds, naming its endpoint, instead of being waited out as a job would.
    """
    if is_url(path):
        from dali_pipes.remote.dataset import load_remote_manifest, read_errors
        from dali_pipes.remote.fs import LOOK

        manifest, _ = load_remote_manifest(str(path), storage_options, LOOK)
        errors = read_errors(str(path), storage_options, LOOK)
        where = redact(path, storage_options)
    else:
        root = Path(path)
        manifest = load_manifest(root)
        errors_file = root / ERRORS_NAME
        errors = errors_file.read_text().splitlines() if errors_file.exists() else []
        where = str(root)
    total_bytes = sum(s.bytes for s in manifest.shards)
    return {
        "path": where,
        "format": manifest.format,
        "version": manifest.version,
        "created_by": manifest.created_by,
        "num_samples": manifest.num_samples,
        "num_shards": len(manifest.shards),
        "bytes": total_bytes,
        "bytes_per_sample": total_bytes / manifest.num_samples if manifest.num_samples else 0,
        "fields": {name: f.to_json() for name, f in manifest.fields.items()},
        "classes": list(manifest.classes) if manifest.classes is not None else None,
        "source": {k: v for k, v in manifest.source.items() if k != "job"},
        "shards": [s.to_json() for s in manifest.shards],
        **_left_out(errors),
    }


def _left_out(errors: list[str]) -> dict[str, int]:
    """Inputs left out, and parts of kept inputs left out (a degenerate COCO polygon: its image is kept)."""
    entries = [_entry(line) for line in errors if line.strip()]
    parts = sum(1 for entry in entries if entry.get("part"))
    return {"inputs_left_out": len(entries) - parts, "parts_left_out": parts}


def _entry(line: str) -> dict[str, Any]:
    """One line of errors.jsonl; a line that is not a JSON object counts as an input left out, as before."""
    try:
        entry = json.loads(line)
    except ValueError:
        return {}
    return entry if isinstance(entry, dict) else {}


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable form of :func:`summarize`'s result."""
    lines = [
        f"dataset   {summary['path']}",
        f"format    {summary['format']} (manifest v{summary['version']}, {summary['created_by'] or 'unknown writer'})",
        f"samples   {summary['num_samples']:,} in {summary['num_shards']} shard(s), "
        f"{human_bytes(summary['bytes'])} ({human_bytes(summary['bytes_per_sample'])} per sample)",
        "fields",
    ]
    for name, spec in summary["fields"].items():
        if spec["kind"] == "bytes":
            lines.append(f"  {name:<12} bytes ({spec['encoding']})")
        else:
            shape = "(" + ", ".join("N" if s == -1 else str(s) for s in spec["shape"]) + ")"
            lines.append(f"  {name:<12} {spec['dtype']} {shape}")
    classes = summary["classes"]
    if classes is not None:
        shown = ", ".join(classes[:_SHOWN_CLASSES]) + (", ..." if len(classes) > _SHOWN_CLASSES else "")
        lines.append(f"classes   {len(classes)}: {shown}")
    source = summary["source"]
    lines.append("source    " + ", ".join(f"{k}={v}" for k, v in source.items()))
    lines.append(
        f"left out  {summary['inputs_left_out']} input(s)"
        + (f" and {summary['parts_left_out']} part(s) of kept inputs" if summary["parts_left_out"] else "")
        + (f" (see {ERRORS_NAME})" if summary["inputs_left_out"] or summary["parts_left_out"] else "")
    )
    lines.append("shards")
    for shard in summary["shards"][:_SHOWN_SHARDS]:
        index = f" + {shard['index_path']}" if shard["index_path"] else ""
        lines.append(f"  {shard['path']}{index}: {shard['num_samples']:,} samples, {human_bytes(shard['bytes'])}")
    if len(summary["shards"]) > _SHOWN_SHARDS:
        lines.append(f"  ... and {len(summary['shards']) - _SHOWN_SHARDS} more")
    return "\n".join(lines)


def summary_json(path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> str:
    """The summary as indented JSON."""
    return json.dumps(summarize(path, storage_options=storage_options), indent=1)


__all__ = ["summarize", "format_summary", "summary_json"]
