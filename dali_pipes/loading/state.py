"""A loader's saved position (``DALILoader.state_dict()``): what it holds and how it is checked on resume.

The state is the epoch and the global samples of it consumed, plus what must
match for the rest of that epoch to be the same samples here (dataset size,
seed, shuffle, last-batch policy). It does not depend on the world size or the
batch size, so a run resumes on another.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from dali_pipes.sampling import check_int

__all__ = ["STATE_VERSION", "loader_state", "restored_position", "restored_stream", "stream_record"]

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
        if key == "sampling" and _former_stream_at_an_epochs_end(state, mine):
            continue  # the order of the next epoch is this version's, whichever wrote the state
        if state.get(key) != mine:
            raise ValueError(
                f"{root}: the saved loader state has {key}={state.get(key)!r} but this loader has "
                f"{key}={mine!r}; resuming would not give the rest of the saved epoch{_window_hint(state.get(key), mine)}"
            )
    epoch = check_int("epoch", state["epoch"], 0)
    consumed = check_int("samples_consumed", state["samples_consumed"], 0)
    if consumed > num_samples:
        raise ValueError(f"samples_consumed {consumed} is more than the {num_samples} samples of the dataset")
    if consumed == num_samples:
        epoch, consumed = epoch + 1, 0
    return epoch, consumed


def _former_stream(saved: Any, mine: Any) -> bool:
    """True for a state of dali-pipes 0.2's streamed order (shard windows over the whole dataset) met by the
    partitioned one."""
    return (
        isinstance(saved, dict) and "window" in saved and isinstance(mine, dict) and mine.get("order") == "partitioned"
    )


def _former_stream_at_an_epochs_end(state: Mapping[str, Any], mine: Any) -> bool:
    """A 0.2 streamed state of the same shards saved where an epoch ends (nothing of an epoch read): it resumes."""
    saved = state.get("sampling")
    same_shards = isinstance(saved, dict) and isinstance(mine, dict)
    same_shards = same_shards and saved.get("shard_sizes_sha256") == mine.get("shard_sizes_sha256")
    at_an_end = state.get("samples_consumed") in (0, state.get("num_samples"))
    return _former_stream(saved, mine) and same_shards and at_an_end


def _window_hint(saved: Any, mine: Any) -> str:
    """What to do when a state of dali-pipes 0.2's streamed order (shard windows over the whole dataset) meets the
    partitioned one."""
    if _former_stream(saved, mine):
        return (
            ". The state was saved by dali-pipes 0.2, whose streamed order was not partitioned: resume from its "
            "epoch's start (set_epoch(epoch) without load_state_dict)"
        )
    return ""


def stream_record(state: dict, order: Any) -> dict:
    """``state`` with ``"stream"``, each partition's progress, when a streamed ``order`` is part-way through its epoch
    (:class:`~dali_pipes.sampling.node_order.NodeOrder`): what resumes on another node count."""
    if order is not None and 0 < state["samples_consumed"] < state["num_samples"]:
        state["stream"] = order.progress(state["epoch"], state["samples_consumed"]).as_dict()
    return state


def restored_stream(
    state: Mapping[str, Any], position: tuple[int, int], order: Any, root: str | os.PathLike
) -> tuple[int, int]:
    """``position`` resumed in a streamed ``order``: from the state's partition progress, checked against it."""
    from dali_pipes.sampling.node_order import check_progress

    epoch, consumed = position
    if order is None:
        return position
    if consumed == 0:
        order.restore(check_progress({"window": 1, "consumed": []}, epoch))
        return position
    try:  # every refusal raised here, in one frame: the examples tell them from a bug by it
        progress = order.read_progress(state.get("stream"), epoch)
        if sum(progress.consumed) != consumed:
            raise ValueError(
                f"it adds up to {sum(progress.consumed)} samples but the state says samples_consumed={consumed}; "
                "pass the dict that state_dict() returned, unchanged"
            )
        return epoch, order.restore(progress)
    except ValueError as exc:
        raise ValueError(f"{root}: the saved loader state's stream progress: {exc}") from None
