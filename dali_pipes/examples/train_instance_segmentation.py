"""Instance segmentation trained on :class:`~dali_pipes.InstanceSegmentation` batches: Mask R-CNN, or a tiny CPU model.

Convert a COCO dataset with its masks, then train::

    dali-pipes convert coco --images images/ --annotations instances.json shards/coco --masks
    python -m dali_pipes.examples.train_instance_segmentation shards/coco --epochs 1

``--model maskrcnn`` trains torchvision's ``maskrcnn_resnet50_fpn`` (from scratch,
no download) where torchvision is installed (it comes with CUDA builds of torch;
there is no build for the CPU-only torch this project tests with). The batches
become its targets in one line, :func:`maskrcnn_targets`::

    images, targets = maskrcnn_targets(batch)   # lists, one entry per real sample
    losses = model(images, targets)

``--model tiny`` (the default where torchvision is missing) runs anywhere, in plain
torch: the grid detector of :mod:`dali_pipes.examples.train_detection` plus a
Mask R-CNN style mask head, which samples 14 x 14 features inside each
ground-truth box (``grid_sample``, a RoIAlign in plain torch) and learns the box's
mask, sampled on the same grid, with a per-pixel binary cross entropy.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from dali_pipes.examples.train_detection import (
    IGNORE,
    TinyDetector,
    add_training_flags,
    check_sizes,
    grid_targets,
    open_data,
)
from dali_pipes.examples.usage import counted, description, fail, interrupts
from dali_pipes.pipelines import InstanceSegmentation

ROI = 14


def maskrcnn_targets(batch: dict) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """torchvision detection models' ``(images, targets)`` from a batch, padded samples and rows left out.

    Each image is cut to its valid ``image_size``; each target has ``boxes``
    (float ``xyxy`` pixels), ``labels`` (int64, 1..K: torchvision keeps 0 for the
    background) and ``masks`` (uint8 ``(n, h, w)``).
    """
    images, targets = [], []
    for i in torch.nonzero(~batch["is_pad"].bool().view(-1)).view(-1).tolist():
        n = int(batch["num_boxes"][i])
        h, w = (int(v) for v in batch["image_size"][i])
        images.append(batch["image"][i, :, :h, :w])
        targets.append(
            {
                "boxes": batch["boxes"][i, :n],
                "labels": batch["labels"][i, :n].long() + 1,
                "masks": batch["masks"][i, :n, :h, :w],
            }
        )
    return images, targets


class TinyMaskModel(TinyDetector):
    """:class:`TinyDetector` plus a mask head on features sampled inside each box."""

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__(num_classes, width)
        channels = 4 * width
        self.mask_head = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(channels, 1, 1)
        )


def box_grid(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``grid_sample`` grids ``(R, ROI, ROI, 2)`` of ROI x ROI points evenly inside each ``xyxy`` pixel box."""
    steps = (torch.arange(ROI, device=boxes.device, dtype=boxes.dtype) + 0.5) / ROI
    xs = boxes[:, 0:1] + steps * (boxes[:, 2:3] - boxes[:, 0:1])  # (R, ROI)
    ys = boxes[:, 1:2] + steps * (boxes[:, 3:4] - boxes[:, 1:2])
    gx = (2 * xs / width - 1).unsqueeze(1).expand(-1, ROI, ROI)
    gy = (2 * ys / height - 1).unsqueeze(2).expand(-1, ROI, ROI)
    return torch.stack([gx, gy], dim=-1)


def mask_loss(model: TinyMaskModel, features: torch.Tensor, batch: dict) -> torch.Tensor:
    """Binary cross entropy between each real box's predicted ROI mask and its mask sampled on the same grid."""
    n, m = batch["labels"].shape
    real = torch.arange(m, device=features.device).view(1, m) < batch["num_boxes"].long().view(n, 1)
    real &= ~batch["is_pad"].bool().view(n, 1)
    if not real.any():
        return features.sum() * 0.0
    sample, row = torch.nonzero(real, as_tuple=True)
    height, width = batch["image"].shape[-2:]
    grid = box_grid(batch["boxes"][sample, row].float(), height, width)
    rois = F.grid_sample(features[sample], grid, align_corners=False)
    masks = batch["masks"][sample, row].unsqueeze(1).float()
    target = F.grid_sample(masks, grid, mode="nearest", align_corners=False)
    return F.binary_cross_entropy_with_logits(model.mask_head(rois), target)


def tiny_loss(model: TinyMaskModel, batch: dict) -> torch.Tensor:
    """The detector's grid loss (classes and boxes) plus the mask loss."""
    features = model.backbone(batch["image"])
    out = model.head(features)
    logits, boxes = out[:, : model.num_classes + 1], out[:, model.num_classes + 1 :]
    classes, box_targets, assigned = grid_targets(batch, logits.shape[-2:], model.num_classes)
    loss = F.cross_entropy(logits, classes, ignore_index=IGNORE)
    if assigned.any():
        loss = loss + F.smooth_l1_loss(boxes.permute(0, 2, 3, 1)[assigned], box_targets[assigned])
    return loss + mask_loss(model, features, batch)


def model_kind(name: str) -> str:
    """``"maskrcnn"`` or ``"tiny"`` for ``--model``: ``auto`` takes Mask R-CNN where torchvision is.

    Decided before the data is opened, so that ``--model maskrcnn`` without
    torchvision is refused at once, in one line.
    """
    if name == "tiny":
        return "tiny"
    try:
        import torchvision.models.detection  # noqa: F401
    except ImportError:
        if name == "maskrcnn":
            fail("--model maskrcnn needs torchvision (it comes with CUDA builds of torch); use --model tiny")
        return "tiny"
    return "maskrcnn"


def build_model(kind: str, num_classes: int, args: argparse.Namespace) -> nn.Module:
    """The model of ``kind`` (:func:`model_kind`) for ``num_classes`` classes and the flags' image sizes."""
    if kind == "tiny":
        return TinyMaskModel(num_classes)
    from torchvision.models.detection import maskrcnn_resnet50_fpn

    # The loader has resized and normalised: torchvision's own transform is told to leave the images be.
    return maskrcnn_resnet50_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=num_classes + 1,
        min_size=args.size,
        max_size=args.max_size,
        image_mean=[0.0, 0.0, 0.0],
        image_std=[1.0, 1.0, 1.0],
    )


def parse_args(argv=None) -> argparse.Namespace:
    """The flags; a malformed one exits with argparse's usage error (status 2)."""
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("dataset", help="dataset folder written by 'dali-pipes convert coco --masks'")
    p.add_argument("--model", default="auto", choices=("auto", "maskrcnn", "tiny"))
    add_training_flags(p, batch_size=8)
    return check_sizes(p, p.parse_args(argv))


def main(argv=None) -> float:
    """Train; returns the last epoch's mean loss per real sample."""
    args = parse_args(argv)
    advice = (
        "this example trains on COCO images converted with their masks: "
        "'dali-pipes convert coco --images DIR --annotations JSON OUT --masks'"
    )
    kind = model_kind(args.model)
    spec = InstanceSegmentation(size=args.size, max_size=args.max_size)
    spec, loader = open_data(args, spec, ("image", "boxes", "masks"), advice)
    torch.manual_seed(args.seed)
    model = build_model(kind, spec.num_classes, args)
    optimizer, mean_loss = None, float("nan")
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        model.train()
        total, samples, start = 0.0, 0, time.perf_counter()
        for batch in loader:
            if optimizer is None:  # the model follows the loader's device
                model.to(batch["image"].device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
            real = int((~batch["is_pad"].bool()).sum())
            if kind == "maskrcnn":
                loss = sum(model(*maskrcnn_targets(batch)).values())
            else:
                loss = tiny_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * real
            samples += real
        mean_loss = total / max(samples, 1)
        elapsed = time.perf_counter() - start
        print(
            f"epoch {epoch}: {counted(samples, 'image')}, loss {mean_loss:.4f}, {samples / elapsed:.1f} images/s "
            f"on {loader.device} ({kind} model)",
            flush=True,
        )
    loader.close()
    return mean_loss


if __name__ == "__main__":
    with interrupts():  # Ctrl-C: one line and exit 130, not a traceback
        main()
