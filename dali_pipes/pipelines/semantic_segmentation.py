"""Semantic segmentation: an image and its label map moved by one random scale, crop and flip.

Both specs read the fields ``dali-pipes convert segmentation`` writes: ``image``
and ``mask`` (a 16-bit grey PNG of class indices), and hand out

- ``image``: ``(N, 3, H, W)`` (or NHWC), normalised as the other specs do;
- ``mask``: int64 ``(N, H, W)``, the class index of each output pixel, with
  ``ignore_index`` where the output lies outside the image (padding);
- ``image_size`` (validation with a shorter side only): int64 ``(N, 2)``, the valid ``(height, width)``.

The map goes through the same operators as the image with the same arguments,
nearest neighbour where the image is interpolated: the window is drawn once on
the CPU and given to both ``slice`` operators (relative anchor and shape, so
both cut the same pixels), both are resized to the same size, and the flip coin
that mirrors the image in ``crop_mirror_normalize`` mirrors the map in ``flip``.
The map is decoded on the CPU (DALI's GPU decoders hand PNG to the CPU anyway)
and moved to the image's device before the geometry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Optional

import nvidia.dali.fn as fn
import nvidia.dali.math as dmath
import nvidia.dali.types as types
from nvidia.dali.data_node import DataNode

from dali_pipes.pipelines import ops
from dali_pipes.pipelines.base import check_build_call
from dali_pipes.pipelines.classification import _ImageOutput
from dali_pipes.pipelines.config import ColorJitter, check_flip_and_jitter, check_size, check_window

_FIELDS = ("image", "mask")
# Both slices cut the same pixels: a relative anchor and shape, padding where the window leaves the image.
_WINDOW = dict(normalized_anchor=True, normalized_shape=True, axis_names="WH", out_of_bounds_policy="pad")


def _check_size(name: str, value) -> int | tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be (height, width) or one side, got {value!r}")
        return (check_size(name, value[0]), check_size(name, value[1]))
    return check_size(name, value)


@dataclass(frozen=True, kw_only=True)
class _SemanticOutput(_ImageOutput):
    """What both semantic specs share: the label value of padding, and decoding the map.

    ``ignore_index`` (0..65535, default 255) fills the map wherever the output has
    no source pixel. See :class:`~dali_pipes.pipelines.classification._ImageOutput`
    for ``mean``, ``std``, ``dtype``, ``layout`` and ``decoder``.
    """

    ignore_index: int = 255

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"{type(self).__name__}.ignore_index must be an integer, got {self.ignore_index!r}")
        if not 0 <= self.ignore_index <= 65535:
            raise ValueError(f"{type(self).__name__}.ignore_index must lie in 0..65535, got {self.ignore_index}")

    @property
    def required_fields(self) -> tuple[str, ...]:
        """The encoded image and its label map."""
        return _FIELDS

    def _decode_map(self, encoded: DataNode, device: str) -> tuple[DataNode, DataNode]:
        """The decoded map (on ``device``) and its float ``(height, width)`` (on the CPU)."""
        maps = fn.decoders.image(encoded, device="cpu", output_type=types.ANY_DATA, dtype=types.UINT16)
        hw = fn.cast(maps.shape(dtype=types.INT32)[0:2], dtype=types.FLOAT)
        return (maps.gpu() if device == "gpu" else maps), hw

    @staticmethod
    def _mask_output(maps: DataNode) -> DataNode:
        return fn.cast(maps[:, :, 0], dtype=types.INT64)


@dataclass(frozen=True, kw_only=True)
class SemanticSegmentation(_SemanticOutput):
    """Segmentation training: random window, resize to ``size``, flip, colour jitter, normalise.

    The window's area is drawn from ``scale`` (a fraction of the image's area;
    above 1 the window is larger than the image and the rest is padding: 0 in the
    image before normalisation, ``ignore_index`` in the map) and its width/height
    ratio from ``ratio`` (log-uniform); it lies inside the image where it fits
    and covers it otherwise. The window is resized to ``size`` (an int for a square, or
    ``(height, width)``): bilinear for the image, nearest for the map. ``flip`` is
    the probability of a horizontal flip; ``jitter=None`` turns colour jitter off.
    """

    size: int | tuple[int, int] = 512
    scale: tuple[float, float] = (0.25, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    jitter: Optional[ColorJitter] = field(default_factory=ColorJitter)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "size", _check_size("SemanticSegmentation.size", self.size))
        check_window(self, "SemanticSegmentation", max_scale=16.0)
        check_flip_and_jitter(self, "SemanticSegmentation")

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the training graph; return ``image`` and ``mask`` (see :class:`PipelineSpec`)."""
        check_build_call(self, inputs, device)
        window, mirror = self._window(), ops.mirror_flag(self.flip)
        return {
            "image": self._image(inputs["image"], window, mirror, device=device),
            "mask": self._map(inputs["mask"], window, mirror, device=device),
        }

    def _image(self, encoded: DataNode, window: tuple, mirror: DataNode | int, *, device: str) -> DataNode:
        """The image's part of the graph: decode, cut the window, resize, jitter, flip and normalise."""
        images = ops.decode(encoded, device=device, hints=self.decoder)
        images = fn.slice(images, *window, device=device, fill_values=0, **_WINDOW)
        images = fn.resize(images, device=device, size=self._size, interp_type=types.INTERP_LINEAR, antialias=True)
        if self.jitter is not None:
            images = ops.color_jitter(images, self.jitter, device=device, output_dtype=self.dtype)
        if ops.needs_normalize(dtype=self.dtype, layout=self.layout, mirror=mirror, crop=None):
            images = self._normalize(images, device=device, mirror=mirror)
        return images

    def _map(self, encoded: DataNode, window: tuple, mirror: DataNode | int, *, device: str) -> DataNode:
        """The map's part: the same window, size and flip, with nearest neighbour and ``ignore_index`` padding."""
        maps, _ = self._decode_map(encoded, device)
        maps = fn.slice(maps, *window, device=device, fill_values=self.ignore_index, **_WINDOW)
        maps = fn.resize(maps, device=device, size=self._size, interp_type=types.INTERP_NN, antialias=False)
        if not (isinstance(mirror, int) and mirror == 0):
            maps = fn.flip(maps, device=device, horizontal=mirror)
        return self._mask_output(maps)

    @property
    def _size(self) -> list[float]:
        return [float(v) for v in self.size] if isinstance(self.size, tuple) else [float(self.size)] * 2

    def _window(self) -> tuple[DataNode, DataNode]:
        """A relative ``[x, y]`` anchor and ``[w, h]`` shape, drawn per sample on the CPU."""
        area = fn.random.uniform(range=list(self.scale))
        log_ratio = fn.random.uniform(range=[math.log(self.ratio[0]), math.log(self.ratio[1])])
        ratio = dmath.exp(log_ratio)
        width, height = dmath.sqrt(area * ratio), dmath.sqrt(area / ratio)
        # u * (1 - side): inside the image when side <= 1, covering it (negative anchor) when larger.
        x = fn.random.uniform(range=[0.0, 1.0]) * (1.0 - width)
        y = fn.random.uniform(range=[0.0, 1.0]) * (1.0 - height)
        return fn.stack(x, y), fn.stack(width, height)


@dataclass(frozen=True, kw_only=True)
class SemanticSegmentationVal(_SemanticOutput):
    """Segmentation evaluation: resize image and map to ``size``, normalise, pad the batch.

    ``size`` is ``(height, width)``, or one integer: the shorter side, keeping
    the aspect ratio, the batch then padded to its largest image (0 in the image,
    ``ignore_index`` in the map) and ``image_size`` added.
    """

    #: Evaluation reads every sample in order: a loader given this spec does not shuffle unless told to.
    shuffle_by_default: ClassVar[bool] = False

    size: int | tuple[int, int] = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "size", _check_size("SemanticSegmentationVal.size", self.size))

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the evaluation graph; return ``image``, ``mask`` and, for a shorter side, ``image_size``."""
        check_build_call(self, inputs, device)
        images = ops.decode(inputs["image"], device=device, hints=self.decoder)
        maps, hw = self._decode_map(inputs["mask"], device)
        if isinstance(self.size, tuple):
            out_hw = fn.constant(fdata=[float(v) for v in self.size], dtype=types.FLOAT)
        else:
            # Computed once on the CPU and given to both resizes, so image and map get the same size.
            out_hw = dmath.max(dmath.floor(hw * (self.size / dmath.min(hw[0], hw[1])) + 0.5), 1.0)
        images = fn.resize(images, device=device, size=out_hw, interp_type=types.INTERP_LINEAR, antialias=True)
        maps = fn.resize(maps, device=device, size=out_hw, interp_type=types.INTERP_NN, antialias=False)
        out_hw = fn.cast(out_hw, dtype=types.INT64)
        if ops.needs_normalize(dtype=self.dtype, layout=self.layout, mirror=0, crop=None):
            images = self._normalize(images, device=device)
        outputs = {"image": images, "mask": self._mask_output(maps)}
        if not isinstance(self.size, tuple):
            axes = (1, 2) if self.layout == "NCHW" else (0, 1)
            outputs["image"] = fn.pad(images, device=device, axes=axes, fill_value=0.0)
            outputs["mask"] = fn.pad(outputs["mask"], device=device, axes=(0, 1), fill_value=float(self.ignore_index))
            outputs["image_size"] = out_hw.gpu() if device == "gpu" else out_hw
        return outputs
