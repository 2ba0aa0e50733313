"""Image classification pipeline specs: ImageNet-style training and validation."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Mapping, Optional

from nvidia.dali.data_node import DataNode

from dali_pipes.pipelines import ops, recipe_ops
from dali_pipes.pipelines.base import check_build_call, label_output
from dali_pipes.pipelines.batch_inputs import BatchInputs
from dali_pipes.pipelines.config import (
    AUTO_AUGMENT_POLICIES,
    CAST_AFTER_DALI,
    DTYPES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATIONS,
    LAYOUTS,
    AutoAugmentPolicy,
    ColorJitter,
    DecoderHints,
    OutputDType,
    OutputLayout,
    check_channels,
    check_choice,
    check_flip_and_jitter,
    check_size,
    check_window,
)
from dali_pipes.pipelines.erasing import RandomErasing
from dali_pipes.pipelines.mixing import Mix
from dali_pipes.pipelines.schedule import check_size_spec, size_at

_FIELDS = ("image", "label")

#: One step of a graph: the image node in, the image node out.
ImageStage = Callable[[DataNode], DataNode]


@dataclass(frozen=True, kw_only=True)
class _ImageOutput:
    """What both classification specs share: how images are normalised and handed out.

    ``mean``/``std`` are per RGB channel in 0..1 (ignored for ``uint8`` output,
    which stays in 0..255); ``dtype`` is ``"float32"``, ``"float16"``, ``"bfloat16"``
    or ``"uint8"`` (DALI has no bfloat16: the graph makes float32 and the loader casts
    on the output's device, see :attr:`output_casts`); ``layout`` is the batch layout, ``"NCHW"`` or ``"NHWC"``;
    ``decoder`` tunes the GPU decoder. ``antialias`` (default True, as torchvision and
    PIL) filters when the resize shrinks; False resizes as OpenCV's ``INTER_LINEAR``
    (Albumentations' default) does: less CPU per image, with aliasing on strong
    reductions (see the bench's antialias rows). ``interpolation`` is the resize filter:
    ``"bilinear"`` (default, torchvision's reference), ``"bicubic"``, or ``"random"`` (one of
    the two per image, timm's training default).
    """

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    dtype: OutputDType = "float32"
    layout: OutputLayout = "NCHW"
    decoder: DecoderHints = field(default_factory=DecoderHints)
    antialias: bool = True
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.antialias, bool):
            raise ValueError(f"{name}.antialias must be True or False, got {self.antialias!r}")
        object.__setattr__(self, "mean", check_channels(f"{name}.mean", self.mean, positive=False))
        object.__setattr__(self, "std", check_channels(f"{name}.std", self.std, positive=True))
        check_choice(f"{name}.dtype", self.dtype, DTYPES)
        check_choice(f"{name}.layout", self.layout, LAYOUTS)
        check_choice(f"{name}.interpolation", self.interpolation, INTERPOLATIONS)
        if not isinstance(self.decoder, DecoderHints):
            raise ValueError(f"{name}.decoder must be a DecoderHints, got {self.decoder!r}")

    @property
    def required_fields(self) -> tuple[str, ...]:
        """The dataset fields read: the encoded image and its integer label."""
        return _FIELDS

    @property
    def needs_conditionals(self) -> bool:
        """False: the graph has no data-dependent branches (a spec whose graph has some says True)."""
        return False

    @property
    def output_casts(self) -> dict[str, str]:
        """Outputs the loader casts after DALI, to a torch dtype by name: ``{"image": "bfloat16"}`` or none."""
        return {"image": self.dtype} if self.dtype in CAST_AFTER_DALI else {}

    def _normalize(
        self,
        images: DataNode,
        *,
        device: str,
        mirror: DataNode | int = 0,
        crop: int | None = None,
        crop_pos: tuple[DataNode, DataNode] | None = None,
        dtype: str | None = None,
    ) -> DataNode:
        """This spec's ``crop_mirror_normalize``: its mean, std, dtype (unless ``dtype`` is given) and layout."""
        return ops.normalize(
            images,
            device=device,
            mean=self.mean,
            std=self.std,
            dtype=dtype or self.dtype,
            layout=self.layout,
            mirror=mirror,
            crop=crop,
            crop_pos=crop_pos,
        )


@dataclass(frozen=True, kw_only=True)
class ClassificationTrain(_ImageOutput):
    """ImageNet-style training augmentation.

    Random-resized crop (fused with decoding) to ``size`` x ``size``, optional
    RandAugment/TrivialAugment, colour jitter, horizontal flip with probability
    ``flip``, then normalise, cast and lay out in one operator.

    ``scale`` is the range of the crop's area as a fraction of the image,
    ``ratio`` the range of its width/height; ``jitter=None`` turns colour jitter
    off; ``auto_augment`` is ``None``, ``"rand_augment"`` (n=2, m=9) or
    ``"trivial_augment"`` (TrivialAugment Wide) and is applied on the uint8 crop
    before the colour jitter. Recipes that use auto-augment usually drop colour
    jitter: pass ``jitter=None`` for that. See :class:`_ImageOutput` for
    ``mean``, ``std``, ``dtype``, ``layout`` and ``decoder``.
    """

    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    jitter: Optional[ColorJitter] = field(default_factory=ColorJitter)
    auto_augment: Optional[AutoAugmentPolicy] = None
    mix: Optional[Mix] = None
    erasing: Optional[RandomErasing] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "size", check_size_spec("ClassificationTrain.size", self.size))
        check_window(self, "ClassificationTrain", max_scale=1.0)
        check_flip_and_jitter(self, "ClassificationTrain")
        if self.auto_augment is not None:
            check_choice("ClassificationTrain.auto_augment", self.auto_augment, AUTO_AUGMENT_POLICIES)
        _check_recipe(self)

    @property
    def needs_conditionals(self) -> bool:
        """True with ``auto_augment``: DALI's auto_aug selects operations with ``if``."""
        return self.auto_augment is not None

    @property
    def scheduled(self) -> bool:
        """True when the output size changes with the epoch (``size`` is a schedule)."""
        return not isinstance(self.size, int)

    def size_at(self, epoch: int) -> int:
        """The output size of the batches of ``epoch``."""
        return size_at("ClassificationTrain.size", self.size, epoch)

    @property
    def _normalized_dtype(self) -> str:
        """The normaliser's dtype: float32 under erasing/mixing (DALI's CPU arithmetic has no float16), else ``dtype``."""
        recipe = self.mix is not None or self.erasing is not None
        return "float32" if recipe and self.dtype == "float16" else self.dtype

    @property
    def batch_inputs(self) -> Optional[BatchInputs]:
        """What the loader's source feeds the graph per batch (size, mix and erasing draws), or None."""
        if not (self.scheduled or self.mix or self.erasing):
            return None
        return BatchInputs(self.scheduled, self.mix, self.erasing, channels_first=self.layout == "NCHW")

    def bind(self, manifest: Any) -> "ClassificationTrain":
        """This spec with ``mix.num_classes`` taken from the dataset's classes when it was left ``None``."""
        if self.mix is None or self.mix.num_classes is not None:
            return self
        classes = len(getattr(manifest, "classes", None) or ())
        if classes < 2:
            raise ValueError(
                f"Mix.num_classes is None and the dataset names {classes} class(es); pass Mix(num_classes=...)"
            )
        return replace(self, mix=replace(self.mix, num_classes=classes))

    def image_stages(
        self, *, device: str, inputs: Optional[Mapping[str, DataNode]] = None
    ) -> list[tuple[str, ImageStage]]:
        """The training graph as named steps, each taking and returning the image node.

        :meth:`build` applies them all in order; ``dali-pipes bench --suite stages``
        times growing prefixes of them to show what each step costs. The random
        numbers of a step are drawn when the step is applied, so applying the list
        in order adds DALI operators in the same order as :meth:`build`. ``inputs``
        are the per-batch inputs (see :attr:`batch_inputs`), needed when there are any.
        """
        inputs = _batch_inputs_of(self, inputs or {})
        size: Any = inputs["size"] if self.scheduled else self.size
        stages: list[tuple[str, ImageStage]] = [
            (
                "decode random crop",
                lambda images: ops.decode_random_crop(
                    images, device=device, area=self.scale, aspect_ratio=self.ratio, hints=self.decoder
                ),
            ),
            (
                "resize",
                lambda images: ops.resize_to(
                    images, device=device, size=size, antialias=self.antialias, interpolation=self.interpolation
                ),
            ),
        ]
        if self.auto_augment is not None:
            policy = self.auto_augment
            stages.append((policy, lambda images: ops.auto_augment(images, policy, size=size)))
        if self.jitter is not None:
            jitter = self.jitter
            # After the resize: the jitter then touches size*size pixels, not the crop's.
            stages.append(
                (
                    "colour jitter",
                    lambda images: ops.color_jitter(images, jitter, device=device, output_dtype=self.dtype),
                )
            )
        # uint8 NHWC output with nothing to flip needs no final operator at all.
        if ops.needs_normalize(dtype=self.dtype, layout=self.layout, mirror=int(self.flip > 0), crop=None):
            stages.append(
                (
                    "flip, normalise, cast, layout",
                    lambda images: self._normalize(
                        images, device=device, mirror=ops.mirror_flag(self.flip), dtype=self._normalized_dtype
                    ),
                )
            )
        return stages + self._recipe_stages(inputs, device=device)

    def _recipe_stages(self, inputs: Mapping[str, DataNode], *, device: str) -> list[tuple[str, ImageStage]]:
        """RandomErasing, then MixUp/CutMix, on the normalised images (timm's order), then float16 again."""
        stages: list[tuple[str, ImageStage]] = []
        erasing, mix = self.erasing, self.mix
        if erasing is not None:
            stages.append(
                (
                    "random erasing",
                    lambda images: recipe_ops.erase(
                        images, inputs, erasing, device=device, channels_first=self.layout == "NCHW"
                    ),
                )
            )
        if mix is not None:
            stages.append(("mixup/cutmix", lambda images: recipe_ops.mix_images(images, inputs, mix, device=device)))
        if stages and self.dtype == "float16":
            # The recipe works in float32 (see _normalized_dtype): float16 once it is done.
            stages.append(("cast", lambda images: recipe_ops.cast_float16(images, self.dtype, device=device)))
        return stages

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the training graph; return ``{"image": ..., "label": ...}`` (see :class:`PipelineSpec`).

        With :attr:`mix` the label is the float soft target ``[num_classes]``.
        """
        check_build_call(self, inputs, device)
        images = inputs["image"]
        for _, stage in self.image_stages(device=device, inputs=inputs):
            images = stage(images)
        labels = inputs["label"]
        if self.mix is not None:
            labels = recipe_ops.mix_labels(labels, inputs, self.mix)
        return {"image": images, "label": label_output(labels, device)}


def _check_recipe(spec: ClassificationTrain) -> None:
    """ValueError for a mix or erasing setting the spec cannot apply, naming the argument."""
    if spec.mix is not None and not isinstance(spec.mix, Mix):
        raise ValueError(f"ClassificationTrain.mix must be a Mix or None, got {spec.mix!r}")
    if spec.erasing is not None and not isinstance(spec.erasing, RandomErasing):
        raise ValueError(f"ClassificationTrain.erasing must be a RandomErasing or None, got {spec.erasing!r}")
    if (spec.mix is not None or spec.erasing is not None) and spec.dtype == "uint8":
        raise ValueError(
            "ClassificationTrain: mix and erasing work on normalised images and need a float dtype "
            "(float32, float16 or bfloat16), not dtype='uint8'"
        )


def _batch_inputs_of(spec: ClassificationTrain, inputs: Mapping[str, DataNode]) -> Mapping[str, DataNode]:
    """``inputs``, checked to hold every per-batch input the spec needs (a DALILoader feeds them)."""
    wanted = spec.batch_inputs
    missing = [name for name in (wanted.names if wanted else ()) if name not in inputs]
    if missing:
        raise ValueError(
            f"ClassificationTrain.build: no node for the per-batch input(s) {', '.join(map(repr, missing))}; "
            "a spec with a size schedule, mix or erasing gets them from DALILoader (see its batch_inputs)"
        )
    return inputs


@dataclass(frozen=True, kw_only=True)
class ClassificationVal(_ImageOutput):
    """ImageNet-style evaluation: resize the shorter side to ``resize``, centre crop ``size``, normalise.

    The geometry of torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` (timm's evaluation
    transform too): the longer side becomes ``int(resize * long / short)``, and the window starts
    ``int(round((n - size) / 2))`` pixels in on each axis, Python's round (halves to even: 4 for
    a margin of 9). Deterministic; ``resize`` must be at least ``size``. See :class:`_ImageOutput`
    for ``mean``, ``std``, ``dtype``, ``layout`` and ``decoder``.
    """

    #: Evaluation reads every sample in order: a loader given this spec does not shuffle unless told to.
    shuffle_by_default: ClassVar[bool] = False

    size: int = 224
    resize: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "size", check_size("ClassificationVal.size", self.size))
        object.__setattr__(self, "resize", check_size("ClassificationVal.resize", self.resize))
        if self.resize < self.size:
            raise ValueError(
                f"ClassificationVal.resize ({self.resize}) must be >= size ({self.size}): "
                "the centre crop is taken from the resized image"
            )

    def build(self, inputs: Mapping[str, DataNode], *, device: str) -> dict[str, DataNode]:
        """Add the evaluation graph; return ``{"image": ..., "label": ...}`` (see :class:`PipelineSpec`)."""
        check_build_call(self, inputs, device)
        encoded = inputs["image"]
        images = ops.decode(encoded, device=device, hints=self.decoder)
        images, hw = ops.resize_shorter(
            images,
            encoded=encoded,
            device=device,
            size=self.resize,
            antialias=self.antialias,
            interpolation=self.interpolation,
        )
        # The centre crop always needs the final operator, whatever the dtype and layout.
        crop_pos = ops.centre_crop_position(hw, self.size)
        images = self._normalize(images, device=device, crop=self.size, crop_pos=crop_pos)
        return {"image": images, "label": label_output(inputs["label"], device)}
