"""ImageNet-style DDP training that reads its batches through :class:`~dali_pipes.DALILoader`.

Single node, as many processes as GPUs (or CPU processes with gloo)::

    torchrun --nproc_per_node=2 -m dali_pipes.examples.train_imagenet shards/train --epochs 2

Multi-node: the same command on every node, each with its ``--node_rank``, the
shards on a filesystem all nodes see::

    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST0 --master_port=29500 \\
        -m dali_pipes.examples.train_imagenet /shared/shards/train

The same code runs on CPU (gloo) and GPU (nccl): the backend follows
``torch.cuda.is_available()``, and the loader picks this rank's GPU by itself.
Against a ``DataLoader`` script, the change is the loader construction and the
three keys of the batch (see the README).

The modern recipe is flags: ``--res-schedule 160,192,65,76`` (FFCV's progressive
resizing: the size changes with ``set_epoch``, the loader is not rebuilt),
``--mixup 0.8 --cutmix 1.0`` (done in the DALI graph; the labels are then soft
targets, which ``F.cross_entropy`` takes as they are), ``--erasing 0.25``.

Imbalanced data and several datasets: ``--balance-classes`` draws each epoch
with weights ``1 / (samples of the class)``, so every class comes equally often
(``WeightedSampling``); ``--mix-with shards/extra --mix-share 0.3`` reads a second
dataset as 30% of every epoch's samples (``Mixture``), with ``--mix-labels offset``
when its classes are not the first dataset's.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dali_pipes import DALILoader, Mixture, WeightedSampling, class_balanced_weights, open_store
from dali_pipes.pipelines import ClassificationTrain, Mix, RandomErasing, ResolutionSchedule


def small_convnet(num_classes: int) -> nn.Module:
    """A small CNN so the example runs in seconds on a CPU; swap in any torchvision model."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("dataset", help="dataset folder written by 'dali-pipes convert imagefolder'")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--size", type=int, default=224, help="training crop size")
    p.add_argument(
        "--res-schedule",
        type=_schedule,
        metavar="MIN,MAX,START,END",
        help="FFCV's resolution schedule instead of --size, e.g. 160,192,65,76",
    )
    p.add_argument("--mixup", type=float, default=0.0, metavar="ALPHA", help="MixUp's alpha (0: off)")
    p.add_argument("--cutmix", type=float, default=0.0, metavar="ALPHA", help="CutMix's alpha (0: off)")
    p.add_argument("--smoothing", type=float, default=0.1, help="label smoothing of the mixed targets")
    p.add_argument("--erasing", type=float, default=0.0, metavar="PROB", help="RandomErasing's probability")
    p.add_argument("--balance-classes", action="store_true", help="draw every class equally often (with replacement)")
    p.add_argument("--mix-with", metavar="DATASET", help="a second dataset, mixed into every epoch at --mix-share")
    p.add_argument("--mix-share", type=float, default=0.3, help="the second dataset's share of each epoch's samples")
    p.add_argument(
        "--mix-labels",
        choices=("keep", "offset"),
        help="keep: both datasets number the same classes; offset: the second one's classes come after the first's",
    )
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", help="save model, optimiser and loader state here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    args = p.parse_args(argv)
    if args.balance_classes and args.mix_with:
        p.error("--balance-classes and --mix-with do not go together: a mixture draws by its shares")
    if not 0 < args.mix_share < 1:
        p.error(f"--mix-share must be between 0 and 1, got {args.mix_share}")
    return args


def data_source(args: argparse.Namespace) -> tuple[Any, WeightedSampling | None]:
    """What the loader reads and how it draws each epoch: the dataset, a class-balanced draw of it, or a mixture."""
    if args.mix_with:
        shares = {"main": 1 - args.mix_share, "extra": args.mix_share}
        return Mixture({"main": args.dataset, "extra": args.mix_with}, proportions=shares, labels=args.mix_labels), None
    if args.balance_classes:
        store = open_store(args.dataset)
        try:
            return args.dataset, WeightedSampling(class_balanced_weights(store.column("label")))
        finally:
            store.close()
    return args.dataset, None


def _schedule(text: str) -> ResolutionSchedule:
    try:
        return ResolutionSchedule(*(int(v) for v in text.split(",")))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX,START,END integers, e.g. 160,192,65,76: {exc}") from None


def train_spec(args: argparse.Namespace) -> ClassificationTrain:
    """The training spec the flags ask for."""
    mix = None
    if args.mixup > 0 or args.cutmix > 0:
        mix = Mix(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing)
    erasing = RandomErasing(prob=args.erasing, mode="pixel") if args.erasing > 0 else None
    return ClassificationTrain(size=args.res_schedule or args.size, mix=mix, erasing=erasing)


def main(argv=None) -> None:
    args = parse_args(argv)
    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    # --- was: dataset = ImageFolder(root, transform); sampler = DistributedSampler(dataset)
    #          loader = DataLoader(dataset, batch_size, sampler=sampler, num_workers=8, pin_memory=True)
    dataset, sampling = data_source(args)
    loader = DALILoader(dataset, train_spec(args), batch_size=args.batch_size, seed=args.seed, sampling=sampling)
    num_classes = len(loader.store.manifest.classes or ()) or 1000

    torch.manual_seed(args.seed)
    net = small_convnet(num_classes).to(device)
    model = net
    if distributed:
        model = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    first_epoch = 0
    if args.resume and args.checkpoint and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        first_epoch = state["loader"]["epoch"]

    world = dist.get_world_size() if distributed else 1
    # One line per rank, at its start and its end: under torchrun each process shows it ran.
    print(f"rank {rank} of {world}: {len(loader)} batches of {args.batch_size} per epoch on {device}", flush=True)
    for epoch in range(first_epoch, args.epochs):
        loader.set_epoch(epoch)  # was: sampler.set_epoch(epoch)
        model.train()
        seen = torch.zeros(2, device=device)  # real samples, summed loss
        start = time.perf_counter()
        for batch in loader:
            images, labels = batch["image"], batch["label"]  # was: for images, labels in loader
            # Soft targets (float, [B, classes]) with --mixup/--cutmix, class indices otherwise.
            labels = labels if labels.is_floating_point() else labels.view(-1).long()
            real = ~batch["is_pad"].view(-1).bool()  # the wrap-around filler of the last batch counts for nothing
            losses = F.cross_entropy(model(images), labels, reduction="none")
            loss = (losses * real).sum() / real.sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += torch.stack([real.sum().float(), (losses * real).sum().detach()])
        if distributed:
            dist.all_reduce(seen)
        elapsed = time.perf_counter() - start
        if rank == 0:
            samples, total_loss = int(seen[0].item()), seen[1].item()
            print(
                f"epoch {epoch}: {samples} samples, loss {total_loss / max(samples, 1):.4f}, "
                f"at {loader.pipeline.size_at(epoch)} px, {samples / elapsed:.1f} images/s on {world} process(es)",
                flush=True,
            )
            if args.checkpoint:
                torch.save(
                    {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict()},
                    args.checkpoint,
                )
    loader.close()
    print(f"rank {rank} of {world}: done", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
