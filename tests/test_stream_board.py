"""The board a streamed loader shares with its reader processes (dali_pipes/loading/stream_board.py), in real
processes: a reader takes its batch as held only while each of its shards is ready; the loader's process, letting
go of shards, is told which a live reader still reads; a reader that died holds nothing; the board's lock excludes
a forked child and its parent from each other.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

from dali_pipes.loading.stream_board import READY, ReadBoard

SIZES = np.array([4, 4, 4, 4, 4, 4])  # samples a shard


def shard_of(samples: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.cumsum(SIZES), samples, side="right")


def hold_then_wait(board: ReadBoard, samples: list[int], held, done, finish) -> None:
    """A reader process: posts ``samples``, holds their shards once ready, says so, waits to be told to finish."""
    board.post(0, np.array(samples), np.zeros(len(samples), dtype=bool))
    shards = sorted(set(shard_of(np.array(samples)).tolist()))
    while not board.hold(shards):
        pass
    held.set()
    finish.wait(30)
    board.done()
    done.set()


@pytest.fixture
def board():
    made = ReadBoard(len(SIZES), slots=4, capacity=8)
    yield made
    made.close()


def start_reader(board: ReadBoard, samples: list[int]):
    ctx = mp.get_context("fork")
    held, done, finish = ctx.Event(), ctx.Event(), ctx.Event()
    process = ctx.Process(target=hold_then_wait, args=(board, samples, held, done, finish), daemon=True)
    process.start()
    return process, held, done, finish


def test_a_held_shard_is_reported_until_its_reader_is_done(board):
    for k in range(len(SIZES)):
        board.mark(k, READY)
    process, held, done, finish = start_reader(board, [1, 5, 9])  # shards 0, 1, 2
    assert held.wait(30)
    assert board.release([1, 2, 3], shard_of) == {1, 2}  # still read: they stay pinned
    assert all(board.ready(k) != READY for k in (1, 2, 3))  # cleared though: no new reader takes them
    finish.set()
    assert done.wait(30)
    assert board.release([1, 2, 3], shard_of) == set()
    process.join(30)


def test_a_reader_waits_while_one_of_its_shards_is_not_ready(board):
    board.mark(0, READY)
    process, held, _, finish = start_reader(board, [0, 4])  # shards 0 and 1: 1 not ready
    assert not held.wait(0.5)
    assert board.release([0], shard_of) == set()  # waiting, not holding: nothing kept for it
    board.mark(0, READY)
    board.mark(1, READY)
    assert held.wait(30)
    finish.set()
    process.join(30)


def test_a_reader_killed_while_holding_holds_nothing(board):
    for k in range(len(SIZES)):
        board.mark(k, READY)
    process, held, _, _ = start_reader(board, [20, 21])  # shard 5
    assert held.wait(30)
    assert board.release([5], shard_of) == {5}
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    assert board.release([5], shard_of) == set()  # its slot's lock ended with it
    assert not any(p.holding for p in board.posted())


def test_the_lock_excludes_a_forked_child_from_its_parent(board):
    for k in range(len(SIZES)):
        board.mark(k, READY)
    with board.locked():  # taken before the fork: the child's descriptor must be its own, or it would pass
        process, held, _, finish = start_reader(board, [0])
        assert not held.wait(0.5)  # hold() waits for the parent's lock
    assert held.wait(30)
    finish.set()
    process.join(30)


def wait_for_shard(board: ReadBoard, shard: int, errors) -> None:
    """A reader process waiting for ``shard`` as reader_before_read does; what it raised, into ``errors``."""
    from types import SimpleNamespace

    from dali_pipes.loading.stream_readers import _wait_ready

    try:
        _wait_ready(board, shard, SimpleNamespace(root="ds"))  # the store only names itself in the error
    except Exception as exc:  # noqa: BLE001 - handed to the test
        errors.put(f"{type(exc).__name__}: {exc}")


def test_a_board_stopped_by_the_loaders_process_ends_the_readers_waits_with_its_message(board):
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    process = ctx.Process(target=wait_for_shard, args=(board, 2, errors), daemon=True)
    process.start()
    board.stop("the loader's process stopped serving its reader processes: the board is unreadable")
    assert errors.get(timeout=30) == (
        "StoreError: ds: the loader's process stopped serving its reader processes: the board is unreadable"
    )
    process.join(30)
