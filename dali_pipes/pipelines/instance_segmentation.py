"""Instance segmentation (Mask R-CNN style): the detection specs plus one binary mask per box.

:class:`InstanceSegmentation` and :class:`InstanceSegmentationVal` are
:class:`~dali_pipes.pipelines.detection.Detection` and
:class:`~dali_pipes.pipelines.detection.DetectionVal` with the same arguments
and outputs, plus

- ``masks``: uint8 ``(N, M, H, W)``, 0 or 1, one mask per row of ``boxes`` and
  ``labels`` (same order), aligned with ``image``: cut by the same crop window,
  resized with nearest neighbour to the same size, flipped with the same coin,
  padded with 0 like the image; rows past ``num_boxes`` are 0. A box dropped by
  the crop drops its mask; a mask cut by the crop keeps what lies inside.

They read the fields ``convert coco --masks`` writes (see
:mod:`converters.sources.coco_masks`): ``masks``, a PNG whose channels are
layers of instance ids, and ``mask_code`` (``layer * 256 + id`` per box). The
whole mask path is DALI operators, with nothing in Python per instance: the PNG
is decoded on the CPU (DALI's GPU decoders hand PNG to the CPU anyway) with the
image's crop window (``decoders.image_slice``, same relative anchor and shape),
then, on the image's device, resized with ``INTERP_NN`` to the image's output
size and flipped with the image's coin; each box's code rides through the box
crop packed into its label, and the binary masks are one broadcast comparison,
``layers[None] == wanted[:, None, None, :]`` reduced over the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

import nvidia.dali.fn as fn
import nvidia.dali.types as types
from nvidia.dali.data_node import DataNode

from dali_pipes.pipelines import ops
from dali_pipes.pipelines.base import check_build_call
from dali_pipes.pipelines.detection import Detection, DetectionVal, _on_device, _pad_rows, unpack_per_box

#: ``mask_code = layer * MASK_CODE_BASE + id``, with up to MASK_LAYERS layers (the converter's layout).
MASK_CODE_BASE = 256
MASK_LAYERS = 4
_MASK_FIELDS = ("masks", "mask_code")


class _MaskOutput:
    """The mask graph both instance specs add to their detection parent."""

    #: Tests set this to also output the crop window (``crop_anchor``, ``crop_shape``: relative, ``[x, y]``/``[w, h]``).
    _emit_window: ClassVar[bool] = False

    @property
    def required_fields(self) -> tuple[str, ...]:
        """The detection fields plus the stored masks and each box's mask code."""
        return super().required_fields + _MASK_FIELDS  # type: ignore[misc]

    def _masks(
        self,
        encoded: DataNode,
        codes: DataNode,
        out_hw: DataNode,
        *,
        device: str,
        mirror: DataNode | int = 0,
        anchor: Optional[DataNode] = None,
        shape: Optional[DataNode] = None,
    ) -> DataNode:
        """uint8 ``(M, H, W)`` masks (padded to the batch) of the boxes whose ``codes`` are given."""
        if anchor is None:
            layers = fn.decoders.image(encoded, device="cpu", output_type=types.ANY_DATA)
        else:
            layers = fn.decoders.image_slice(
                encoded,
                anchor,
                shape,
                device="cpu",
                output_type=types.ANY_DATA,
                axis_names="WH",
                normalized_anchor=True,
                normalized_shape=True,
            )
        channels = layers.shape(dtype=types.INT32)[2]
        if device == "gpu":
            layers = layers.gpu()
        layers = fn.resize(layers, device=device, size=out_hw, interp_type=types.INTERP_NN, antialias=False)
        if not (isinstance(mirror, int) and mirror == 0):
            layers = fn.flip(layers, device=device, horizontal=mirror)
        # wanted[k, l]: the id box k has in layer l, or 0 in the layers it is not in; 0 never
        # counts as a hit (background), hence the `& (wanted > 0)`.
        layer = fn.expand_dims(codes // MASK_CODE_BASE, axes=[1])
        ids = fn.expand_dims(codes, axes=[1]) - layer * MASK_CODE_BASE
        all_layers = fn.constant(idata=list(range(MASK_LAYERS)), shape=[1, MASK_LAYERS], dtype=types.INT32)
        in_layer = layer == all_layers[:, 0:channels]
        wanted = fn.expand_dims(fn.cast(fn.cast(in_layer, dtype=types.INT32) * ids, dtype=types.UINT8), axes=[1, 2])
        if device == "gpu":
            wanted = wanted.gpu()
        hits = (fn.expand_dims(layers, axes=[0]) == wanted) & (wanted > 0)
        masks = fn.reductions.max(fn.cast(hits, dtype=types.UINT8), axes=[3])
        if not isinstance(self.size, tuple):  # type: ignore[attr-defined]
            masks = fn.pad(masks, device=device, axes=(1, 2), fill_value=0)
        return _pad_rows(masks, 0.0)


@dataclass(frozen=True, kw_only=True)
class InstanceSegmentation(_MaskOutput, Detection):
    """Instance-segmentation training: :class:`Detection`'s crop, flip, resize and jitter, with ``masks``.

    Same arguments as :class:`Detection`; the outputs are its outputs plus
    ``masks`` (see the module docstring).
    """

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the training graph with masks; return the named outputs (see :class:`PipelineSpec`)."""
        check_build_call(self, inputs, device)
        t = self._augment(inputs, device=device, per_box=inputs["mask_code"])
        labels, codes = unpack_per_box(t.labels)
        outputs = self._finish_detection(
            t.images, t.image_hw, t.boxes, labels, device=device, mirror=t.mirror, jitter=self.jitter
        )
        out_hw = self._output_size(t.image_hw)
        outputs["masks"] = self._masks(
            inputs["masks"], codes, out_hw, device=device, mirror=t.mirror, anchor=t.anchor, shape=t.shape
        )
        if self._emit_window and t.anchor is not None:
            outputs.update(_on_device({"crop_anchor": t.anchor, "crop_shape": t.shape}, device))
        return outputs


@dataclass(frozen=True, kw_only=True)
class InstanceSegmentationVal(_MaskOutput, DetectionVal):
    """Instance-segmentation evaluation: :class:`DetectionVal` (resize and pad) with ``masks``.

    Same arguments and outputs as :class:`DetectionVal`, plus ``masks``.
    """

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the evaluation graph with masks; return the named outputs (see :class:`PipelineSpec`)."""
        check_build_call(self, inputs, device)
        encoded = inputs["image"]
        orig_size = fn.peek_image_shape(encoded, dtype=types.INT64)[0:2]
        image_hw = fn.cast(orig_size, dtype=types.FLOAT)
        boxes, packed = self._relative_targets(inputs, image_hw, inputs["mask_code"])
        labels, codes = unpack_per_box(packed)
        images = ops.decode(encoded, device=device, hints=self.decoder)
        outputs = self._finish_detection(images, image_hw, boxes, labels, device=device)
        outputs["masks"] = self._masks(inputs["masks"], codes, self._output_size(image_hw), device=device)
        outputs.update(_on_device({"image_id": inputs["image_id"], "orig_size": orig_size}, device))
        return outputs
