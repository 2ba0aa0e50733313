"""A benchmark's result as a terminal table, a JSON file and a bar chart.

:class:`BenchReport` is what every suite returns: its rows, the context the
rows share (dataset, batch size, cores, augmentation) and the machine. The
machine description extends the conversion benchmark's
(:func:`converters.bench.machine_description`) with torch, DALI, CUDA and the GPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dali_pipes.bench.runner import Row
from dali_pipes.dataset.fileio import atomic_write_json

log = logging.getLogger(__name__)


def machine_description() -> dict[str, Any]:
    """Cores, CPU, OS, library versions, and the GPU (or ``None``) that the figures come from."""
    import torch

    from converters.bench import machine_description as base

    machine = base()
    machine["torch"] = torch.__version__
    try:
        import nvidia.dali

        machine["dali"] = nvidia.dali.__version__
    except ImportError:
        machine["dali"] = None
    machine["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        machine["gpu"] = {
            "name": props.name,
            "memory_gb": round(props.total_memory / 1e9, 1),
            "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
        }
    else:
        machine["gpu"] = None
    for name in ("albumentations", "cv2", "torchvision", "matplotlib"):
        machine[name] = _version(name)
    return machine


def _version(module: str) -> str | None:
    import importlib

    if module == "albumentations":
        os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # noqa: BLE001 - any import failure means "not available" here
        return None


@dataclass
class BenchReport:
    """One benchmark run: the suite, its rows, the shared context, the machine and notes for the reader.

    ``reference`` names the row that the ``x ref`` column divides by; with
    ``reference_match``, the reference row must also have the same values of
    those params as the row (e.g. the same ``num_workers``); ``reference_label``
    is how the table names the reference (default: its name); ``columns`` are
    keys of the rows' ``extra`` shown as more columns of the table.
    """

    suite: str
    title: str
    rows: list[Row]
    context: dict[str, Any]
    machine: dict[str, Any]
    reference: str | None = None
    reference_match: tuple[str, ...] = ()
    reference_label: str | None = None
    columns: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def row(self, name: str, **params: Any) -> Row | None:
        """The first row called ``name`` whose params include ``params``."""
        for row in self.rows:
            if row.name == name and all(row.params.get(k) == v for k, v in params.items()):
                return row
        return None

    @property
    def failed(self) -> list[Row]:
        return [row for row in self.rows if row.error is not None]

    def ratio(self, row: Row) -> float | None:
        """``row``'s images/s over the reference row's, when both were measured."""
        if self.reference is None:
            return None
        return ratio(row, self.row(self.reference, **{k: row.params.get(k) for k in self.reference_match}))

    def to_json(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            data = row.to_json()
            data["ratio_to_reference"] = self.ratio(row)
            rows.append(data)
        return {
            "benchmark": "loader",
            "suite": self.suite,
            "title": self.title,
            "reference": self.reference,
            "reference_match": list(self.reference_match),
            "context": self.context,
            "machine": self.machine,
            "rows": rows,
            "summary": self.summary,
            "notes": list(self.notes),
        }


def ratio(a: Row | None, b: Row | None) -> float | None:
    """``a``'s images/s over ``b``'s; ``None`` unless both rows are there and were measured."""
    if a is None or b is None or not a.images_per_s or not b.images_per_s:
        return None
    return a.images_per_s / b.images_per_s


def figure(value: float | None, target: str | None = None, unit: str = "x") -> dict[str, Any]:
    """One entry of a report's ``summary``: its value (``None``: not measured), unit and, where one is set, the
    project's target for it (kept in the JSON, not shown in the table)."""
    entry: dict[str, Any] = {"value": value, "unit": unit}
    if target is not None:
        entry["target"] = target
    return entry


def suite_report(
    suite: str, title: str, inputs: Any, rows: list[Row], context: dict[str, Any] | None = None, **kwargs: Any
) -> BenchReport:
    """A suite's report: its rows, with the context (default: the inputs' description) and the machine they were
    measured on; ``kwargs`` are :class:`BenchReport`'s options."""
    context = inputs.describe() if context is None else context
    return BenchReport(suite, title, rows, context, machine_description(), **kwargs)


def write_json(report: BenchReport, path: str | os.PathLike) -> Path:
    """Write every figure, the context and the machine as JSON."""
    return atomic_write_json(path, report.to_json())


def _label(row: Row) -> str:
    params = " ".join(f"{k}={v}" for k, v in row.params.items())
    return f"{row.name} [{params}]" if params else row.name


_FACTS = (
    ("dataset", "{}"),
    ("num_samples", "{} samples"),
    ("batch_size", "batch {}"),
    ("cores", "{} cores"),
    ("target_device", "delivered to {}"),
)


def format_table(report: BenchReport) -> str:
    """The table a person reads: images/s (median), the spread of the windows, the ratio to the reference."""
    c, m = report.context, report.machine
    gpu = m.get("gpu")
    lines = [report.title]
    facts = [f"{template.format(c[key])}" for key, template in _FACTS if c.get(key) is not None]
    if facts:
        lines.append(", ".join(facts))
    lines.append(
        f"machine: {m.get('cores')} cores, {m.get('cpu')}; GPU: {gpu['name'] if gpu else 'none'}; "
        f"torch {m.get('torch')}, DALI {m.get('dali')}"
    )
    width = max([len(_label(row)) for row in report.rows] + [3])
    lines.append(
        f"{'row':<{width}} {'images/s':>10} {'spread':>8} {'x ref':>7} {'CPU s/1k':>9}"
        + "".join(f" {c:>10}" for c in report.columns)
    )
    for row in report.rows:
        label = _label(row)
        if row.timing is not None:
            ratio = report.ratio(row)
            extra = "".join(f" {_cell(row.extra.get(c)):>10}" for c in report.columns)
            cost = row.timing.cpu_seconds_per_1k
            lines.append(
                f"{label:<{width}} {row.timing.median:>10.1f} {'±' + format(100 * row.timing.spread, '.0f') + '%':>8} "
                f"{(format(ratio, '.2f') if ratio is not None else '-'):>7} "
                f"{(format(cost, '.2f') if cost is not None else '-'):>9}{extra}"
            )
        elif row.skipped is not None:
            lines.append(f"{label:<{width}} {'skipped':>10}  {row.skipped}")
        else:
            lines.append(f"{label:<{width}} {'FAILED':>10}  {row.error}")
    if report.reference:
        same = f" with the same {', '.join(report.reference_match)}" if report.reference_match else ""
        label = report.reference_label or report.reference
        lines.append(f"x ref: images/s over the row '{label}'{same}; spread: half the range of the timed windows")
    lines.append("CPU s/1k: CPU seconds of the whole process tree (all cores, workers included) per 1,000 images")
    for key, entry in report.summary.items():
        value = entry.get("value")
        shown = "not measured" if value is None else f"{value:,.2f}{entry.get('unit', '')}"
        lines.append(f"{key}: {shown}")  # the project's own goals stay in the JSON ("target"), not in what users read
    lines.extend(report.notes)
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def write_plot(report: BenchReport, path: str | os.PathLike) -> Path | None:
    """A horizontal bar chart of images/s with the windows' range as error bars; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window, work without a display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        log.warning('no plot: matplotlib does not import (%s); pip install "dali-pipes[bench]"', exc)
        return None
    rows = list(report.rows)
    labels = [_label(row) for row in rows]
    values = [row.images_per_s or 0.0 for row in rows]
    low = [(row.timing.median - row.timing.low) if row.timing else 0.0 for row in rows]
    high = [(row.timing.high - row.timing.median) if row.timing else 0.0 for row in rows]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    positions = range(len(rows))
    colors = [
        "#76b900" if row.name.lower().startswith("dali") else "#4c72b0" for row in rows
    ]  # DALI rows in NVIDIA green
    ax.barh(positions, values, xerr=[low, high], color=colors, capsize=3)
    for y, row in zip(positions, rows):
        if row.timing is None:
            ax.text(0, y, "  skipped" if row.skipped else "  failed", va="center", fontsize=8, color="gray")
        else:
            ax.text(row.timing.median, y, f" {row.timing.median:,.0f}", va="bottom", fontsize=7)
    ax.set_yticks(list(positions), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("images/s (median of windows; bars: range)")
    m = report.machine
    gpu = m.get("gpu")
    ax.set_title(f"{report.title}\n{m.get('cores')} cores, GPU: {gpu['name'] if gpu else 'none'}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
