"""Per-batch inputs of a spec: values drawn in Python for each batch and fed to the DALI graph beside the data.

A spec that needs them (a size schedule, :class:`~dali_pipes.pipelines.mixing.Mix`,
:class:`~dali_pipes.pipelines.erasing.RandomErasing`) returns a
:class:`BatchInputs` from its ``batch_inputs`` property. The loader's external
source calls it for every batch, with the batch's ``(seed, rank, epoch, batch)``,
the epoch's output size and the batch's ``is_pad`` rows, and appends its arrays to
the source's outputs; ``spec.build`` finds them in ``inputs`` by name. So the
output size changes with the epoch without a new pipeline, and the random draws
depend only on ``(seed, epoch, batch, rank)``: the same on every run and after a
resume. Nothing here imports DALI.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dali_pipes.pipelines.erasing import RandomErasing
from dali_pipes.pipelines.mixing import Mix

__all__ = ["MIX_STREAM", "ERASE_STREAM", "BatchInputs", "batch_seed"]

#: Which random stream of a batch: MixUp/CutMix, RandomErasing's boxes, RandomErasing's colours.
MIX_STREAM, ERASE_STREAM, COLOUR_STREAM = 0, 1, 2


def batch_seed(seed: int, rank: int, epoch: int, batch: int, stream: int) -> int:
    """The 32-bit seed of one random stream of one batch (what tests seed timm's global state with)."""
    state = np.random.SeedSequence([int(seed), int(epoch), int(batch), int(rank), int(stream)]).generate_state(1)
    return int(state[0])


@dataclass(frozen=True)
class BatchInputs:
    """The per-batch inputs of :class:`~dali_pipes.pipelines.ClassificationTrain`: picklable, made per batch.

    ``scheduled``: feed the epoch's size as ``size`` (float32 ``[h, w]`` per sample,
    the form ``fn.resize`` takes). ``mix`` and ``erasing``: feed their draws (see
    :attr:`outputs` for the names). ``channels_first``: the image layout, so that
    the ``"pixel"`` noise of a box is drawn as ``[C, h, w]`` or ``[h, w, C]``.
    """

    scheduled: bool
    mix: Optional[Mix] = None
    erasing: Optional[RandomErasing] = None
    channels_first: bool = True

    @property
    def outputs(self) -> tuple[tuple[str, str, int], ...]:
        """``(name, numpy dtype, ndim per sample)`` of each array :meth:`make` returns, in order."""
        out: list[tuple[str, str, int]] = []
        if self.scheduled:
            out.append(("size", "float32", 1))
        if self.mix is not None:
            out += [("mix_partner", "int32", 0), ("mix_image_lam", "float32", 0), ("mix_target_lam", "float32", 0)]
            if self.mix.cutmix_alpha > 0:  # DALI warns about an input the graph never reads
                out += [("mix_box_anchor", "float32", 1), ("mix_box_shape", "float32", 1)]
        if self.erasing is not None:
            out += [("erase_anchor", "float32", 1), ("erase_shape", "float32", 1)]
            if self.erasing.mode == "rand":
                out.append(("erase_colour", "float32", 2))  # [max_count, C]
            if self.erasing.mode == "pixel":
                # Each box's noise is drawn at the box's size ([C, h, w] or [h, w, C]) and padded out to
                # the image ([H, W]) at (top, left): far cheaper than noise for every pixel.
                out += [("erase_noise_shape", "int32", 2), ("erase_noise_anchor", "float32", 2)]
                out.append(("erase_canvas", "float32", 1))
        return tuple(out)

    @property
    def names(self) -> tuple[str, ...]:
        """The input names, in the order of :meth:`make`'s arrays."""
        return tuple(name for name, _, _ in self.outputs)

    def make(self, *, seed: int, rank: int, epoch: int, batch: int, size: int, is_pad: np.ndarray) -> list[np.ndarray]:
        """One batch's arrays, each ``[B, ...]``: batch ``batch`` of ``epoch`` on ``rank``, images ``size`` px."""
        rows = len(is_pad)
        hw = (int(size), int(size))
        out: list[np.ndarray] = []
        if self.scheduled:
            out.append(np.full((rows, 2), size, dtype=np.float32))
        if self.mix is not None:
            rng = np.random.RandomState(batch_seed(seed, rank, epoch, batch, MIX_STREAM))
            draw = self.mix.draw(rng, is_pad, hw)
            out += [draw.partner, draw.image_lam, draw.target_lam]
            if self.mix.cutmix_alpha > 0:
                out += [np.ascontiguousarray(draw.box[:, :2]), np.ascontiguousarray(draw.box[:, 2:])]
        if self.erasing is not None:
            boxes_rng = random.Random(batch_seed(seed, rank, epoch, batch, ERASE_STREAM))
            colour_rng = np.random.default_rng(batch_seed(seed, rank, epoch, batch, COLOUR_STREAM))
            draw = self.erasing.draw(boxes_rng, colour_rng, rows, hw)
            # erase's anchors and shapes: all the boxes of a sample, flat, in the order of axis_names="HW".
            out.append(np.ascontiguousarray(draw.boxes[:, :, :2].reshape(rows, -1)))
            out.append(np.ascontiguousarray(draw.boxes[:, :, 2:].reshape(rows, -1)))
            if self.erasing.mode == "rand":
                out.append(draw.colours)
            if self.erasing.mode == "pixel":
                out += _noise_geometry(draw.boxes, size, channels_first=self.channels_first)
        return out


def _noise_geometry(boxes: np.ndarray, size: int, *, channels_first: bool) -> list[np.ndarray]:
    """Per box: the noise's shape, the anchor that pads it out to the image at the box, and the image's size."""
    rows, slots = boxes.shape[:2]
    hw = boxes[:, :, 2:].astype(np.int32)
    channels = np.full((rows, slots, 1), 3, dtype=np.int32)
    shape = np.concatenate([channels, hw] if channels_first else [hw, channels], axis=2)
    anchor = np.ascontiguousarray(-boxes[:, :, :2])  # slicing from (-top, -left) puts the box's corner there
    return [np.ascontiguousarray(shape), anchor, np.full((rows, 2), size, dtype=np.float32)]
