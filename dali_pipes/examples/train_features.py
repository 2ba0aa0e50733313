"""Train on feature arrays preprocessed offline into HDF5 shards, read through a virtual HDF5 dataset.

The recipe: features computed once (embeddings, spectrograms, ...) and saved as
``.npy``/``.npz``/HDF5 arrays, one sample per row; converted into HDF5 shards;
merged into one virtual ``.h5`` file that maps the shards end to end (nothing
copied), which any h5py user can also open; then trained on through
:class:`~dali_pipes.DALILoader` with the :class:`~dali_pipes.Features` spec::

    dali-pipes convert arrays emb.npy label.npy shards/feats --format hdf5
    dali-pipes merge shards/feats shards/feats.h5 --virtual
    python -m dali_pipes.examples.train_features shards/feats.h5 --input emb --target label --epochs 2

``DATASET`` may be the merged ``.h5`` file or the dataset folder itself. The
model is a small MLP: an integer scalar target is a class label (cross
entropy), a float target is regressed (mean squared error). The ``is_pad``
mask keeps the wrap-around filler of the last batch out of the loss.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dali_pipes import DALILoader, open_store
from dali_pipes.examples.usage import (
    UsageError,
    check_device,
    counted,
    dataset_manifest,
    description,
    fail,
    interrupts,
    non_negative_int,
    positive_float,
    positive_int,
    script_loader,
    user_errors,
)
from dali_pipes.pipelines import Features


def parse_args(argv=None) -> argparse.Namespace:
    """The flags; a malformed one exits with argparse's usage error (status 2)."""
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("dataset", help="a merged .h5 file from 'dali-pipes merge', or a dataset folder")
    p.add_argument("--input", default="emb", help="the array field fed to the model (default: emb)")
    p.add_argument("--target", default="label", help="the field to predict (default: label)")
    p.add_argument(
        "--num-classes", type=positive_int, help="classes of an integer target (default: its largest value + 1)"
    )
    p.add_argument("--epochs", type=positive_int, default=1)
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--hidden", type=positive_int, default=128)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"))
    p.add_argument("--workers", type=non_negative_int, default=None, help="DALI Python workers reading the shards")
    p.add_argument("--seed", type=non_negative_int, default=0)
    args = p.parse_args(argv)
    if args.input == args.target:
        p.error(f"--input and --target are both {args.input!r}: the model would be shown what it must predict")
    return args


def check_fields(args: argparse.Namespace) -> None:
    """Refuse an ``--input`` or ``--target`` that is not a fixed-shape numeric array of the dataset, naming the flag."""
    fields = dataset_manifest(args.dataset, "DATASET").fields
    for flag, name in (("--input", args.input), ("--target", args.target)):
        field = fields.get(name)
        if field is None:
            raise UsageError(f"{flag} {name}: the dataset has no such field (it holds {', '.join(fields)})")
        numeric = field.kind == "array" and np.dtype(field.dtype).kind in "biuf"
        if not numeric or -1 in (field.shape or ()):
            raise UsageError(
                f"{flag} {name} is not a fixed-shape numeric array (it is {field.to_json()}); this example trains on "
                "feature arrays converted with 'dali-pipes convert arrays'"
            )


def count_classes(dataset: str, target: str) -> int:
    """Largest value of an integer target field + 1 (one pass over that field; pass --num-classes to skip it)."""
    store = open_store(dataset)
    try:
        return int(max(int(np.max(store.read(i, (target,))[target])) for i in range(len(store)))) + 1
    finally:
        store.close()


def label_problem(labels: torch.Tensor, classes: int, args: argparse.Namespace) -> str | None:
    """What is wrong with class labels outside ``0..classes-1`` (a too-small --num-classes), which cross entropy
    cannot take (on a GPU it would stop the process with a device-side assert); None when they fit."""
    low, high = int(labels.min()), int(labels.max())
    if low >= 0 and high < classes:
        return None
    hint = f"; give --num-classes {high + 1} or more" if args.num_classes and low >= 0 else ""
    return f"--target {args.target} holds class {low if low < 0 else high}, outside 0..{classes - 1}{hint}"


def open_data(args: argparse.Namespace) -> tuple[DALILoader, int, int, bool]:
    """The loader, the input width, the output count and whether the target is a class (else regressed)."""
    with user_errors():
        check_device(args.device)
        check_fields(args)
        # Cast the input to float32 inside the pipeline (on the GPU when there is one): the store keeps
        # the features in whatever dtype they were saved in, float16 halving the bytes read.
        spec = Features(fields=(args.input, args.target), dtype={args.input: "float32"})
        loader = script_loader(args, spec)
    fields = loader.store.manifest.fields
    in_features = math.prod(fields[args.input].shape or (1,))
    classify = np.dtype(fields[args.target].dtype).kind in "iub"
    if classify:
        outputs = args.num_classes or count_classes(args.dataset, args.target)
    else:
        outputs = math.prod(fields[args.target].shape or (1,))
    return loader, in_features, outputs, classify


def main(argv=None) -> float:
    """Train; returns the last epoch's mean loss per real sample."""
    args = parse_args(argv)
    loader, in_features, outputs, classify = open_data(args)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(in_features, args.hidden), nn.ReLU(), nn.Linear(args.hidden, outputs))
    optimizer = None
    mean_loss = float("nan")
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        total, samples, start = 0.0, 0, time.perf_counter()
        for batch in loader:
            # (batch, features) also for a scalar input field, which nn.Flatten would leave one-dimensional.
            x, y = batch[args.input].reshape(len(batch[args.input]), -1), batch[args.target]
            if optimizer is None:  # the model follows the loader's device
                model.to(x.device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
            # The first epoch sees every sample: later ones need not check again.
            problem = label_problem(y, outputs, args) if classify and epoch == 0 else None
            if problem:
                loader.close()
                fail(problem)
            real = ~batch["is_pad"].view(-1).bool()
            out = model(x)
            if classify:
                losses = F.cross_entropy(out, y.view(-1).long(), reduction="none")
            else:
                losses = F.mse_loss(out, y.float().view(len(y), -1), reduction="none").mean(dim=1)
            loss = (losses * real).sum() / real.sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float((losses.detach() * real).sum())
            samples += int(real.sum())
        mean_loss = total / max(samples, 1)
        print(
            f"epoch {epoch}: {counted(samples, 'sample')}, loss {mean_loss:.4f}, "
            f"{samples / (time.perf_counter() - start):.1f} samples/s on {loader.device}",
            flush=True,
        )
    loader.close()
    return mean_loss


if __name__ == "__main__":
    with interrupts():  # Ctrl-C: one line and exit 130, not a traceback
        main()
