"""What a long training run of the examples needs: a checkpoint every N steps, and a line saying it is moving.

A streamed epoch over a large dataset can take hours: ``--checkpoint-every N`` saves the loader's
state mid-epoch (``DALILoader.state_dict()`` resumes it from the batch it reached), and
``--progress-every SECONDS`` has rank 0 say the step and the images a second while it runs.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from torch import nn

from dali_pipes import DALILoader
from dali_pipes.examples.usage import non_negative_float, non_negative_int, say


def add_long_run_flags(p: argparse.ArgumentParser) -> None:
    """``--checkpoint FILE``, ``--checkpoint-every N``, ``--resume`` and ``--progress-every SECONDS``."""
    p.add_argument("--checkpoint", help="save model, optimiser and loader state here after every epoch")
    p.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also save --checkpoint every N steps of an epoch, so a long epoch resumes from there (0: at its end only)",
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint (mid-epoch where it was saved)")
    p.add_argument(
        "--progress-every",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="rank 0 says the step and images/s this often during an epoch (0: only at its end)",
    )


class Checkpoints:
    """``--checkpoint``: model, optimiser and loader state, saved by rank 0 after every epoch and, with
    ``--checkpoint-every N``, every N steps within one, so a long (streamed) epoch resumes from its last save."""

    def __init__(self, args: argparse.Namespace, net: nn.Module, optimizer: Any, loader: DALILoader, rank: int):
        self.path, self.every = args.checkpoint, args.checkpoint_every
        self.net, self.optimizer, self.loader, self.rank = net, optimizer, loader, rank
        self.held: str | None = None  # where the saved checkpoint resumes, said when the run is interrupted

    def save(self, held: str) -> None:
        """Write the checkpoint through a temporary name: a run killed while saving keeps the previous one.
        ``held``: what it holds, in words (``step 4``), for the line of an interrupted run."""
        if not self.path or self.rank != 0:  # every rank's loader state is the same; one writes it
            return
        state = {"model": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}
        state["loader"] = self.loader.state_dict()
        torch.save(state, f"{self.path}.tmp")
        os.replace(f"{self.path}.tmp", self.path)
        self.held = held

    def where(self) -> str | None:
        """What a rerun with ``--resume`` continues from, or ``None`` before the first save."""
        return f"the checkpoint {self.path} holds {self.held}; --resume continues from it" if self.held else None

    def after_step(self, step: int) -> None:
        """Save when the epoch's ``step`` (counted from 1) is a multiple of ``--checkpoint-every``."""
        if self.every and step % self.every == 0:
            self.save(f"step {step}")


class Progress:
    """Rank 0's line every ``--progress-every`` seconds of an epoch: the step, and the images a second since the
    epoch's pass began (this process's, times the processes), so a long first epoch shows it is moving."""

    def __init__(self, every: float, world: int, rank: int):
        self.every, self.world, self.shown = every, world, every > 0 and rank == 0
        self.epoch, self.steps, self.images, self.start, self.last = 0, 0, 0, 0.0, 0.0

    def begin(self, epoch: int, loader: DALILoader) -> int:
        """Start timing ``epoch``'s pass; returns the steps of it done before (a resumed pass goes on from there)."""
        done = steps_done(loader)
        self.epoch, self.steps, self.images = epoch, done + len(loader), 0
        self.start = self.last = time.perf_counter()
        return done

    def after_step(self, step: int, images: int) -> None:
        self.images += images
        now = time.perf_counter()
        if self.shown and now - self.last >= self.every:
            self.last = now
            rate = self.images * self.world / max(now - self.start, 1e-9)
            say(f"epoch {self.epoch}: step {step} of {self.steps}, {rate:.1f} images/s")


def steps_done(loader: DALILoader) -> int:
    """The steps of the current epoch that the loader's state says were taken (0, unless it was resumed mid-epoch)."""
    return loader.state_dict()["samples_consumed"] // (loader.batch_size * loader.world.world_size)
