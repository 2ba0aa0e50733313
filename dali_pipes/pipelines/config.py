"""Values the pipeline specs are configured with, and their validation.

Nothing here imports DALI: a spec can be built, compared, pickled and validated
in a process that never runs a pipeline. The mapping to DALI types lives in
:mod:`dali_pipes.pipelines.ops`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal, Sequence

#: ImageNet channel means and standard deviations, RGB, in 0..1 (torchvision's values).
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

OutputDType = Literal["float16", "bfloat16", "float32", "uint8"]
OutputLayout = Literal["NCHW", "NHWC"]
AutoAugmentPolicy = Literal["rand_augment", "trivial_augment"]

DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "uint8")
#: Output dtypes DALI has no type for: the graph makes float32, and the loader casts on the output's device.
CAST_AFTER_DALI: dict[str, str] = {"bfloat16": "float32"}
LAYOUTS: tuple[str, ...] = ("NCHW", "NHWC")
#: The resize filters: torchvision's and timm's names (``"random"``: bilinear or bicubic, drawn per image, timm's
#: default for training).
INTERPOLATIONS: tuple[str, ...] = ("bilinear", "bicubic", "random")
AUTO_AUGMENT_POLICIES: tuple[str, ...] = ("rand_augment", "trivial_augment")
#: DALI's own default ``hw_decoder_load`` (its decoders' schema): the floor of the load chosen automatically.
DALI_HW_DECODER_LOAD = 0.65
#: Up to this many pipeline threads, every JPEG goes to the hardware decoder by default (DecoderHints): that few
#: threads decode fewer JPEGs on nvJPEG's CUDA path than the hardware engines do; with more threads the CUDA path
#: gets DALI's default share again.
HW_ONLY_MAX_THREADS = 32
#: Largest value of a DALI ``INT32`` operator argument (the decoder's memory paddings and size hints).
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class ColorJitter:
    """Colour jitter strengths with torchvision's ``ColorJitter`` meaning.

    Per image, brightness, contrast and saturation factors are drawn uniformly
    from ``[max(0, 1 - x), 1 + x]`` and the hue shift from ``[-hue, hue]``, a
    fraction of the colour wheel (``0 <= hue <= 0.5``). A strength of 0 turns
    that adjustment off. Three differences from torchvision remain, all DALI's
    ``color_twist``, which does the four adjustments as one fused colour matrix
    (one operator instead of four): they apply in a fixed order rather than a
    random one; contrast scales around mid-grey (128) rather than the image's
    mean grey; hue rotates the chroma plane of YIQ (luma kept) rather than
    shifting H in HSV, by ``360 * shift`` degrees.
    """

    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.1

    def __post_init__(self) -> None:
        for name in ("brightness", "contrast", "saturation", "hue"):
            value = _finite_float(f"ColorJitter.{name}", getattr(self, name))
            if value < 0:
                raise ValueError(f"ColorJitter.{name} must be >= 0, got {value}")
            object.__setattr__(self, name, value)
        if self.hue > 0.5:
            raise ValueError(f"ColorJitter.hue is a fraction of the colour wheel and must be <= 0.5, got {self.hue}")

    @property
    def brightness_range(self) -> tuple[float, float]:
        """Range of the brightness factor."""
        return _factor_range(self.brightness)

    @property
    def contrast_range(self) -> tuple[float, float]:
        """Range of the contrast factor."""
        return _factor_range(self.contrast)

    @property
    def saturation_range(self) -> tuple[float, float]:
        """Range of the saturation factor."""
        return _factor_range(self.saturation)

    @property
    def hue_degrees(self) -> tuple[float, float]:
        """Range of the hue shift in degrees, the unit DALI's ``color_twist`` takes."""
        return (-360.0 * self.hue, 360.0 * self.hue)

    @property
    def is_identity(self) -> bool:
        """True when every strength is 0, so the jitter changes nothing."""
        return self.brightness == self.contrast == self.saturation == self.hue == 0.0


@dataclass(frozen=True)
class DecoderHints:
    """Memory and load hints for the GPU (``mixed``) JPEG decoder; ignored on the CPU.

    The memory defaults are DALI's own, safe on any GPU. For ImageNet-scale training on a
    large GPU, :meth:`imagenet` preallocates for the largest ImageNet JPEG so the
    decoder never reallocates mid-epoch (the values of NVIDIA's ResNet-50 example).
    The sizes are DALI ``INT32`` arguments, so each must be below 2 GiB.

    ``hw_decoder_load`` is the share of JPEGs sent to the hardware decoder
    (A100/H100 and later); nvJPEG's CUDA path decodes the rest, with its Huffman
    decoding on the pipeline's CPU threads. ``None`` (the default) chooses it when
    the pipeline is built (:meth:`chosen_load`): every JPEG to the hardware decoder
    where there is one and the pipeline has at most :data:`HW_ONLY_MAX_THREADS`
    threads, else DALI's default, 0.65: the two paths share the CPU threads rather
    than add up, and that few threads decode fewer JPEGs on the CUDA path than the
    hardware engines do, at more CPU per image. The best share depends on the GPU,
    the threads and the images (the figures are in ``dali_pipes/bench/README.md``):
    ``dali-pipes tune --decoder-only`` or ``bench --suite gpu-decoder`` measures it
    on your machine.

    ``jpeg_fancy_upsampling`` makes the GPU decoder upsample chroma the way
    libjpeg-turbo (the CPU decoder) does, which brings the colour edges of 4:2:0
    JPEGs within a few levels of the CPU's, with the CUDA and the hardware decoder
    alike (the bench README has the figures). DALI leaves it off on the GPU.
    The default, ``None``, turns it on where the GPU decoders keep their
    speed with it: whole-image decodes (the validation pipelines), so that those
    give nearly the CPU's pixels. Region decodes (random crops, slices) get nvJPEG's
    own upsampling, because nvJPEG before 13.2 (CUDA 13.3) declines a region decode
    with fancy upsampling, which then falls back to libjpeg-turbo on the CPU threads,
    several times slower than the GPU.
    ``True`` or ``False`` forces it either way for every decode (``dali-pipes tune``
    measures it forced on).
    """

    hw_decoder_load: float | None = None
    device_memory_padding: int = 16 * 1024 * 1024
    host_memory_padding: int = 8 * 1024 * 1024
    preallocate_width_hint: int = 0
    preallocate_height_hint: int = 0
    jpeg_fancy_upsampling: bool | None = None

    def __post_init__(self) -> None:
        if self.hw_decoder_load is not None:
            load = _finite_float("DecoderHints.hw_decoder_load", self.hw_decoder_load)
            if not 0.0 <= load <= 1.0:
                raise ValueError(
                    f"DecoderHints.hw_decoder_load must be in [0, 1] (or None: chosen for the machine), got {load}"
                )
            object.__setattr__(self, "hw_decoder_load", load)
        for name in (
            "device_memory_padding",
            "host_memory_padding",
            "preallocate_width_hint",
            "preallocate_height_hint",
        ):
            value = getattr(self, name)
            if not _is_int(value) or not 0 <= value <= INT32_MAX:
                # DALI holds these as INT32: a larger value fails only when the GPU pipeline is built.
                raise ValueError(
                    f"DecoderHints.{name} must be an integer in [0, {INT32_MAX}] (DALI holds it as a 32-bit int), "
                    f"got {value!r}"
                )
            object.__setattr__(self, name, int(value))
        if self.jpeg_fancy_upsampling is not None and not isinstance(self.jpeg_fancy_upsampling, bool):
            raise ValueError(
                "DecoderHints.jpeg_fancy_upsampling must be True, False or None (on for whole-image decodes only), "
                f"got {self.jpeg_fancy_upsampling!r}"
            )

    @classmethod
    def imagenet(cls) -> DecoderHints:
        """Hints sized for ImageNet's largest JPEG (5980 x 6430), for GPUs with memory to spare."""
        return cls(
            device_memory_padding=211_025_920,
            host_memory_padding=140_544_512,
            preallocate_width_hint=5980,
            preallocate_height_hint=6430,
        )

    def chosen_load(self, *, threads: int, hw_decoder: bool) -> tuple[float, str]:
        """``hw_decoder_load`` for a pipeline of ``threads`` CPU threads on a GPU with (or without) the
        hardware JPEG decoder, and why: the value given, else the choice described in the class docstring."""
        if self.hw_decoder_load is not None:
            return self.hw_decoder_load, "as given"
        if not hw_decoder:
            return DALI_HW_DECODER_LOAD, "DALI's default: this GPU has no hardware JPEG decoder, the value is unused"
        if threads <= HW_ONLY_MAX_THREADS:
            return 1.0, (
                f"this GPU's hardware JPEG decoder takes every JPEG: {threads} CPU threads "
                f"(<= {HW_ONLY_MAX_THREADS}) decode fewer on nvJPEG's CUDA path than the hardware engines"
            )
        return DALI_HW_DECODER_LOAD, f"DALI's default: {threads} CPU threads (> {HW_ONLY_MAX_THREADS}) share the work"

    def as_kwargs(self, *, region: bool = False, load: float | None = None) -> dict[str, Any]:
        """The hints as keyword arguments of DALI's ``mixed`` image decoders.

        ``region``: the decoder decodes a window of each image (random crop, slice),
        where the default leaves fancy upsampling off (see the class docstring).
        ``load``: the ``hw_decoder_load`` chosen for this pipeline (:meth:`chosen_load`)
        when the hints leave it ``None``; DALI's default without either.
        """
        fancy = self.jpeg_fancy_upsampling
        if fancy is None:
            fancy = not region
        if load is None:
            load = DALI_HW_DECODER_LOAD if self.hw_decoder_load is None else self.hw_decoder_load
        return {
            "hw_decoder_load": load,
            "device_memory_padding": self.device_memory_padding,
            "host_memory_padding": self.host_memory_padding,
            "preallocate_width_hint": self.preallocate_width_hint,
            "preallocate_height_hint": self.preallocate_height_hint,
            "jpeg_fancy_upsampling": fancy,
        }


def check_size(name: str, value: Any) -> int:
    """``value`` as a positive pixel count, or ValueError naming ``name``."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_range(name: str, value: Any, *, upper: float = math.inf) -> tuple[float, float]:
    """``value`` as a ``(low, high)`` pair with ``0 < low <= high <= upper``."""
    items = _items(value, 2)
    if items is None:
        raise ValueError(f"{name} must be a (low, high) pair, got {value!r}")
    low, high = (_finite_float(name, v) for v in items)
    if not 0.0 < low <= high <= upper:
        bound = "" if math.isinf(upper) else f" <= {upper:g}"
        raise ValueError(f"{name} must satisfy 0 < low <= high{bound}, got {value!r}")
    return (low, high)


def check_probability(name: str, value: Any) -> float:
    """``value`` as a probability in ``[0, 1]``."""
    p = _finite_float(name, value)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
    return p


def check_window(spec: Any, name: str, *, max_scale: float) -> None:
    """Check a random window's ``scale`` (its share of the image's area, at most ``max_scale``) and ``ratio`` (its
    width/height), each a ``(low, high)`` range stored as floats; ``name``, the spec's class, begins the errors."""
    object.__setattr__(spec, "scale", check_range(f"{name}.scale", spec.scale, upper=max_scale))
    object.__setattr__(spec, "ratio", check_range(f"{name}.ratio", spec.ratio))


def check_flip_and_jitter(spec: Any, name: str) -> None:
    """Check a training spec's ``flip`` (a probability, stored as a float) and ``jitter`` (a :class:`ColorJitter`
    or None); ``name``, the spec's class, begins the errors."""
    object.__setattr__(spec, "flip", check_probability(f"{name}.flip", spec.flip))
    if spec.jitter is not None and not isinstance(spec.jitter, ColorJitter):
        raise ValueError(f"{name}.jitter must be a ColorJitter or None, got {spec.jitter!r}")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_channels(name: str, value: Any, *, positive: bool) -> tuple[float, float, float]:
    """``value`` as one float per RGB channel (a single number is repeated)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = (value,) * 3
    items = _items(value, 3)
    if items is None:
        raise ValueError(f"{name} must be 3 numbers, one per RGB channel (0..1 scale), got {value!r}")
    out = tuple(_finite_float(name, v) for v in items)
    if positive and min(out) <= 0:
        raise ValueError(f"{name} must be > 0 in every channel, got {value!r}")
    return out  # type: ignore[return-value]


def _factor_range(strength: float) -> tuple[float, float]:
    return (max(0.0, 1.0 - strength), 1.0 + strength)


def _items(value: Any, count: int) -> list[Any] | None:
    """The elements of a list, tuple or 1-D array of ``count`` elements, else None."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        items = list(value)
    except TypeError:
        return None
    return items if len(items) == count else None


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)
