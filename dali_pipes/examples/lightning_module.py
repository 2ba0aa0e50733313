"""PyTorch Lightning on :class:`~dali_pipes.DALILoader`: a ``LightningDataModule`` and a tiny classifier.

Needs Lightning (``pip install "dali-pipes[lightning]"``). Convert an image
folder, then train::

    dali-pipes convert imagefolder train/ shards/train --format lmdb
    python -m dali_pipes.examples.lightning_module shards/train --max-epochs 1

Multi-GPU: ``--devices 8`` (Lightning's DDP strategy starts the processes).
:class:`DALIDataModule` builds one loader per process in ``setup()``, with the
rank and world size from Lightning's strategy, so each process reads its own
share of every epoch; no ``DistributedSampler`` is involved. Lightning calls
``set_epoch`` on a loader's ``sampler`` at the start of every epoch, as it does
for a ``DistributedSampler``; :class:`EpochLoader` gives it one that forwards
to :meth:`DALILoader.set_epoch`, so each epoch has its own order.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from dali_pipes import DALILoader, RunOptions
from dali_pipes.examples.train_imagenet import KIND_ADVICE, small_convnet
from dali_pipes.examples.usage import (
    UsageError,
    check_device,
    class_difference,
    counted,
    dataset_manifest,
    description,
    fail,
    non_negative_int,
    positive_int,
    require_fields,
    short,
    user_errors,
)
from dali_pipes.pipelines import ClassificationTrain, ClassificationVal

try:
    import lightning as L
    from lightning.fabric.utilities.exceptions import MisconfigurationException
except ImportError:
    if __name__ == "__main__":  # run as a script: say how to get it, in one line; imported: the ImportError
        fail('this example needs Lightning, an optional extra: pip install "dali-pipes[lightning]"')
    raise


class EpochLoader:
    """A :class:`DALILoader` as Lightning expects a loader: sized, iterable, ``sampler.set_epoch(epoch)``."""

    def __init__(self, loader: DALILoader) -> None:
        self.loader = loader
        self.sampler = self  # where Lightning looks for set_epoch
        self.batch_sampler = None  # Lightning reads it next to `sampler`; the loader batches by itself

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass cover ``epoch``.

        Lightning calls this after it has already started the first epoch's
        pass; the loader's own epoch is then ``epoch`` already and is left alone,
        so the pass under way (and a resume offset) is not disturbed.
        """
        if self.loader.epoch != epoch:
            self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class DALIDataModule(L.LightningDataModule):
    """Train and validation :class:`DALILoader` s over converted datasets, one per Lightning process.

    ``val_dataset`` defaults to the training dataset (read with the validation
    pipeline, unshuffled); ``device`` and ``workers`` go to the loaders' ``RunOptions``
    (``device="auto"``: this process's GPU when there is one).
    """

    def __init__(
        self,
        train_dataset: str,
        val_dataset: str | None = None,
        *,
        batch_size: int = 64,
        size: int = 224,
        seed: int = 0,
        device: str = "auto",
        workers: int | None = None,
    ) -> None:
        super().__init__()
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset or train_dataset
        self.batch_size, self.size, self.seed = batch_size, size, seed
        self.device, self.workers = device, workers
        self.train: EpochLoader | None = None
        self.val: EpochLoader | None = None

    def _loader(self, path: str, spec: Any, *, shuffle: bool) -> EpochLoader:
        # Without a trainer (a loader built by hand) the loader reads torch.distributed / the environment itself.
        rank = self.trainer.global_rank if self.trainer is not None else None
        world = self.trainer.world_size if self.trainer is not None else None
        return EpochLoader(
            DALILoader(
                path,
                spec,
                batch_size=self.batch_size,
                shuffle=shuffle,
                seed=self.seed,
                run=RunOptions(device=self.device, rank=rank, world_size=world, py_num_workers=self.workers),
            )
        )

    def setup(self, stage: str) -> None:
        """Build this process's loaders (Lightning calls this on every process, after DDP has started)."""
        if stage == "fit" and self.train is None:
            self.train = self._loader(self.train_dataset, ClassificationTrain(size=self.size), shuffle=True)
        if stage in ("fit", "validate") and self.val is None:
            val_size = round(self.size * 256 / 224)  # the usual ImageNet evaluation ratio
            self.val = self._loader(self.val_dataset, ClassificationVal(size=self.size, resize=val_size), shuffle=False)

    def train_dataloader(self) -> EpochLoader:
        """The training loader built in :meth:`setup`."""
        if self.train is None:
            raise ValueError("DALIDataModule.train_dataloader() before setup('fit')")
        return self.train

    def val_dataloader(self) -> EpochLoader:
        """The validation loader built in :meth:`setup`."""
        if self.val is None:
            raise ValueError("DALIDataModule.val_dataloader() before setup('fit') or setup('validate')")
        return self.val

    def teardown(self, stage: str) -> None:
        """Stop DALI's workers."""
        for loader in (self.train, self.val):
            if loader is not None:
                loader.loader.close()
        self.train = self.val = None


class TinyClassifier(L.LightningModule):
    """A small CNN; the loss and accuracy leave out the wrap-around filler of the last batch (``is_pad``)."""

    def __init__(self, num_classes: int, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = small_convnet(num_classes)
        self.train_steps = 0  # counted so the example (and its test) can show one step per batch

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.net(batch["image"])
        labels = batch["label"].view(-1).long()
        real = ~batch["is_pad"].view(-1).bool()
        return F.cross_entropy(logits, labels, reduction="none"), (logits.argmax(1) == labels), real

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        losses, _, real = self._losses(batch)
        self.train_steps += 1
        loss = (losses * real).sum() / real.sum().clamp(min=1)
        self.log("train_loss", loss, batch_size=int(real.sum()), prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        losses, correct, real = self._losses(batch)
        n = int(real.sum())
        self.log("val_loss", (losses * real).sum() / max(n, 1), batch_size=n, sync_dist=True)
        self.log("val_acc", (correct & real).sum().float() / max(n, 1), batch_size=n, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def parse_args(argv=None) -> argparse.Namespace:
    """The flags; a malformed one exits with argparse's usage error (status 2)."""
    p = argparse.ArgumentParser(description=description(__doc__))
    p.add_argument("dataset", help="dataset folder written by 'dali-pipes convert imagefolder'")
    p.add_argument("--val-dataset", help="validation dataset folder (default: the training one)")
    p.add_argument("--max-epochs", type=positive_int, default=1)
    p.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    p.add_argument("--size", type=positive_int, default=224)
    p.add_argument(
        "--devices", help="Lightning's devices: a count (e.g. 8 for 8 GPUs) or GPU indices such as 0,1 (default: auto)"
    )
    p.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"), help="where DALI runs")
    p.add_argument("--workers", type=non_negative_int, default=None, help="DALI Python workers reading the shards")
    p.add_argument("--seed", type=non_negative_int, default=0)
    return p.parse_args(argv)


def check_data(args: argparse.Namespace) -> int:
    """The class count, once the datasets are known to fit the flags (else a usage error naming the flag).

    Checked before Lightning starts: the loaders are built later, inside its
    ``setup()``, where a refusal would come wrapped in the trainer's traceback.
    """
    check_device(args.device)
    manifests = {}
    for flag, path in (("DATASET", args.dataset), ("--val-dataset", args.val_dataset)):
        if path is None:
            continue
        manifest = manifests[flag] = dataset_manifest(path, flag)
        require_fields(manifest, flag, path, ("image", "label"), KIND_ADVICE)
        if manifest.num_samples < args.batch_size:  # each batch would be mostly repeats of the same samples
            raise UsageError(
                f"--batch-size {args.batch_size} is more than the {counted(manifest.num_samples, 'sample')} of "
                f"{flag} {path}; use --batch-size {manifest.num_samples} or less"
            )
    classes = tuple(manifests["DATASET"].classes or ())
    if "--val-dataset" in manifests and tuple(manifests["--val-dataset"].classes or ()) != classes:
        theirs = tuple(manifests["--val-dataset"].classes or ())
        raise UsageError(
            f"--val-dataset {args.val_dataset} has another class list than {args.dataset} "
            f"({class_difference(classes, theirs, args.dataset, args.val_dataset)}): validate on a dataset "
            "converted with the same class list"
        )
    # The model is built before Lightning calls setup(): the class count comes from the manifest.
    return len(classes) or 1000


def make_trainer(args: argparse.Namespace) -> L.Trainer:
    """Lightning's trainer for the flags; a ``--devices`` it cannot use is a usage error naming the flag.

    The form of ``--devices`` is checked here, and GPU indices where there is no
    GPU; then Lightning refuses what it cannot use with ``MisconfigurationException``,
    or a ``ValueError``, which names ``--devices`` only when the user gave one:
    with the default, as any other error of the trainer, it is a bug and keeps
    its traceback.
    """
    devices = "auto" if args.devices is None else args.devices.strip()
    if not re.fullmatch(r"auto|-1|\d+|\d+(\s*,\s*\d+)*\s*,?", devices):
        fail(f"--devices {devices}: give a number of devices, GPU indices such as 0,1, or auto")
    if not torch.cuda.is_available() and not re.fullmatch(r"auto|[1-9]\d*", devices):
        # Lightning would answer with a TypeError, which this script does not take for a usage error.
        fail(f"--devices {devices}: there is no GPU here; on the CPU, give the number of processes (or auto)")
    try:
        return L.Trainer(
            max_epochs=args.max_epochs,
            devices=devices,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=os.getcwd(),
        )
    except MisconfigurationException as exc:  # Lightning's own refusal of its configuration
        fail(f"--devices {devices}: {short(exc)}" if args.devices is not None else short(exc), cause=exc)
    except ValueError as exc:
        if args.devices is None:
            raise
        fail(f"--devices {devices}: {short(exc)}", cause=exc)


def main(argv=None) -> TinyClassifier:
    """Train; returns the trained module."""
    args = parse_args(argv)
    with user_errors():
        num_classes = check_data(args)
    L.seed_everything(args.seed, verbose=False)
    data = DALIDataModule(
        args.dataset,
        args.val_dataset,
        batch_size=args.batch_size,
        size=args.size,
        seed=args.seed,
        device=args.device,
        workers=args.workers,
    )
    model = TinyClassifier(num_classes)
    trainer = make_trainer(args)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        steps = counted(model.train_steps, "step")
        print(f"trained {steps} over {trainer.current_epoch} epoch(s); metrics {metrics}", flush=True)
    return model


if __name__ == "__main__":
    main()
