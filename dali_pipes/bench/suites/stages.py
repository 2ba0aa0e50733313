"""Growing prefixes of the training graph, to see what each step of it costs.

``dali-pipes bench DATASET --suite stages`` runs the :class:`~dali_pipes.DALILoader`
over the shards with the first *k* steps of the training spec's graph
(:meth:`~dali_pipes.ClassificationTrain.image_stages`) for every *k*: reading the
shards only, then decoding the random crop, then resizing, and so on up to the
whole graph. Every prefix but the last hands out a 1x1 crop of its images (or the
encoded sizes, for the read-only row), so the rows differ by the work of the
steps and not by the size of what is copied out; the last row is the real
output, and also pays for copying it out. The difference of two neighbouring
rows' time per image is the step's *marginal* cost: work that overlaps the
slowest part of the pipeline (Python reads, DALI's threads, the GPU) shows as
about zero. Find the bottleneck before optimising.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nvidia.dali import fn
from nvidia.dali.data_node import DataNode

from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.streams import DEVICES, per_device
from dali_pipes.bench.suites import SuiteRun
from dali_pipes.pipelines.base import check_build_call, label_output

#: Name of the row that reads the shards and decodes nothing.
READ_ONLY = "read shards"


@dataclass(frozen=True)
class GraphPrefix:
    """A pipeline spec running the first ``steps`` of ``spec.image_stages`` (0: none, read only)."""

    spec: Any
    steps: int

    @property
    def required_fields(self) -> tuple[str, ...]:
        return tuple(self.spec.required_fields)

    @property
    def needs_conditionals(self) -> bool:
        return bool(self.spec.needs_conditionals)

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """The prefix's graph; its ``image`` output is small unless the prefix is the whole graph."""
        check_build_call(self, inputs, device)
        stages = self.spec.image_stages(device=device)
        images = inputs["image"]
        for _, stage in stages[: self.steps]:
            images = stage(images)
        if self.steps == 0:
            # The encoded bytes' lengths: the store was read and nothing decoded.
            images = images.shape()
        elif self.steps < len(stages):
            # Every operator before it still runs on the whole image; only the copy out is small.
            images = fn.crop(images, device=device, crop=[1, 1])
        return {"image": images, "label": label_output(inputs["label"], device)}


def run(bench: SuiteRun) -> BenchReport:
    """The loader with the first k steps of the training graph, for every k, on the GPU and the CPU."""
    inputs, target = bench.inputs, bench.target
    if not hasattr(inputs.spec, "image_stages"):
        raise ValueError(f"the stages suite needs a spec with image_stages(); {type(inputs.spec).__name__} has none")
    names = stage_names(inputs.spec)
    jobs = per_device(inputs, target, {name: GraphPrefix(inputs.spec, steps) for steps, name in enumerate(names)})
    title = "what each step of the training graph costs: the loader with its first k steps"
    report = bench.measure(
        title,
        jobs,
        reference=names[-1],
        reference_match=("device",),
        reference_label="whole graph",
        columns=("ms_per_image_added", "cpu_ms_added"),
    )
    for device in DEVICES:
        mine = [row for row in report.rows if row.params.get("device") == device]
        wall = step_costs([row.images_per_s for row in mine])
        cpu = step_differences([row.timing.cpu_seconds_per_1k if row.timing else None for row in mine])
        for row, wall_ms, cpu_ms in zip(mine, wall, cpu):
            if wall_ms is not None:
                row.extra["ms_per_image_added"] = round(wall_ms, 3)
            if cpu_ms is not None:
                row.extra["cpu_ms_added"] = round(cpu_ms, 3)
    report.notes.append(
        "ms_per_image_added: wall time per image this row adds to the row above it (same device). "
        "Rows before the last hand out 1x1 crops; the last also pays for copying whole images out. "
        "Work that overlaps the slowest step (Python reads, DALI threads, the GPU) shows as about 0, "
        "or below 0 within the spread: these are marginal costs, not each step's time alone. "
        "cpu_ms_added: the same in CPU milliseconds of the whole process tree (every core, workers included): "
        "what the step costs the cores, which a change of the machine's load moves far less"
    )
    return report


def stage_names(spec: Any, device: str = "cpu") -> list[str]:
    """The row names: the read-only row, then ``"+ step"`` for every step of ``spec``'s graph."""
    return [READ_ONLY] + [f"+ {name}" for name, _ in spec.image_stages(device=device)]


def step_costs(rates: list[float | None]) -> list[float | None]:
    """Milliseconds of wall time per image that each row adds to the one before it.

    ``rates`` are the rows' images per second in order; the first row's cost is
    its own time per image; a row next to an unmeasured one gets ``None``.
    """
    return step_differences([1000.0 / rate if rate is not None and rate > 0 else None for rate in rates])


def step_differences(per_image: list[float | None]) -> list[float | None]:
    """What each row's cost per image adds to the row before it (the first row: its own cost).

    ``per_image`` is a cost per image per row (wall or CPU milliseconds); a row
    next to one without a figure gets ``None``.
    """
    costs: list[float | None] = []
    previous: float | None = 0.0
    for value in per_image:
        costs.append(None if value is None or previous is None else value - previous)
        previous = value
    return costs
