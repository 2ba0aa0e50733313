"""A loader's saved position (``DALILoader.state_dict()``): what it holds and how it is checked on resume.

The state is the epoch and the global samples of it consumed, plus what must
match for the rest of that epoch to be the same samples here (dataset size,
seed, shuffle, last-batch policy). It does not depend on the world size or the
batch size, so a run resumes on another.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from dali_pipes.sampling import check_int

__all__ = ["STATE_VERSION", "Pass", "SavedPosition", "loader_state", "restored_position"]

STATE_VERSION = 1
#: What :func:`loader_state` writes, each checked by :func:`restored_position`.
STATE_KEYS = ("version", "epoch", "samples_consumed", "num_samples", "seed", "shuffle", "last_batch")


def loader_state(
    epoch: int, consumed: int, *, num_samples: int, seed: int, shuffle: bool, last_batch: str, sampling: Any = None
) -> dict:
    """The dict ``DALILoader.state_dict()`` returns (``sampling``: a weighted draw's identity, kept when there is one)."""
    extra = {} if sampling is None else {"sampling": sampling}
    return {
        **extra,
        "version": STATE_VERSION,
        "epoch": epoch,
        "samples_consumed": consumed,
        "num_samples": num_samples,
        "seed": seed,
        "shuffle": shuffle,
        "last_batch": last_batch,
    }


def restored_position(
    state: Mapping[str, Any],
    root: str | os.PathLike,
    *,
    num_samples: int,
    seed: int,
    shuffle: bool,
    last_batch: str,
    sampling: Any = None,
) -> tuple[int, int]:
    """``(epoch, samples consumed)`` to resume from ``state``; ValueError naming what does not match this loader."""
    if not isinstance(state, Mapping):
        raise ValueError(f"load_state_dict expects the dict from state_dict(), got {type(state).__name__}")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"loader state is missing {missing}; pass the dict that DALILoader.state_dict() returned")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"loader state version {state['version']!r} is not {STATE_VERSION}")
    mine_all = {"num_samples": num_samples, "seed": seed, "shuffle": shuffle, "last_batch": last_batch}
    for key, mine in (*mine_all.items(), ("sampling", sampling)):
        if state.get(key) != mine:
            raise ValueError(
                f"{root}: the saved loader state has {key}={state.get(key)!r} but this loader has "
                f"{key}={mine!r}; resuming would not give the rest of the saved epoch"
            )
    epoch = check_int("epoch", state["epoch"], 0)
    consumed = check_int("samples_consumed", state["samples_consumed"], 0)
    if consumed > num_samples:
        raise ValueError(f"samples_consumed {consumed} is more than the {num_samples} samples of the dataset")
    if consumed == num_samples:
        epoch, consumed = epoch + 1, 0
    return epoch, consumed


@dataclass
class Pass:
    """One iteration over (the rest of) an epoch on this rank."""

    epoch: int
    start: int
    batches: int
    samples: int  # this rank's samples, so the last batch can be trimmed to them
    handed: int = 0  # batches given to the user
    drained: bool = True  # DALI's epoch under this pass has ended (not while it reads on into the next pass)


class SavedPosition:
    """``set_epoch``, ``state_dict`` and ``load_state_dict`` of :class:`~dali_pipes.DALILoader` (mixed into it),
    and the pass they make next.

    Needs the loader's ``_pending``, ``_pass`` and ``_position`` (``(epoch, consumed)``), ``_sizes``
    (a size schedule's record), ``store``, ``seed``, ``shuffle``, ``last_batch``,
    ``sampling`` and ``epoch_length``.
    """

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass cover ``epoch`` (its order depends only on ``(seed, epoch)``).

        Setting the epoch that :meth:`load_state_dict` restored keeps its resume
        offset, so ``load_state_dict(...)`` followed by the usual
        ``for epoch in range(start, end): loader.set_epoch(epoch); ...`` resumes mid-epoch.
        """
        epoch = check_int("epoch", epoch, 0)
        # A pending pass of this epoch is either a restored one (keep its offset) or (epoch, 0) already.
        if self._pending is None or self._pending[0] != epoch:
            self._pending = (epoch, 0)

    def _next_pass(self) -> tuple[int, int]:
        if self._pending is not None:
            return self._pending
        current = self._pass
        if current is not None and 0 < current.handed < current.batches:
            return current.epoch + 1, 0  # a pass left part-way: the next one starts the next epoch
        return self._position

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: the epoch and the global samples of it consumed so far.

        Counts the batches handed to the user (not those DALI prefetched). The
        same on every rank of a job that steps in lockstep, and valid on another
        world size or batch size. A spec with ``size_at`` (``ClassificationTrain``)
        adds the epoch's output ``size``, which a resumed epoch keeps.
        """
        epoch, consumed = self._pending if self._pending is not None else self._position
        return self._sizes.record(loader_state(epoch, consumed, **self._state_identity()))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next pass covers the rest of the saved epoch."""
        self._pending = restored_position(state, self.store.root, **self._state_identity())
        self._sizes.restore(state, self._pending)

    def _state_identity(self) -> dict[str, Any]:
        # What a saved state must agree on to mean the same epoch order here.
        sampling = None if self.sampling is None else self.sampling.identity()
        return dict(
            num_samples=self.epoch_length,
            seed=self.seed,
            shuffle=self.shuffle,
            last_batch=self.last_batch,
            sampling=sampling,
        )
