"""The contract between a pipeline spec and the loader that runs it."""

from __future__ import annotations

from typing import Mapping, Protocol, runtime_checkable

from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline

DEVICES: tuple[str, ...] = ("cpu", "gpu")


@runtime_checkable
class PipelineSpec(Protocol):
    """What the loader needs from a pipeline spec.

    A spec is a small frozen dataclass. The loader reads the fields named in
    :attr:`required_fields` from the dataset, feeds each through an external
    source, and calls :meth:`build` inside the DALI pipeline definition.
    """

    @property
    def required_fields(self) -> tuple[str, ...]:
        """Dataset fields the graph consumes, e.g. ``("image", "label")``."""
        ...

    @property
    def needs_conditionals(self) -> bool:
        """True when the pipeline must be defined with ``enable_conditionals=True``."""
        ...

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the graph to the pipeline being defined; return its named outputs.

        ``inputs`` maps each of :attr:`required_fields` to its external-source node
        and ``device`` is ``"gpu"`` (decode ``mixed``, then GPU operators) or
        ``"cpu"``.
        """
        ...


def check_build_call(spec: PipelineSpec, inputs: Mapping[str, DataNode], device: str) -> None:
    """Raise ValueError when ``spec.build`` is called with what it cannot use.

    Checks the device, that every required field has a node, and that a spec
    that needs conditionals is built inside a pipeline that has them: DALI would
    otherwise fail deep inside ``auto_aug`` with a message that does not say
    which setting to change.
    """
    name = type(spec).__name__
    if device not in DEVICES:
        raise ValueError(f"{name}.build: device must be 'cpu' or 'gpu' (resolve 'auto' first), got {device!r}")
    missing = [f for f in spec.required_fields if f not in inputs]
    if missing:
        raise ValueError(
            f"{name}.build: no input node for field(s) {', '.join(map(repr, missing))}; "
            f"the spec needs {', '.join(map(repr, spec.required_fields))}"
        )
    if spec.needs_conditionals:
        pipe = Pipeline.current()
        # `_conditionals_enabled` is DALI's private flag; only a definite False is
        # trusted, so a DALI release that renames it skips this check rather than
        # rejecting a valid pipeline.
        if pipe is not None and getattr(pipe, "_conditionals_enabled", None) is False:
            raise ValueError(
                f"{spec!r} uses DALI conditionals: define the pipeline with "
                "@pipeline_def(enable_conditionals=True) (see the spec's needs_conditionals)"
            )


def label_output(label: DataNode, device: str) -> DataNode:
    """The label node, moved to the GPU when the pipeline runs there."""
    return label.gpu() if device == "gpu" else label
