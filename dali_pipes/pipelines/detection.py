"""COCO-style object detection pipeline specs: SSD-style training and resize-only validation.

Both read the fields ``convert coco`` writes (``image``, ``boxes`` as COCO
``[x, y, width, height]`` pixels, ``category_id``, ``iscrowd``, ``image_id``)
and hand out dense tensors, because ``DALIGenericIterator`` needs one shape per
output and batch:

- ``image``: ``(N, 3, H, W)`` (or NHWC), each image at the top-left and the rest
  of the batch's largest extent filled with 0 (after normalisation);
- ``image_size``: int64 ``(N, 2)``, the valid ``(height, width)`` of each image;
- ``boxes``: float32 ``(N, M, 4)``, ``[x1, y1, x2, y2]`` in output pixels, where
  ``M`` is the batch's largest box count (at least 1), rows past
  ``num_boxes`` filled with 0;
- ``labels``: int64 ``(N, M)``, filled with -1 past ``num_boxes``;
- ``num_boxes``: int64 ``(N,)``;
- ``iscrowd``: uint8 ``(N, M)``, only with ``crowd="keep"`` (0 in the filler).

:class:`DetectionVal` adds ``image_id`` (int64 ``(N,)``) and ``orig_size``
(int64 ``(N, 2)``, the decoded image's ``(height, width)``), so predictions can
be mapped back: ``x_orig = x * orig_size[1] / image_size[1]``.

Labels: with ``contiguous_labels=True`` (the default) category ids become
``0..K-1`` in the order of the sorted category ids, so label ``k`` is
``spec.category_ids[k]`` and the manifest's ``classes[k]`` (``convert coco``
lists classes by id). The ids come from the dataset's manifest
(``extra["categories"]``) through :meth:`~_DetectionOutput.bind`:
``Detection(...).bind(load_manifest(path))``, or ``category_ids=`` given
explicitly. With ``contiguous_labels=False`` the COCO ids are kept.

How boxes are kept consistent, all on the CPU (DALI's box operators are CPU-only,
and boxes are tiny): they are made relative ``xyXY`` and clipped to the image;
a first, deterministic ``random_bbox_crop`` over the whole image (fixed crop shape
equal to the input shape) drops what cannot be trained on: boxes of zero area,
such as boxes lying outside the image and, with ``crowd="drop"``, crowd boxes,
collapsed to zero area first. DALI has no masked-select operator, so this
pruning is the way to remove boxes inside the graph. Then the SSD crop
(``random_bbox_crop`` with IoU thresholds) picks a window, the decoder decodes
only that window (``decoders.image_slice``), ``bb_flip`` mirrors the boxes with
the same coin as the image, and the output size is computed on the CPU, given to
``resize`` and used to scale the boxes (so no box operator waits for the GPU).
With ``crowd="keep"`` each box's crowd flag rides through the crop packed into
its label (``2 * (label + 1) + iscrowd``), the only per-box value the operator
carries along.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Literal, Mapping, NamedTuple, Optional, Sequence, TypeVar

import nvidia.dali.fn as fn
import nvidia.dali.math as dmath
import nvidia.dali.types as types
from nvidia.dali.data_node import DataNode

from dali_pipes.dataset.manifest import Manifest
from dali_pipes.pipelines import ops
from dali_pipes.pipelines.base import check_build_call
from dali_pipes.pipelines.classification import _ImageOutput
from dali_pipes.pipelines.config import (
    ColorJitter,
    check_choice,
    check_flip_and_jitter,
    check_size,
)

_Spec = TypeVar("_Spec", bound="_DetectionOutput")
CrowdPolicy = Literal["drop", "keep"]
CROWD_POLICIES: tuple[str, ...] = ("drop", "keep")
CROP_POLICIES: tuple[Optional[str], ...] = ("ssd", None)

#: SSD's sampling (Liu et al. 2016, as in NVIDIA's MLPerf SSD): a minimum IoU with
#: every box from this list (0: any window), or the whole image (``allow_no_crop``);
#: windows of 0.3..1 of each side with a width/height ratio in 0.5..2.
SSD_IOU_THRESHOLDS: tuple[float, ...] = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9)
SSD_SCALING: tuple[float, float] = (0.3, 1.0)
SSD_ASPECT_RATIO: tuple[float, float] = (0.5, 2.0)
# After this many windows the best one is taken, so the worst case stays bounded.
_SSD_TOTAL_ATTEMPTS = 100
# lookup_table's key range.
_MAX_CATEGORY_ID = 65535
_FIELDS = ("image", "boxes", "category_id", "iscrowd")
#: A per-box value packed into the labels lies in ``0..PER_BOX_BASE-1``; labels (and crowd flags) are
#: multiplied by it, so it is kept small enough for 65536 categories to stay within int32.
PER_BOX_BASE = 1024


@dataclass(frozen=True, kw_only=True)
class _DetectionOutput(_ImageOutput):
    """What both detection specs share: output size, labels, crowd boxes, normalisation.

    ``size`` is ``(height, width)`` to resize every image to exactly that (the
    aspect ratio is not kept, as in SSD), or one integer: the shorter side,
    keeping the aspect ratio, with the longer side capped at ``max_size`` when
    given (as torchvision's detection models do); the batch is then padded to
    its largest image. ``crowd="drop"`` removes ``iscrowd`` boxes before
    anything else; ``"keep"`` keeps them and adds an ``iscrowd`` output.
    ``contiguous_labels`` and ``category_ids``: see the module docstring. See
    :class:`~dali_pipes.pipelines.classification._ImageOutput` for ``mean``,
    ``std``, ``dtype``, ``layout`` and ``decoder``.
    """

    size: int | tuple[int, int] = (300, 300)
    max_size: Optional[int] = None
    crowd: CrowdPolicy = "drop"
    contiguous_labels: bool = True
    category_ids: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        object.__setattr__(self, "size", _check_output_size(f"{name}.size", self.size))
        if self.max_size is not None:
            object.__setattr__(self, "max_size", check_size(f"{name}.max_size", self.max_size))
            if isinstance(self.size, tuple):
                raise ValueError(f"{name}.max_size only applies when size is a shorter side (an int), not {self.size}")
            if self.max_size < self.size:
                raise ValueError(f"{name}.max_size ({self.max_size}) must be >= size ({self.size})")
        check_choice(f"{name}.crowd", self.crowd, CROWD_POLICIES)
        if not isinstance(self.contiguous_labels, bool):
            raise ValueError(f"{name}.contiguous_labels must be True or False, got {self.contiguous_labels!r}")
        if self.category_ids is not None:
            object.__setattr__(self, "category_ids", _check_category_ids(f"{name}.category_ids", self.category_ids))

    @property
    def required_fields(self) -> tuple[str, ...]:
        """The dataset fields read: the encoded image, its boxes, their category ids and crowd flags."""
        return _FIELDS

    @property
    def num_classes(self) -> Optional[int]:
        """``K``, the number of contiguous labels, once the category ids are known."""
        return None if self.category_ids is None else len(self.category_ids)

    def bind(self: _Spec, manifest: Manifest) -> _Spec:
        """This spec with ``category_ids`` read from a COCO dataset's manifest.

        Returns a new spec (specs are frozen). Ids given explicitly are kept, but
        must cover every category of the dataset. With ``contiguous_labels=False``
        the ids are not needed and the spec is returned as it is. Raises
        ValueError for a dataset without COCO categories (``extra["categories"]``).
        """
        if not self.contiguous_labels:
            return self
        categories = manifest.extra.get("categories") if isinstance(manifest.extra, Mapping) else None
        if not isinstance(categories, list) or not all(isinstance(c, Mapping) and "id" in c for c in categories):
            if self.category_ids is not None:
                return self  # ids given by the caller: nothing to take from the manifest
            kind = manifest.source.get("kind", "unknown") if isinstance(manifest.source, Mapping) else "unknown"
            # Said without Python names: this is what `dali-pipes show --pipeline detection` prints too.
            raise ValueError(
                f"{type(self).__name__} needs a dataset of images with boxes and their COCO categories, but this "
                f"one (converted from a {kind!r} source) has no categories in its index.json; convert the COCO "
                "images and annotations with 'dali-pipes convert coco'"
            )
        ids = _check_category_ids("manifest extra['categories']", [c["id"] for c in categories])
        if self.category_ids is None:
            return dataclasses.replace(self, category_ids=ids)
        missing = sorted(set(ids) - set(self.category_ids))
        if missing:
            raise ValueError(
                f"{type(self).__name__}.category_ids lacks the dataset's category id(s) {missing[:10]}; "
                "leave category_ids out to take them from the manifest"
            )
        return self

    # --- graph pieces shared by both specs ---------------------------------------------------

    def _relative_targets(
        self, inputs: Mapping[str, DataNode], image_hw: DataNode, per_box: Optional[DataNode] = None
    ) -> tuple[DataNode, DataNode]:
        """Relative ``xyXY`` boxes in ``[0, 1]`` and int32 labels, crowd (dropped or packed) and empty boxes pruned.

        ``image_hw`` is the float ``(height, width)`` of the decoded image. ``per_box``
        (int32, each in ``0..PER_BOX_BASE-1``) rides along packed into the labels,
        as the crowd flag does; :func:`unpack_per_box` takes it out again.
        """
        labels = self._labels(inputs["category_id"])
        wh = fn.stack(image_hw[1], image_hw[0], image_hw[1], image_hw[0])
        xywh = inputs["boxes"] / wh
        boxes = dmath.clamp(fn.cat(xywh[:, 0:2], xywh[:, 0:2] + xywh[:, 2:4], axis=1), 0.0, 1.0)
        crowd = inputs["iscrowd"]
        if self.crowd == "drop":
            # A crowd box becomes [0, 0, 0, 0]: zero area, so the pruning below removes it.
            keep = 1.0 - fn.cast(fn.expand_dims(crowd, axes=[1]), dtype=types.FLOAT)
            boxes = boxes * keep
        else:
            labels = (labels + 1) * 2 + fn.cast(crowd, dtype=types.INT32)
        if per_box is not None:
            # Kept positive (labels >= -1), so that DALI's integer division unpacks it exactly.
            labels = (labels + 1) * PER_BOX_BASE + per_box
        # The whole image as the crop window (crop_shape == input_shape): keeps every box
        # with a positive area inside it, drops the rest. One attempt, so a sample whose
        # boxes all go takes the (empty) result instead of retrying forever.
        _, _, boxes, labels = fn.random_bbox_crop(
            boxes,
            labels,
            crop_shape=[1, 1],
            input_shape=[1, 1],
            bbox_layout="xyXY",
            bbox_prune_threshold=0.5,
            allow_no_crop=False,
            thresholds=[0.0],
            num_attempts=1,
            total_num_attempts=1,
            quiet=True,
        )
        return boxes, labels

    def _labels(self, category_id: DataNode) -> DataNode:
        if not self.contiguous_labels:
            return fn.cast(category_id, dtype=types.INT32)
        if self.category_ids is None:
            raise ValueError(
                f"{type(self).__name__}: contiguous_labels=True needs the dataset's category ids: build the spec "
                "with spec.bind(load_manifest(path)) (DALILoader does this itself where it supports bind), "
                "pass category_ids=, or set contiguous_labels=False"
            )
        ids = list(self.category_ids)
        # -1 for an id the mapping lacks; bind() checks that none is missing.
        return fn.lookup_table(
            category_id, keys=ids, values=[float(k) for k in range(len(ids))], default_value=-1.0, dtype=types.INT32
        )

    def _output_size(self, source_hw: DataNode) -> DataNode:
        """The resized ``(height, width)``, float32, from the float ``(height, width)`` of what is resized.

        Computed here on the CPU and handed to ``resize`` explicitly, so the box
        scaling never waits for a GPU result: the shorter side becomes ``size``
        unless the longer would then exceed ``max_size`` (torchvision's rule).
        """
        if isinstance(self.size, tuple):
            return fn.constant(fdata=[float(v) for v in self.size], dtype=types.FLOAT)
        scale = self.size / dmath.min(source_hw[0], source_hw[1])
        if self.max_size is not None:
            scale = dmath.min(scale, self.max_size / dmath.max(source_hw[0], source_hw[1]))
        return dmath.max(dmath.floor(source_hw * scale + 0.5), 1.0)

    def _finish_detection(
        self,
        images: DataNode,
        source_hw: DataNode,
        boxes: DataNode,
        labels: DataNode,
        *,
        device: str,
        mirror: DataNode | int = 0,
        jitter: Optional[ColorJitter] = None,
    ) -> dict[str, DataNode]:
        """Resize, scale the relative boxes to match, jitter, normalise and pad; the named outputs.

        ``source_hw`` is the float ``(height, width)`` of ``images`` before the resize.
        """
        out_hw = self._output_size(source_hw)
        images = fn.resize(images, device=device, size=out_hw, interp_type=types.INTERP_LINEAR, antialias=True)
        if jitter is not None:
            # After the resize: the jitter then touches the output's pixels, not the source's.
            images = ops.color_jitter(images, jitter, device=device, output_dtype=self.dtype)
        # resize maps the whole input extent onto the whole output extent, so relative
        # boxes times the output size are exact in continuous coordinates.
        boxes = boxes * fn.stack(out_hw[1], out_hw[0], out_hw[1], out_hw[0])
        if ops.needs_normalize(dtype=self.dtype, layout=self.layout, mirror=mirror, crop=None):
            images = self._normalize(images, device=device, mirror=mirror)
        if not isinstance(self.size, tuple):
            images = fn.pad(images, device=device, axes=(1, 2) if self.layout == "NCHW" else (0, 1), fill_value=0.0)
        num_boxes = boxes.shape(dtype=types.INT64)[0]
        if self.crowd == "keep":
            packed = labels
            labels = packed // 2 - 1
            crowd = fn.cast(packed - (packed // 2) * 2, dtype=types.UINT8)
        outputs = {
            "image": images,
            "image_size": fn.cast(out_hw, dtype=types.INT64),
            "boxes": _pad_rows(boxes, 0.0),
            "labels": _pad_rows(fn.cast(labels, dtype=types.INT64), -1.0),
            "num_boxes": num_boxes,
        }
        if self.crowd == "keep":
            outputs["iscrowd"] = _pad_rows(crowd, 0.0)
        return _on_device(outputs, device)


@dataclass(frozen=True, kw_only=True)
class Detection(_DetectionOutput):
    """COCO-style detection training: SSD random crop, flip, resize, colour jitter, normalise.

    ``crop="ssd"`` samples a window as SSD does (a minimum IoU with every box
    drawn from :data:`SSD_IOU_THRESHOLDS`, or the whole image), decodes only that
    window and keeps the boxes whose centre lies in it, clipped to it; ``None``
    keeps the whole image. ``flip`` is the probability of a horizontal flip of
    image and boxes; ``jitter=None`` turns colour jitter off. The outputs are
    listed in the module docstring; see :class:`_DetectionOutput` for the rest.
    """

    crop: Optional[Literal["ssd"]] = "ssd"
    flip: float = 0.5
    jitter: Optional[ColorJitter] = field(default_factory=ColorJitter)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("Detection.crop", self.crop, CROP_POLICIES)
        check_flip_and_jitter(self, "Detection")

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the training graph; return the outputs of the module docstring (see :class:`PipelineSpec`)."""
        check_build_call(self, inputs, device)
        t = self._augment(inputs, device=device)
        return self._finish_detection(
            t.images, t.image_hw, t.boxes, t.labels, device=device, mirror=t.mirror, jitter=self.jitter
        )

    def _augment(self, inputs: Mapping[str, DataNode], *, device: str, per_box: Optional[DataNode] = None) -> Augmented:
        """Decode the (SSD-cropped) image; boxes and labels pruned, cropped and flipped to match; the flip coin."""
        encoded = inputs["image"]
        image_hw = fn.cast(fn.peek_image_shape(encoded)[0:2], dtype=types.FLOAT)
        boxes, labels = self._relative_targets(inputs, image_hw, per_box)
        anchor = shape = None
        if self.crop == "ssd":
            anchor, shape, boxes, labels = fn.random_bbox_crop(
                boxes,
                labels,
                thresholds=list(SSD_IOU_THRESHOLDS),
                scaling=list(SSD_SCALING),
                aspect_ratio=list(SSD_ASPECT_RATIO),
                bbox_layout="xyXY",
                allow_no_crop=True,
                num_attempts=1,
                total_num_attempts=_SSD_TOTAL_ATTEMPTS,
                quiet=True,
            )
            images = ops.decode_slice(encoded, anchor, shape, device=device, hints=self.decoder)
            # The window in pixels; shape is relative [w, h].
            image_hw = image_hw * fn.stack(shape[1], shape[0])
        else:
            images = ops.decode(encoded, device=device, hints=self.decoder)
        mirror = ops.mirror_flag(self.flip)
        if not (isinstance(mirror, int) and mirror == 0):
            boxes = fn.bb_flip(boxes, ltrb=True, horizontal=mirror)
        return Augmented(images, image_hw, boxes, labels, mirror, anchor, shape)


@dataclass(frozen=True, kw_only=True)
class DetectionVal(_DetectionOutput):
    """COCO-style detection evaluation: decode, resize, normalise and pad; boxes scaled to match.

    Deterministic. Outputs those of the module docstring plus ``image_id`` and
    ``orig_size``; see :class:`_DetectionOutput` for the arguments.
    """

    #: Evaluation reads every sample in order: a loader given this spec does not shuffle unless told to.
    shuffle_by_default: ClassVar[bool] = False

    @property
    def required_fields(self) -> tuple[str, ...]:
        """The training fields plus ``image_id``."""
        return _FIELDS + ("image_id",)

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the evaluation graph; return its outputs (see :class:`PipelineSpec`)."""
        check_build_call(self, inputs, device)
        encoded = inputs["image"]
        orig_size = fn.peek_image_shape(encoded, dtype=types.INT64)[0:2]
        image_hw = fn.cast(orig_size, dtype=types.FLOAT)
        boxes, labels = self._relative_targets(inputs, image_hw)
        images = ops.decode(encoded, device=device, hints=self.decoder)
        outputs = self._finish_detection(images, image_hw, boxes, labels, device=device)
        extra = {"image_id": inputs["image_id"], "orig_size": orig_size}
        outputs.update(_on_device(extra, device))
        return outputs


# --- helpers ---------------------------------------------------------------------------------


class Augmented(NamedTuple):
    """What :meth:`Detection._augment` made: the decoded window, its float ``(height, width)``, relative
    ``xyXY`` boxes, int32 labels (packed), the flip coin, and the crop window (relative ``[x, y]``/``[w, h]``,
    ``None`` without a crop)."""

    images: DataNode
    image_hw: DataNode
    boxes: DataNode
    labels: DataNode
    mirror: DataNode | int
    anchor: Optional[DataNode]
    shape: Optional[DataNode]


def unpack_per_box(packed: DataNode) -> tuple[DataNode, DataNode]:
    """``(labels, per_box)`` from labels packed by :meth:`_DetectionOutput._relative_targets` with ``per_box``."""
    high = packed // PER_BOX_BASE
    return high - 1, packed - high * PER_BOX_BASE


def _pad_rows(node: DataNode, fill: float) -> DataNode:
    """Pad the first axis to the batch's largest count, and to at least one row.

    The one-row minimum keeps every output non-empty when no image of the
    batch has a box (a zero-width tensor breaks many ``max``/``cat`` idioms).
    """
    # pad's `shape` is a minimum that turns off padding to the batch maximum, hence two pads.
    at_least_one = fn.pad(node, axes=(0,), shape=(1,), fill_value=fill)
    return fn.pad(at_least_one, axes=(0,), fill_value=fill)


def _on_device(nodes: Mapping[str, DataNode], device: str) -> dict[str, DataNode]:
    """Move CPU nodes to the GPU when the pipeline runs there, so every output is on one device."""
    if device != "gpu":
        return dict(nodes)
    return {name: node if node.device == "gpu" else node.gpu() for name, node in nodes.items()}


def _check_output_size(name: str, value: Any) -> int | tuple[int, int]:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != 2:
            raise ValueError(f"{name} must be (height, width) or a shorter side, got {value!r}")
        return (check_size(name, value[0]), check_size(name, value[1]))
    return check_size(name, value)


def _check_category_ids(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a sequence of integer category ids, got {values!r}")
    values = list(values)
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be integers, got {values!r}")
    ids = sorted(int(v) for v in values)
    if not ids:
        raise ValueError(f"{name} is empty: a detection dataset needs at least one category")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} has repeated ids: {values!r}")
    if ids[0] < 0 or ids[-1] > _MAX_CATEGORY_ID:
        raise ValueError(f"{name} must lie in 0..{_MAX_CATEGORY_ID} (DALI's lookup_table), got {ids[0]}..{ids[-1]}")
    return tuple(ids)
