"""DALI graph fragments shared by the pipeline specs.

Each function adds a few operators to the pipeline being defined and returns the
new node. ``device`` is ``"cpu"`` or ``"gpu"``: on the GPU the decoder runs
``mixed`` and the image operators run on the GPU, while the per-sample random
numbers stay on the CPU because DALI takes argument inputs from the CPU only.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Iterator, Sequence

import nvidia.dali.fn as fn
import nvidia.dali.math as dali_math
import nvidia.dali.types as types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline

from dali_pipes.dataset.outputs import DALI_TYPE_NAMES
from dali_pipes.pipelines import cpu_resize
from dali_pipes.pipelines.config import CAST_AFTER_DALI, ColorJitter, DecoderHints
from dali_pipes.settings import has_hw_decoder

log = logging.getLogger(__name__)

_DALI_DTYPES = {name: getattr(types, DALI_TYPE_NAMES[name]) for name in ("float16", "float32", "uint8")}
# DALI has no bfloat16: the graph ends in float32 and the loader casts (see _ImageOutput.output_casts).
_DALI_DTYPES.update({name: _DALI_DTYPES[made] for name, made in CAST_AFTER_DALI.items()})
# DALI lays out single samples; the batch dimension N is added by the iterator.
_DALI_LAYOUTS = {"NCHW": "CHW", "NHWC": "HWC"}

# RandAugment's usual strength (torchvision's and timm's default recipe).
_RAND_AUGMENT_N = 2
_RAND_AUGMENT_M = 9


def _decoder_device(device: str) -> str:
    return "mixed" if device == "gpu" else "cpu"


def _decoder_kwargs(device: str, hints: DecoderHints, *, region: bool = False) -> dict:
    # The memory hints only mean something to the mixed decoder.
    if device != "gpu":
        return {}
    load = None
    if hints.hw_decoder_load is None:
        pipe = Pipeline.current()
        threads = pipe.num_threads if pipe is not None else 1
        load, why = hints.chosen_load(threads=threads, hw_decoder=has_hw_decoder(pipe.device_id if pipe else None))
        _log_choice_once(
            f"GPU JPEG decoder: hw_decoder_load {load:g} ({why}); set DecoderHints(hw_decoder_load=...) "
            "or run 'dali-pipes tune --decoder-only' to measure it here"
        )
    return hints.as_kwargs(region=region, load=load)


_LOGGED: set[str] = set()


def _log_choice_once(message: str) -> None:
    """Log a choice the first time it is made in this process (every pipeline of a job makes the same one)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.info("%s", message)


def decode(encoded: DataNode, *, device: str, hints: DecoderHints) -> DataNode:
    """Decode whole images to 3-channel RGB uint8 HWC (alpha dropped, grey replicated)."""
    return fn.decoders.image(
        encoded, device=_decoder_device(device), output_type=types.RGB, **_decoder_kwargs(device, hints)
    )


def decode_random_crop(
    encoded: DataNode,
    *,
    device: str,
    area: tuple[float, float],
    aspect_ratio: tuple[float, float],
    hints: DecoderHints,
) -> DataNode:
    """Decode a random window of each image (ROI decoding where the format allows).

    The window's area fraction is drawn from ``area`` and its width/height ratio
    from ``aspect_ratio``, as torchvision's ``RandomResizedCrop`` does, with 10
    attempts before falling back to a centre crop.
    """
    return fn.decoders.image_random_crop(
        encoded,
        device=_decoder_device(device),
        output_type=types.RGB,
        random_area=list(area),
        random_aspect_ratio=list(aspect_ratio),
        num_attempts=10,
        **_decoder_kwargs(device, hints, region=True),
    )


def decode_slice(encoded: DataNode, anchor: DataNode, shape: DataNode, *, device: str, hints: DecoderHints) -> DataNode:
    """Decode only the window ``anchor``/``shape`` (relative ``[x, y]``/``[w, h]``) of each image."""
    return fn.decoders.image_slice(
        encoded,
        anchor,
        shape,
        device=_decoder_device(device),
        output_type=types.RGB,
        axis_names="WH",
        normalized_anchor=True,
        normalized_shape=True,
        **_decoder_kwargs(device, hints, region=True),
    )


def _square(size: int | DataNode) -> list[int] | DataNode:
    """``[size, size]``, or a per-sample ``[h, w]`` node (a size that changes with the epoch) as it is."""
    return size if isinstance(size, DataNode) else [size, size]


def interp_type(interpolation: str = "bilinear") -> Any:
    """DALI's ``interp_type`` for a filter name of :data:`~dali_pipes.pipelines.config.INTERPOLATIONS`.

    ``"random"`` is a per-image draw of bilinear or bicubic (DALI takes the filter
    as a per-sample argument), as timm's ``--train-interpolation random``.
    """
    if interpolation == "bilinear":
        return types.INTERP_LINEAR
    if interpolation == "bicubic":
        return types.INTERP_CUBIC
    choice = fn.random.choice([int(types.INTERP_LINEAR), int(types.INTERP_CUBIC)])
    return fn.cast(choice, dtype=types.INTERP_TYPE)


def resize_to(
    images: DataNode, *, device: str, size: int | DataNode, antialias: bool = True, interpolation: str = "bilinear"
) -> DataNode:
    """Resize to ``size`` x ``size`` (aspect not kept): bilinear, antialiased when shrinking unless told not to.

    ``size`` may be a node of float ``[h, w]`` per sample, fed per batch: the size then
    changes without a new pipeline. Without antialiasing a shrink samples 2x2 pixels per
    output pixel whatever the scale (as OpenCV's ``INTER_LINEAR``, hence Albumentations,
    does): cheaper on the CPU, with aliasing on strong reductions.
    """
    if device == "cpu" and isinstance(size, int) and interpolation == "bilinear" and cpu_resize.available():
        # The same filter, cheaper than DALI's on the CPU; images here come from the RGB decoders: 3 channels, as it
        # needs.
        resized = cpu_resize.resize(images, size, antialias=antialias)
        if resized is not None:  # None: Numba failed to compile (warned once), DALI's resize below
            return resized
    return fn.resize(
        images, device=device, size=_square(size), interp_type=interp_type(interpolation), antialias=antialias
    )


def resize_shorter(
    images: DataNode,
    *,
    encoded: DataNode,
    device: str,
    size: int,
    antialias: bool = True,
    interpolation: str = "bilinear",
) -> tuple[DataNode, DataNode]:
    """Resize as torchvision's ``Resize(size)``: the shorter side to ``size``, the longer to ``int(size * long / short)``.

    Returns the images and their int64 ``[h, w]`` on the CPU (for :func:`centre_crop_position`).
    The output size is worked out here from the encoded image's header and given to ``fn.resize``,
    which then maps the whole image onto it, as PIL and torchvision do. DALI's own
    ``resize_shorter`` rounds the longer side instead of truncating it and keeps the exact scale,
    the image centred in the output: up to a pixel from torchvision along the longer side. See
    :func:`resize_to` for ``antialias``; ``encoded`` is what ``images`` were decoded from.
    """
    hw = fn.peek_image_shape(encoded, dtype=types.INT64)[0:2]  # as decoded: EXIF orientation applied
    # Integer arithmetic: the shorter side becomes size exactly, the longer is truncated as int() does.
    hw = hw * size // dali_math.min(hw[0], hw[1])
    resized = fn.resize(
        images,
        device=device,
        size=fn.cast(hw, dtype=types.FLOAT),
        interp_type=interp_type(interpolation),
        antialias=antialias,
    )
    return resized, hw


def centre_crop_position(hw: DataNode, crop: int) -> tuple[DataNode, DataNode]:
    """``crop_pos`` for :func:`normalize` that puts a ``crop`` x ``crop`` window where torchvision's ``CenterCrop`` does.

    ``hw`` is the int64 ``[h, w]`` of each image (as :func:`resize_shorter` returns it), at
    least ``crop`` on both axes. torchvision's offset is ``int(round((n - crop) / 2))`` with
    Python's round, halves to even: a margin of 9 starts the window 4 pixels in, one of 7
    4 pixels in too. DALI's default centre (``crop_pos`` 0.5) rounds halves away from zero
    (5 for a margin of 9): one pixel off whenever the margin is 1 more than a multiple of 4.
    """
    margin = hw - crop
    # round(margin / 2) with halves to even: margin // 2, plus one when margin / 2 is x.5 with x odd (margin % 4 == 3).
    offset = margin // 2 + ((margin & 3) == 3)
    # DALI places the window at round(crop_pos * margin): offset / margin lands on offset (float32's error is
    # under 1e-3 pixel below margins of 16,000); a zero margin has offset 0, and 0 / 1 keeps it there.
    position = fn.cast(offset, dtype=types.FLOAT) / fn.cast(dali_math.max(margin, 1), dtype=types.FLOAT)
    return position[0], position[1]


def color_jitter(images: DataNode, jitter: ColorJitter, *, device: str, output_dtype: str = "uint8") -> DataNode:
    """Per-image random brightness, contrast, saturation and hue in one ``color_twist``.

    Adjustments with strength 0 get no random operator and keep DALI's neutral
    default, so a partial jitter costs only what it uses. ``output_dtype`` is the
    dtype the pipeline finally emits: on the CPU, when that is a float type, the
    twist keeps float pixels (clamped to 0..255, as the uint8 twist would be)
    instead of rounding to uint8 and converting back in the normaliser.
    """
    kwargs: dict[str, DataNode] = {}
    if jitter.brightness > 0:
        kwargs["brightness"] = fn.random.uniform(range=list(jitter.brightness_range))
    if jitter.contrast > 0:
        kwargs["contrast"] = fn.random.uniform(range=list(jitter.contrast_range))
    if jitter.saturation > 0:
        kwargs["saturation"] = fn.random.uniform(range=list(jitter.saturation_range))
    if jitter.hue > 0:
        kwargs["hue"] = fn.random.uniform(range=list(jitter.hue_degrees))
    if not kwargs:
        return images
    if device == "cpu" and output_dtype != "uint8":
        # DALI's CPU twist is cheaper writing float than uint8 (rounding and saturating
        # each value is the slow part); the explicit clamp keeps uint8's 0..255 range.
        # On the GPU uint8 is as fast and half the memory traffic, so it stays.
        twisted = fn.color_twist(images, device=device, dtype=types.FLOAT, **kwargs)
        # max then min, not math.clamp: the same values, but DALI's CPU clamp costs several
        # times the pair (the bench README's CPU section).
        return dali_math.min(dali_math.max(twisted, 0.0), 255.0)
    return fn.color_twist(images, device=device, **kwargs)


def mirror_flag(probability: float) -> DataNode | int:
    """The ``mirror`` argument for :func:`normalize`: a per-image coin, or a constant."""
    if probability <= 0.0:
        return 0
    if probability >= 1.0:
        return 1
    return fn.random.coin_flip(probability=probability)


def auto_augment(images: DataNode, policy: str, *, size: int | DataNode) -> DataNode:
    """RandAugment (n=2, m=9) or TrivialAugment Wide on uint8 HWC images of ``size`` x ``size``.

    Needs a pipeline defined with ``enable_conditionals=True``. The image shape is
    given so that translations are relative to the image, as in torchvision.
    """
    # Imported here: auto_aug pulls in DALI's conditionals machinery, which plain
    # pipelines never need.
    with _without_dali_alias_warnings():
        if policy == "rand_augment":
            from nvidia.dali.auto_aug import rand_augment

            return rand_augment.rand_augment(images, n=_RAND_AUGMENT_N, m=_RAND_AUGMENT_M, shape=_shape(size))
        if policy == "trivial_augment":
            from nvidia.dali.auto_aug import trivial_augment

            return trivial_augment.trivial_augment_wide(images, shape=_shape(size))
    raise ValueError(f"unknown auto_augment policy {policy!r}")


def _shape(size: int | DataNode) -> tuple[int, int] | DataNode:
    return size if isinstance(size, DataNode) else (size, size)


@contextlib.contextmanager
def _without_dali_alias_warnings() -> Iterator[None]:
    """Drop the deprecation notes DALI's own ``auto_aug`` triggers, and only those, while it builds.

    ``auto_aug`` calls DALI's deprecated ``fn.experimental`` aliases (``equalize``, ``filter``): a dozen lines in
    every user's script, about DALI's code, not theirs. DALI forces such warnings on (``simplefilter("default")``
    inside its own ``catch_warnings``), so no filter can hide them; what prints them can.
    """
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
        if issubclass(category, DeprecationWarning) and "moved out from the experimental phase" in str(message):
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def needs_normalize(*, dtype: str, layout: str, mirror: DataNode | int, crop: int | None) -> bool:
    """False when :func:`normalize` would copy the images unchanged (uint8, HWC, no flip, no crop)."""
    return not (dtype == "uint8" and layout == "NHWC" and isinstance(mirror, int) and mirror == 0 and crop is None)


def normalize(
    images: DataNode,
    *,
    device: str,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: str,
    layout: str,
    mirror: DataNode | int = 0,
    crop: int | None = None,
    crop_pos: tuple[DataNode, DataNode] | None = None,
) -> DataNode:
    """Centre crop, mirror, normalise, cast and lay out in one ``crop_mirror_normalize``.

    ``mean`` and ``std`` are in 0..1 (torchvision's convention) and scaled here to
    the decoder's 0..255. For ``uint8`` output the pixels stay in 0..255 and no
    normalisation is applied. ``crop_pos`` is the crop window's relative ``(y, x)``
    (see :func:`centre_crop_position`); without it DALI's centre, which rounds halves up.
    """
    kwargs = {}
    if dtype != "uint8":
        kwargs["mean"] = [255.0 * m for m in mean]
        kwargs["std"] = [255.0 * s for s in std]
    if crop is not None:
        kwargs["crop"] = [crop, crop]
    if crop_pos is not None:
        kwargs["crop_pos_y"], kwargs["crop_pos_x"] = crop_pos
    return fn.crop_mirror_normalize(
        images,
        device=device,
        dtype=_DALI_DTYPES[dtype],
        output_layout=_DALI_LAYOUTS[layout],
        mirror=mirror,
        **kwargs,
    )
