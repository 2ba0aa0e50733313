"""DALI graph fragments of the training recipe: RandomErasing, then MixUp/CutMix, on normalised images.

They apply what :mod:`dali_pipes.pipelines.batch_inputs` drew for the batch (the
per-batch inputs named in ``inputs``). Image operators run on the pipeline's
device; the per-sample numbers are CPU argument inputs (DALI takes arguments from
the CPU only), moved to the GPU where they are arithmetic operands. The labels
are mixed on the CPU: ``B x num_classes`` floats, far less than one image.
"""

from __future__ import annotations

from typing import Mapping

import nvidia.dali.fn as fn
import nvidia.dali.types as types
from nvidia.dali.data_node import DataNode

from dali_pipes.pipelines.erasing import RandomErasing
from dali_pipes.pipelines.mixing import Mix

__all__ = ["erase", "mix_images", "mix_labels"]


def _on(device: str, node: DataNode) -> DataNode:
    return node.gpu() if device == "gpu" else node


def _erase(images: DataNode, anchor: DataNode, shape: DataNode, *, device: str) -> DataNode:
    # Boxes of height or width 0 erase nothing: that is how an unused box slot is fed.
    return fn.erase(images, anchor=anchor, shape=shape, axis_names="HW", fill_value=0.0, device=device)


def erase(
    images: DataNode, inputs: Mapping[str, DataNode], erasing: RandomErasing, *, device: str, channels_first: bool
) -> DataNode:
    """timm's RandomErasing of the boxes ``erase_anchor``/``erase_shape``, filled as ``erasing.mode`` says.

    ``"const"`` erases every box in one operator; ``"rand"`` and ``"pixel"`` go box
    by box, so that a later box covers an earlier one where they overlap, as in
    timm. A ``"pixel"`` box's noise is drawn at the box's size and padded out to
    the image with zeros, then added where the box was erased: noise for every
    pixel of every image would be most of the recipe's time on the CPU, while boxes
    cover about a sixth of the erased images.
    """
    anchor, shape = inputs["erase_anchor"], inputs["erase_shape"]
    if erasing.mode == "const":
        return _erase(images, anchor, shape, device=device)
    for k in range(int(erasing.max_count)):  # type: ignore[arg-type] - set in RandomErasing.__post_init__
        box = dict(anchor=anchor[2 * k : 2 * k + 2], shape=shape[2 * k : 2 * k + 2], axis_names="HW", device=device)
        if erasing.mode == "rand":
            images = fn.erase(images, fill_value=inputs["erase_colour"][k], **box)  # one colour per channel
            continue
        noise = fn.random.normal(shape=inputs["erase_noise_shape"][k], device=device)
        canvas = fn.slice(
            noise,
            inputs["erase_noise_anchor"][k],
            inputs["erase_canvas"],
            axes=[1, 2] if channels_first else [0, 1],
            out_of_bounds_policy="pad",
            fill_values=0.0,
            normalized_anchor=False,
            normalized_shape=False,
            device=device,
        )
        images = fn.erase(images, fill_value=0.0, **box) + canvas
    return images


def mix_images(images: DataNode, inputs: Mapping[str, DataNode], mix: Mix, *, device: str) -> DataNode:
    """Each row mixed with its partner: ``own * lam + partner * (1 - lam)`` outside the CutMix box, partner inside.

    Written so that each case is timm's arithmetic: for MixUp rows the box is
    empty and ``partner - partner`` adds exact zeros; for CutMix rows ``lam`` is 1,
    so outside the box the row is itself and inside it exactly the partner.
    """
    partner = fn.permute_batch(images, indices=inputs["mix_partner"], device=device)
    lam = _on(device, inputs["mix_image_lam"])
    if mix.cutmix_alpha == 0:
        return images * lam + partner * (1.0 - lam)
    anchor, shape = inputs["mix_box_anchor"], inputs["mix_box_shape"]
    own = _erase(images, anchor, shape, device=device)
    partner_outside = _erase(partner, anchor, shape, device=device)
    return own * lam + partner * (1.0 - lam) + (partner - partner_outside)


def mix_labels(labels: DataNode, inputs: Mapping[str, DataNode], mix: Mix) -> DataNode:
    """timm's ``mixup_target`` on the CPU: smoothed one-hot targets mixed with the partner's, float32 ``[C]``."""
    if mix.num_classes is None:
        raise ValueError(
            "Mix.num_classes is None: a DALILoader takes it from the dataset's classes; "
            "outside a loader pass Mix(num_classes=...)"
        )
    on, off = mix.on_off_values
    targets = fn.one_hot(labels, num_classes=int(mix.num_classes), on_value=on, off_value=off)  # type: ignore[arg-type]
    partner = fn.permute_batch(targets, indices=inputs["mix_partner"])
    lam = inputs["mix_target_lam"]
    return targets * lam + partner * (1.0 - lam)


def cast_float16(images: DataNode, dtype: str, *, device: str) -> DataNode:
    """Back to float16 after the recipe's float32 arithmetic, when that is the output dtype."""
    return fn.cast(images, dtype=types.FLOAT16, device=device) if dtype == "float16" else images
