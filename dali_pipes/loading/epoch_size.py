"""The output size of each epoch, for specs whose size follows a schedule, and its place in a saved state.

A spec with ``size_at(epoch)`` (:class:`~dali_pipes.pipelines.ClassificationTrain`)
gets its epoch's size published to the source with the epoch's plan, and fed to
the graph per batch, so the size changes without a new pipeline. ``state_dict``
records the size of the epoch it stands in; ``load_state_dict`` makes the rest of
that epoch come out at the recorded size, so the batches of one epoch keep one
size even when the schedule was changed between the two runs.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any, Mapping

__all__ = ["EpochSizes"]

logger = logging.getLogger(__name__)


class EpochSizes:
    """The sizes of a spec's epochs, with the one restored from a saved state."""

    def __init__(self, spec: Any) -> None:
        self._size_at = getattr(spec, "size_at", None)
        self._restored: tuple[int, int] | None = None  # (epoch, size) from load_state_dict

    def size(self, epoch: int) -> int:
        """The size of ``epoch``'s batches; 0 for a spec without sizes."""
        if self._restored is not None and self._restored[0] == epoch:
            return self._restored[1]
        return int(self._size_at(epoch)) if callable(self._size_at) else 0

    def record(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with ``"size"``: the output size of its epoch (for specs that have sizes)."""
        if callable(self._size_at):
            state["size"] = self.size(int(state["epoch"]))
        return state

    def restore(self, state: Mapping[str, Any], position: tuple[int, int]) -> None:
        """Use the saved epoch's recorded size for the rest of it (``position``: the restored epoch, samples)."""
        self._restored = None
        size = state.get("size")
        if size is None or not callable(self._size_at):
            return
        if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
            raise ValueError(f"loader state: size must be an integer >= 1, got {size!r}")
        epoch, consumed = position
        if epoch != state["epoch"] or consumed == 0:
            return  # the saved epoch was complete, or not begun: the next one follows the schedule
        scheduled = int(self._size_at(epoch))
        if scheduled != size:
            logger.warning(
                "resuming epoch %d at its saved size %d; the spec's schedule now gives %d for it",
                epoch,
                size,
                scheduled,
            )
        self._restored = (epoch, int(size))
