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

Data larger than a node's disk: ``--stream-cache 40GB`` reads DATASET (a URL such as
``s3://bucket/shards/train``, or a folder on a slow filesystem) through a cache of
40 GB on each node (``40GiB`` is 40 * 2**30 bytes; a bare ``40`` is 40 GB) instead of a full copy (``DataOptions(stream=StreamOptions(...))``):
each node reads only its share of the shards, a window of shards at a time, their samples
shuffled (each rank's start line says how many shards a window). Only ``index.json`` is read
before training: nothing is copied beyond the stream cache. ``--stream-folder DIR`` puts the cache on a local disk,
``--storage-option KEY=VALUE`` passes the backend's options (``endpoint_url=...``), and a long
epoch is kept with ``--checkpoint ck.pt --checkpoint-every 1000`` (``--resume`` goes on from the
saved step) while rank 0 says its step and images/s every ``--progress-every`` seconds.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dali_pipes import (
    DALILoader,
    DataOptions,
    Mixture,
    StreamOptions,
    WeightedSampling,
    class_balanced_weights,
    open_store,
)
from dali_pipes.cli.remote_args import add_storage_options, storage_options
from dali_pipes.dataset.sizes import GivenSize, format_size, size_flag
from dali_pipes.examples.long_runs import Checkpoints, Progress, add_long_run_flags
from dali_pipes.examples.usage import (
    UsageError,
    check_batch,
    class_difference,
    counted,
    dataset_manifest,
    description,
    fail,
    interrupts,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    raised_by,
    require_fields,
    say,
    short,
    user_errors,
)
from dali_pipes.loading.state import restored_position, restored_stream
from dali_pipes.pipelines import ClassificationTrain, Mix, RandomErasing, ResolutionSchedule
from dali_pipes.sampling.node_room import DEFAULT_LOADERS, NodeWindow, least_cache_limit, node_window

#: What to do with a dataset of another kind, said when one is given.
KIND_ADVICE = (
    "this example trains a classifier on class folders converted with 'dali-pipes convert imagefolder' "
    "(for COCO boxes, see dali_pipes.examples.train_detection)"
)


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
    """The flags; a malformed one, or two that do not go together, exit with argparse's usage error (status 2)."""
    p = argparse.ArgumentParser(
        description=description(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("dataset", help="dataset folder written by 'dali-pipes convert imagefolder'")
    p.add_argument("--epochs", type=positive_int, default=1)
    p.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    p.add_argument("--size", type=positive_int, default=224, help="training crop size")
    p.add_argument(
        "--res-schedule",
        type=_schedule,
        metavar="MIN,MAX,START,END",
        help="FFCV's resolution schedule instead of --size, e.g. 160,192,65,76",
    )
    p.add_argument("--mixup", type=non_negative_float, default=0.0, metavar="ALPHA", help="MixUp's alpha (0: off)")
    p.add_argument("--cutmix", type=non_negative_float, default=0.0, metavar="ALPHA", help="CutMix's alpha (0: off)")
    p.add_argument("--smoothing", type=probability, default=0.1, help="label smoothing of the mixed targets")
    p.add_argument("--erasing", type=probability, default=0.0, metavar="PROB", help="RandomErasing's probability")
    p.add_argument("--balance-classes", action="store_true", help="draw every class equally often (with replacement)")
    p.add_argument("--mix-with", metavar="DATASET", help="a second dataset, mixed into every epoch at --mix-share")
    p.add_argument("--mix-share", type=float, default=0.3, help="the second dataset's share of each epoch's samples")
    p.add_argument(
        "--mix-labels",
        choices=("keep", "offset"),
        help="keep: both datasets number the same classes; offset: the second one's classes come after the first's",
    )
    p.add_argument(
        "--stream-cache",
        type=size_flag("GB"),
        metavar="SIZE",
        help="stream DATASET (a URL) through a cache of this size a node instead of a full copy: 40GiB, 10GB, 500MB "
        "(a bare number is GB, 10**9 bytes; GiB is 2**30)",
    )
    p.add_argument(
        "--stream-folder",
        metavar="DIR",
        help="the node's stream cache folder, on a local disk; unset: stream/ under $DALI_PIPES_CACHE, else "
        "~/.cache/dali-pipes",
    )
    add_storage_options(p)
    p.add_argument("--lr", type=positive_float, default=0.1)
    p.add_argument("--seed", type=non_negative_int, default=0)
    add_long_run_flags(p)
    args = p.parse_args(argv)
    for problem in _flag_conflicts(args):
        p.error(problem)
    return args


def _flag_conflicts(args: argparse.Namespace) -> list[str]:
    """What is wrong with the flags taken together (each in words naming them), found before anything starts."""
    problems = []
    if args.balance_classes and args.mix_with:
        problems.append("--balance-classes and --mix-with do not go together: a mixture draws by its shares")
    if not 0 < args.mix_share < 1:
        problems.append(f"--mix-share must be between 0 and 1, got {args.mix_share}")
    if args.mix_labels and not args.mix_with:
        problems.append(f"--mix-labels {args.mix_labels} is for a mixture: give the second dataset with --mix-with")
    if args.resume and not args.checkpoint:
        problems.append("--resume continues from --checkpoint FILE: give it")
    if args.checkpoint_every and not args.checkpoint:
        problems.append("--checkpoint-every N saves to --checkpoint FILE: give it")
    try:
        storage_options(args)
    except ValueError as exc:
        problems.append(str(exc))
    if args.stream_folder and not args.stream_cache:
        problems.append("--stream-folder is the cache folder of --stream-cache SIZE: give it too")
    for flag, given in (("--balance-classes", args.balance_classes), ("--mix-with", args.mix_with)):
        if args.stream_cache and given:
            problems.append(
                f"--stream-cache reads DATASET shard window by window, which {flag} cannot follow: leave out one of them"
            )
    if args.checkpoint:
        # Found now rather than by torch.save after the first epoch's training.
        folder = os.path.dirname(os.path.abspath(args.checkpoint))
        if os.path.isdir(args.checkpoint):
            problems.append(f"--checkpoint {args.checkpoint} is a folder: give a file, e.g. {args.checkpoint}/ckpt.pt")
        elif not os.path.isdir(folder):
            problems.append(f"--checkpoint {args.checkpoint}: there is no folder {folder} to write it in")
    return problems


def check_data(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, a dataset this example cannot train on, or a mixture its labels cannot join.

    Also what the loader would refuse later with a plain ``ValueError`` (fields
    defined otherwise in the two datasets, ``--mixup`` over fewer than two
    classes), which this script does not take for a usage error (see ``usage``).
    """
    main = dataset_manifest(args.dataset, "DATASET", storage_options(args))
    require_fields(main, "DATASET", args.dataset, ("image", "label"), KIND_ADVICE)
    if args.stream_cache:
        check_stream_cache(args.stream_cache, main)
    if args.mix_with:
        extra = dataset_manifest(args.mix_with, "--mix-with", storage_options(args))
        require_fields(extra, "--mix-with", args.mix_with, ("image", "label"), KIND_ADVICE)
        check_mixture(args, main.classes, extra.classes)
        for name in main.fields.keys() & extra.fields.keys():  # a Mixture takes no field defined two ways
            if main.fields[name] != extra.fields[name]:
                raise UsageError(
                    f"field {name!r} is {main.fields[name].to_json()} in {args.dataset} but "
                    f"{extra.fields[name].to_json()} in --mix-with {args.mix_with}: mix datasets converted alike"
                )
    if args.mixup > 0 or args.cutmix > 0:
        classes = len(main.classes or ())
        if args.mix_with and args.mix_labels == "offset":
            classes += len(extra.classes or ())
        if classes < 2:
            raise UsageError(
                f"--mixup and --cutmix blend the targets of the dataset's classes, and {args.dataset} names "
                f"{counted(classes, 'class')}: leave them out"
            )


def check_stream_cache(cache: GivenSize, manifest: Any) -> NodeWindow:
    """The node window the loader streams with (:func:`~dali_pipes.sampling.node_room.node_window`, its rule, for
    ``StreamOptions``' default of two loaders of the dataset a node), or a refusal of a ``--stream-cache`` too small
    for it, in the flag's own unit with the least that works (the loader would say it in bytes and in the words of
    ``StreamOptions``). A node's ranks read one window together, so their count does not matter."""
    # A shard takes its bytes in the cache, and its index file's: DALI's TFRecord index, a line "OFFSET SIZE" a
    # record, which the manifest does not size, counted at its longest so that no limit passed here is refused later.
    sizes = [s.bytes + (s.num_samples * 2 * (len(str(s.bytes)) + 1) if s.index_path else 0) for s in manifest.shards]
    try:
        return node_window(cache.bytes, sizes, DEFAULT_LOADERS)
    except ValueError:  # the one refusal of node_window for a positive limit and no fetch_ahead
        given, largest = format_size(cache.bytes, cache.unit), format_size(max(sizes), cache.unit, up=True)
        least = format_size(least_cache_limit(sizes, DEFAULT_LOADERS), cache.unit, up=True)
        raise UsageError(
            f"--stream-cache {given} leaves {format_size(cache.bytes // DEFAULT_LOADERS, cache.unit)} to each of the "
            f"{DEFAULT_LOADERS} loaders of the dataset a node may run at once, less than three of its largest shard "
            f"({largest}: two windows of one shard and one read outside them); give --stream-cache {least} or more"
        ) from None


def check_mixture(args: argparse.Namespace, ours: Any, theirs: Any) -> None:
    """Refuse a mixture whose class lists ``--mix-labels`` cannot reconcile, naming the flag to use.

    :class:`Mixture` refuses the same mixtures, but in the words of its Python
    arguments (``labels='offset'``); a user of this script needs the flag.
    """
    if args.mix_labels == "offset":
        unlisted = [path for path, classes in ((args.dataset, ours), (args.mix_with, theirs)) if classes is None]
        if unlisted:
            raise UsageError(
                f"--mix-labels offset needs both datasets' class lists, and {' and '.join(unlisted)} records none; "
                "use --mix-labels keep if the label numbers mean the same classes"
            )
        return
    if ours is not None and theirs is not None and tuple(ours) != tuple(theirs):
        wrong = "--mix-labels keep would train on wrong labels; " if args.mix_labels == "keep" else ""
        raise UsageError(
            f"{args.dataset} and --mix-with {args.mix_with} have different class lists "
            f"({class_difference(ours, theirs, args.dataset, args.mix_with)}): {wrong}add --mix-labels offset to "
            "train on both, the second's classes numbered after the first's, or convert both with the same class list"
        )
    if args.mix_labels is None and (ours is None) != (theirs is None):
        raise UsageError(
            f"only one of {args.dataset} and --mix-with {args.mix_with} records a class list, so nothing says their "
            "label numbers mean the same classes: add --mix-labels keep if they do"
        )


def data_source(args: argparse.Namespace) -> tuple[Any, WeightedSampling | None, DataOptions]:
    """What the loader reads, how it draws each epoch (the dataset, a class-balanced draw of it, or a mixture)
    and where from (a full copy, or streamed through a bounded cache with ``--stream-cache``)."""
    options = storage_options(args)
    if args.stream_cache:
        stream = StreamOptions(cache_limit=args.stream_cache.bytes, folder=args.stream_folder)
        return args.dataset, None, DataOptions(stream=stream, storage_options=options)
    if args.mix_with:
        shares = {"main": 1 - args.mix_share, "extra": args.mix_share}
        mixture = Mixture({"main": args.dataset, "extra": args.mix_with}, proportions=shares, labels=args.mix_labels)
        return mixture, None, DataOptions(storage_options=options)
    if args.balance_classes:
        store = open_store(args.dataset, storage_options=options)
        try:
            weights = class_balanced_weights(store.column("label"))
            return args.dataset, WeightedSampling(weights), DataOptions(storage_options=options)
        finally:
            store.close()
    return args.dataset, None, DataOptions(storage_options=options)


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


def resume(args: argparse.Namespace, net: nn.Module, optimizer: Any, loader: DALILoader) -> int:
    """The first epoch to train: 0, or the one after the saved epoch when ``--resume`` finds ``--checkpoint``.

    A file that is not a checkpoint, or one of another model or dataset, is the
    user's to change: one line. Each step catches only what it raises for such a
    file, so an error of the loader's restore or of the device keeps its traceback.
    """
    if not (args.resume and os.path.exists(args.checkpoint)):
        return 0  # a first run of a resumable job: nothing saved yet

    def refuse(why: str, exc: BaseException | None = None) -> NoReturn:
        loader.close()
        fail(f"--checkpoint {args.checkpoint} is not a checkpoint this run can resume: {why}", cause=exc)

    try:
        # Onto the CPU: load_state_dict copies each tensor to its parameter's device, and an error here is the
        # file's (torch.load raises these for a file torch.save did not write, or a truncated one), not the GPU's.
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError) as exc:
        refuse(f"not a file torch.save wrote, or a damaged one ({short(exc)})", exc)
    parts = ("model", "optimizer", "loader")
    if not isinstance(state, dict) or not all(isinstance(state.get(part), dict) for part in parts):
        held = f"keys {', '.join(map(str, state))}" if isinstance(state, dict) else f"a {type(state).__name__}"
        refuse(f"it holds {held}, not this example's {', '.join(parts)} states")
    try:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as exc:  # what torch raises for the state of another model
        refuse(f"it was saved from another model (another class count?): {short(exc)}", exc)
    try:
        loader.load_state_dict(state["loader"])
    except ValueError as exc:
        if raised_by(exc, restored_position):
            refuse(f"it was saved reading another dataset: {short(exc)}", exc)
        if raised_by(exc, restored_stream):  # another partitioning, or a window this cache does not hold
            refuse(f"its streamed epoch cannot resume here: {short(exc, 400)}", exc)
        raise  # not a check of the saved state: a bug of the loader's restore
    return int(state["loader"]["epoch"])


def train_epoch(
    model: nn.Module, optimizer: Any, loader: DALILoader, device: Any, after_step: Any = None, first: int = 0
) -> torch.Tensor:
    """One pass over the loader; returns ``[real samples, summed loss]`` of this process.

    ``after_step(step, images)``: called after each step with the epoch's step number (counted from 1, a
    resumed pass going on from ``first``, the steps taken before) and this process's images of the batch."""
    model.train()
    seen = torch.zeros(2, device=device)
    for step, batch in enumerate(loader, start=first + 1):
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
        if after_step is not None:
            after_step(step, len(real))
    return seen


def start_line(rank: int, world: int, loader: DALILoader, args: argparse.Namespace, device: Any) -> str:
    """What each rank says at its start: its batches, its device, and with ``--stream-cache`` the node window it
    streams with (the shards its node reads at once, over the partitions it reads together) and fetched ahead."""
    line = f"rank {rank} of {world}: {counted(len(loader), 'batch')} of {args.batch_size} per epoch on {device}"
    streamer = getattr(loader.store, "streamer", None)
    if args.stream_cache and streamer is not None:
        shards = len(loader.store.manifest.shards)
        line += (
            f", streamed through --stream-cache {format_size(args.stream_cache.bytes, args.stream_cache.unit)}: "
            f"a node window of {counted(loader.sampling.node_window, 'shard')} of {shards}, {streamer.ahead} fetched "
            "ahead"
        )
    return line


def train(args: argparse.Namespace, model: nn.Module, net: nn.Module, loader: DALILoader, device: Any) -> None:
    """The epochs from the one ``--resume`` reaches, each ended by rank 0's line and a checkpoint."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    first_epoch = resume(args, net, optimizer, loader)
    checkpoints = Checkpoints(args, net, optimizer, loader, rank)
    progress = Progress(args.progress_every, world, rank)
    # One line per rank, at its start and its end: under torchrun each process shows it ran.
    say(start_line(rank, world, loader, args, device))
    with interrupts(checkpoints.where):  # Ctrl-C: one line saying where --resume continues from, exit 130
        _epochs(args, model, optimizer, loader, device, (first_epoch, rank, world), (checkpoints, progress))
    say(f"rank {rank} of {world}: done")


def _epochs(args, model, optimizer, loader, device, where: tuple[int, int, int], savers: tuple) -> None:
    """:func:`train`'s epochs, from ``where`` = ``(first epoch, rank, world)``."""
    first_epoch, rank, world = where
    checkpoints, progress = savers
    distributed = world > 1

    def after_step(step: int, images: int) -> None:
        progress.after_step(step, images)
        checkpoints.after_step(step)

    for epoch in range(first_epoch, args.epochs):
        loader.set_epoch(epoch)  # was: sampler.set_epoch(epoch)
        done = progress.begin(epoch, loader)
        seen = train_epoch(model, optimizer, loader, device, after_step, done)
        if distributed:
            dist.all_reduce(seen)
        elapsed = time.perf_counter() - progress.start
        if rank == 0:
            samples, total_loss = int(seen[0].item()), seen[1].item()
            say(
                f"epoch {epoch}: {counted(samples, 'sample')}, loss {total_loss / max(samples, 1):.4f}, "
                f"at {loader.pipeline.size_at(epoch)} px, {samples / elapsed:.1f} images/s on "
                f"{counted(world, 'process')}"
            )
        checkpoints.save(f"the end of epoch {epoch}")


def main(argv=None) -> None:
    args = parse_args(argv)
    with interrupts():  # Ctrl-C anywhere: one line and exit 130 (train() says where --resume continues from)
        _main(args)


def _main(args: argparse.Namespace) -> None:
    with user_errors():
        check_data(args)  # before the process group: every rank refuses alike, at once
    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    # --- was: dataset = ImageFolder(root, transform); sampler = DistributedSampler(dataset)
    #          loader = DataLoader(dataset, batch_size, sampler=sampler, num_workers=8, pin_memory=True)
    spec = train_spec(args)  # from flags already checked: a refusal would be this script's bug
    with user_errors():  # a dataset the library cannot read is refused in one line; a bug building the loader is not
        dataset, sampling, data = data_source(args)
        loader = DALILoader(dataset, spec, batch_size=args.batch_size, seed=args.seed, sampling=sampling, data=data)
        check_batch(loader)
    num_classes = len(loader.store.manifest.classes or ()) or 1000

    torch.manual_seed(args.seed)
    net = small_convnet(num_classes).to(device)
    model = net
    if distributed:
        model = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank] if device.type == "cuda" else None)
    try:
        train(args, model, net, loader, device)
    finally:  # an interrupted run too: its downloads stop, its pins go
        loader.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
