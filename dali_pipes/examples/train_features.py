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
from dali_pipes.pipelines import Features


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", help="a merged .h5 file from 'dali-pipes merge', or a dataset folder")
    p.add_argument("--input", default="emb", help="the array field fed to the model (default: emb)")
    p.add_argument("--target", default="label", help="the field to predict (default: label)")
    p.add_argument("--num-classes", type=int, help="classes of an integer target (default: its largest value + 1)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"))
    p.add_argument("--workers", type=int, default=None, help="DALI Python workers reading the shards")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def count_classes(dataset: str, target: str) -> int:
    """Largest value of an integer target field + 1 (one pass over that field; pass --num-classes to skip it)."""
    store = open_store(dataset)
    try:
        return int(max(int(np.max(store.read(i, (target,))[target])) for i in range(len(store)))) + 1
    finally:
        store.close()


def main(argv=None) -> float:
    """Train; returns the last epoch's mean loss per real sample."""
    args = parse_args(argv)
    # Cast the input to float32 inside the pipeline (on the GPU when there is one): the store keeps
    # the features in whatever dtype they were saved in, float16 halving the bytes read.
    spec = Features(fields=(args.input, args.target), dtype={args.input: "float32"})
    loader = DALILoader(
        args.dataset, spec, batch_size=args.batch_size, seed=args.seed, device=args.device, py_num_workers=args.workers
    )
    fields = loader.store.manifest.fields
    in_features = math.prod(fields[args.input].shape or (1,))
    classify = np.dtype(fields[args.target].dtype).kind in "iub"
    outputs = (
        (args.num_classes or count_classes(args.dataset, args.target))
        if classify
        else math.prod(fields[args.target].shape or (1,))
    )

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(in_features, args.hidden), nn.ReLU(), nn.Linear(args.hidden, outputs))
    optimizer = None
    mean_loss = float("nan")
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        total, samples, start = 0.0, 0, time.perf_counter()
        for batch in loader:
            x, y = batch[args.input], batch[args.target]
            if optimizer is None:  # the model follows the loader's device
                model.to(x.device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
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
            f"epoch {epoch}: {samples} samples, loss {mean_loss:.4f}, "
            f"{samples / (time.perf_counter() - start):.1f} samples/s on {loader.device}",
            flush=True,
        )
    loader.close()
    return mean_loss


if __name__ == "__main__":
    main()
