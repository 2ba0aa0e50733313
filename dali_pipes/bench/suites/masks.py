"""``dali-pipes bench DATASET --suite masks``: what masks cost, against the same pipeline without them.

On a COCO dataset converted with ``--masks``: :class:`~dali_pipes.InstanceSegmentation`
against :class:`~dali_pipes.Detection` with the same size, crop, flip and jitter
(the detection pipeline is the instance pipeline without its masks). On a
``convert segmentation`` dataset: :class:`~dali_pipes.SemanticSegmentation`
against its own image half alone (the same window, resize, jitter and flip,
with no label map read, decoded or moved). Each on the GPU and the CPU; the
``x ref`` column is the masked row's speed over the row without masks on the
same device, so its inverse is the cost per image of the masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dali_pipes.bench.report import BenchReport
from dali_pipes.bench.streams import per_device
from dali_pipes.bench.suites import SuiteRun

#: The row every masked row is compared with (same device).
WITHOUT = "without masks"
WITH = "with masks"


@dataclass(frozen=True)
class ImageHalf:
    """A :class:`~dali_pipes.SemanticSegmentation` with only its image half: no label map read or touched."""

    spec: Any

    @property
    def required_fields(self) -> tuple[str, ...]:
        return ("image",)

    @property
    def needs_conditionals(self) -> bool:
        return False

    def build(self, inputs: Mapping[str, Any], *, device: str) -> dict[str, Any]:
        from dali_pipes.pipelines import ops

        window, mirror = self.spec._window(), ops.mirror_flag(self.spec.flip)
        return {"image": self.spec._image(inputs["image"], window, mirror, device=device)}


def mask_specs(fields: Mapping[str, Any]) -> tuple[Any, Any, str]:
    """``(without, with, what)``: the two specs to compare on a dataset of these fields."""
    from dali_pipes.pipelines import Detection, InstanceSegmentation, SemanticSegmentation

    if {"masks", "mask_code"} <= set(fields):
        common = dict(size=320, max_size=512)
        return Detection(**common), InstanceSegmentation(**common), "InstanceSegmentation vs Detection (320/512)"
    if "mask" in fields:
        spec = SemanticSegmentation(size=384)
        return ImageHalf(spec), spec, "SemanticSegmentation vs its image half alone (384 x 384)"
    raise ValueError(
        "the masks suite needs a dataset with masks: 'dali-pipes convert coco --masks' or 'dali-pipes convert "
        f"segmentation'; this one has the fields {', '.join(fields)}"
    )


def run(bench: SuiteRun) -> BenchReport:
    """Rows with and without masks, on the GPU and the CPU."""
    inputs, target = bench.inputs, bench.target
    without, with_masks, what = mask_specs(inputs.manifest.fields)
    specs = {WITHOUT: without, WITH: with_masks}
    jobs = per_device(inputs, target, specs)
    for job in jobs:
        job.description = f"DALILoader, {type(specs[job.name]).__name__} on the {job.params['device'].upper()}"
    # Not the inputs' description: their spec (the classification bench's) is not what these rows run.
    described = inputs.describe()
    context = {key: described[key] for key in ("dataset", "format", "num_samples", "batch_size", "cores")}
    context.update(compared=what, loader_settings=dict(inputs.loader_settings))
    report = bench.measure(
        f"what masks cost: {what}",
        jobs,
        context=context,
        reference=WITHOUT,
        reference_match=("device",),
        reference_label="without masks",
    )
    report.notes.append("x ref below 1: the masked pipeline is slower; 1 / (x ref) is its cost per image")
    return report
