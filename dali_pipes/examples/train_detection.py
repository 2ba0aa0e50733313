"""A small COCO-style detector trained on batches from :class:`~dali_pipes.DALILoader` and :class:`Detection`.

Convert a COCO dataset, then train::

    dali-pipes convert coco images/ instances.json shards/coco --format lmdb
    python -m dali_pipes.examples.train_detection shards/coco --epochs 1

The same command runs on a GPU and on a CPU-only machine: the loader picks the
device (``--device auto``) and the model follows the tensors it hands out.

The detector is deliberately tiny and honest rather than good: a strided conv
net predicts, for every cell of a grid (stride 16), class scores (the K classes
plus background) and a box. A ground-truth box is assigned to the cell holding
its centre (YOLO v1 style; one of the boxes wins a shared cell); the loss is cross
entropy over all cells of the valid image area plus a smooth-L1 loss on the
assigned cells' boxes (centre offset in the cell, log width and height in
cells). It shows how the padded targets are used: ``num_boxes`` masks the
filler rows, ``image_size`` masks the padded pixels, ``is_pad`` masks the
wrap-around samples of the last batch.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dali_pipes import DALILoader
from dali_pipes.examples.usage import (
    check_device,
    counted,
    dataset_manifest,
    description,
    interrupts,
    non_negative_int,
    positive_float,
    positive_int,
    require_fields,
    script_loader,
    user_errors,
)
from dali_pipes.pipelines import Detection

STRIDE = 16
IGNORE = -100  # cross_entropy's ignore_index: padded pixels and padded samples


class TinyDetector(nn.Module):
    """Four stride-2 conv blocks and a 1x1 head: ``(class logits (N, K+1, h, w), boxes (N, 4, h, w))``."""

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__()
        layers, channels = [], 3
        for out in (width, 2 * width, 4 * width, 4 * width):
            layers += [nn.Conv2d(channels, out, 3, stride=2, padding=1), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            channels = out
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Conv2d(channels, num_classes + 1 + 4, 1)
        self.num_classes = num_classes

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.backbone(images))
        return out[:, : self.num_classes + 1], out[:, self.num_classes + 1 :]


def grid_targets(
    batch: dict, grid: tuple[int, int], num_classes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per cell: the class to predict (background ``num_classes``, or IGNORE), the box target and its mask."""
    boxes, labels, counts = batch["boxes"], batch["labels"].long(), batch["num_boxes"].long().view(-1)
    n, m = labels.shape
    gh, gw = grid
    device = boxes.device
    classes = torch.full((n, gh, gw), num_classes, dtype=torch.long, device=device)
    # Cells outside the image's valid area (padding) and whole padded samples teach nothing.
    valid_h = (batch["image_size"][:, 0].long() + STRIDE - 1) // STRIDE
    valid_w = (batch["image_size"][:, 1].long() + STRIDE - 1) // STRIDE
    rows = torch.arange(gh, device=device).view(1, gh, 1)
    cols = torch.arange(gw, device=device).view(1, 1, gw)
    outside = (rows >= valid_h.view(-1, 1, 1)) | (cols >= valid_w.view(-1, 1, 1))
    classes[outside | batch["is_pad"].bool().view(-1, 1, 1)] = IGNORE

    real = (torch.arange(m, device=device).view(1, m) < counts.view(n, 1)) & ~batch["is_pad"].bool().view(n, 1)
    centre = (boxes[..., :2] + boxes[..., 2:]) / (2 * STRIDE)
    size = (boxes[..., 2:] - boxes[..., :2]).clamp(min=1e-3) / STRIDE
    cx = centre[..., 0].long().clamp(0, gw - 1)
    cy = centre[..., 1].long().clamp(0, gh - 1)
    sample = torch.arange(n, device=device).view(n, 1).expand(n, m)
    target = torch.cat([centre - torch.stack([cx, cy], dim=-1), size.log()], dim=-1)  # (n, m, 4)
    box_targets = torch.zeros((n, gh, gw, 4), device=device)
    assigned = torch.zeros((n, gh, gw), dtype=torch.bool, device=device)
    idx = (sample[real], cy[real], cx[real])
    classes[idx] = labels[real]
    box_targets[idx] = target[real]
    assigned[idx] = True
    return classes, box_targets, assigned


def detection_loss(model: TinyDetector, batch: dict) -> tuple[torch.Tensor, int]:
    """Classification over every valid cell plus box regression on the assigned ones; and the real sample count."""
    logits, boxes = model(batch["image"])
    classes, box_targets, assigned = grid_targets(batch, logits.shape[-2:], model.num_classes)
    cls_loss = F.cross_entropy(logits, classes, ignore_index=IGNORE)
    if assigned.any():
        box_loss = F.smooth_l1_loss(boxes.permute(0, 2, 3, 1)[assigned], box_targets[assigned])
    else:  # a batch whose images all lost their boxes still trains the background class
        box_loss = boxes.sum() * 0.0
    real = int((~batch["is_pad"].bool()).sum())
    return cls_loss + box_loss, real


def parse_args(argv=None) -> argparse.Namespace:
    """The flags; a malformed one exits with argparse's usage error (status 2)."""
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("dataset", help="dataset folder written by 'dali-pipes convert coco'")
    add_training_flags(p, batch_size=16)
    return check_sizes(p, p.parse_args(argv))


def add_training_flags(p: argparse.ArgumentParser, *, batch_size: int) -> None:
    """The flags this example shares with the instance segmentation one (:func:`check_sizes` checks two together)."""
    p.add_argument("--epochs", type=positive_int, default=1)
    p.add_argument("--batch-size", type=positive_int, default=batch_size)
    p.add_argument("--size", type=positive_int, default=320, help="shorter side of the training images")
    p.add_argument("--max-size", type=positive_int, default=512, help="cap on the longer side")
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"))
    p.add_argument("--workers", type=non_negative_int, default=None, help="DALI Python workers reading the shards")
    p.add_argument("--seed", type=non_negative_int, default=0)


def check_sizes(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args``, once ``--max-size`` is known not to be below ``--size`` (else argparse's usage error)."""
    if args.max_size < args.size:
        p.error(f"--max-size {args.max_size} is below --size {args.size}: the longer side cannot be the shorter")
    return args


def open_data(args: argparse.Namespace, spec: Any, fields: tuple[str, ...], advice: str) -> tuple[Any, DALILoader]:
    """The spec bound to the dataset and its loader; a dataset of another kind is refused in one line naming it."""
    with user_errors():
        check_device(args.device)
        manifest = dataset_manifest(args.dataset, "DATASET")
        require_fields(manifest, "DATASET", args.dataset, fields, advice)
        # bind() reads the category ids from the manifest: label k is the k-th smallest COCO id.
        spec = spec.bind(manifest)
        loader = script_loader(args, spec)
    return spec, loader


def main(argv=None) -> float:
    """Train; returns the last epoch's mean loss per real sample."""
    args = parse_args(argv)
    advice = (
        "this example trains on COCO images and boxes converted with 'dali-pipes convert coco' "
        "(for class folders, see dali_pipes.examples.train_imagenet)"
    )
    spec, loader = open_data(args, Detection(size=args.size, max_size=args.max_size), ("image", "boxes"), advice)
    torch.manual_seed(args.seed)
    model = TinyDetector(spec.num_classes)
    optimizer = None
    mean_loss = float("nan")
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        model.train()
        total, samples, start = 0.0, 0, time.perf_counter()
        for batch in loader:
            if optimizer is None:  # the model follows the loader's device
                model.to(batch["image"].device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
            loss, real = detection_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * real
            samples += real
        mean_loss = total / max(samples, 1)
        elapsed = time.perf_counter() - start
        print(
            f"epoch {epoch}: {counted(samples, 'image')}, loss {mean_loss:.4f}, {samples / elapsed:.1f} images/s "
            f"on {loader.device}",
            flush=True,
        )
    loader.close()
    return mean_loss


if __name__ == "__main__":
    with interrupts():  # Ctrl-C: one line and exit 130, not a traceback
        main()
