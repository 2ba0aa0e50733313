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
crop packed into its label. The layers of a pixel, padded to four bytes, are
read as one uint32, and the binary masks are one broadcast comparison:
``(pixels[None] & (255 << 8 * layer[:, None, None])) == id << 8 * layer``.
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
#: ``1 << 8 * layer``: where a layer's byte lies in the uint32 the layers of a pixel make.
_BYTE_SCALES = [float(1 << 8 * layer) for layer in range(MASK_LAYERS)]
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
        if device == "gpu":
            layers = layers.gpu()
        layers = fn.resize(layers, device=device, size=out_hw, interp_type=types.INTERP_NN, antialias=False)
        if not (isinstance(mirror, int) and mirror == 0):
            layers = fn.flip(layers, device=device, horizontal=mirror)
        # The (up to) four uint8 layers of a pixel read as one little-endian uint32: layer l is byte l.
        layers = fn.pad(layers, device=device, axes=(2,), shape=(MASK_LAYERS,), fill_value=0)
        packed = fn.reshape(
            fn.reinterpret(layers, dtype=types.UINT32, rel_shape=[1, 1, 1 / MASK_LAYERS]), rel_shape=[1, 1]
        )
        # Box k's mask: the byte of its layer equals its id, i.e. (pixel & 255 << 8l) == id << 8l. One broadcast
        # comparison for all boxes, with no reduction over layers (cheaper than one on the CPU).
        layer = codes // MASK_CODE_BASE
        byte = fn.lookup_table(layer, keys=list(range(MASK_LAYERS)), values=_BYTE_SCALES, dtype=types.UINT32)
        ids = fn.cast(codes - layer * MASK_CODE_BASE, dtype=types.UINT32)
        select = fn.expand_dims(fn.cast(byte * 255, dtype=types.UINT32), axes=[1, 2])
        want = fn.expand_dims(fn.cast(byte * ids, dtype=types.UINT32), axes=[1, 2])
        if device == "gpu":
            select, want = select.gpu(), want.gpu()
        masks = fn.cast((fn.expand_dims(packed, axes=[0]) & select) == want, dtype=types.UINT8)
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
