"""The ranks' agreement on a stream's window (issue 54 item 9): bounded, and without a collective.

``agree_on_window`` goes through the default process group's key-value store: a streaming loader built on some
ranks only makes those ranks fail within :data:`~dali_pipes.loading.stream_setup.AGREEMENT_TIMEOUT_S` naming the
ranks that did not build theirs, and issues no collective, so the collectives that the ranks make next still match
(an ``all_reduce`` left queued on rank 0 met rank 1's ``DDP(model)`` broadcast instead). Checked with two real
processes in a gloo group: rank 0 builds its loader, rank 1 does not and broadcasts as DDP does; rank 0, after its
error, makes the same broadcast. And a rank that failed to open its stream still makes the others fail at once,
naming it (the store's key of its window says 0), not after the bound.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import time
from pathlib import Path

import pytest

from loader_helpers import TinySpec, free_port, quiet_dali_logs, write_dataset

#: The agreement's bound in the ranks of the test (the library waits 300 s by default).
BOUND_S = 3.0

#: What rank 0 broadcasts after its failed agreement, and rank 1 must receive.
SENT = 54


def only_rank_zero_builds(rank: int, port: int, dataset: str, out_dir: str) -> None:
    """One rank of a 2-rank gloo job: rank 0 builds a streaming loader, rank 1 goes on without one (as a script
    that builds its loader under ``if rank == 0`` does) to ``DDP(model)``'s broadcast from rank 0; rank 0 makes
    that broadcast after its loader's error. Each writes what it met to ``rank-N.json``."""
    import torch
    import torch.distributed as dist

    from dali_pipes import DALILoader, DataOptions, RunOptions, StreamOptions
    from dali_pipes.loading import stream_setup

    quiet_dali_logs()
    stream_setup.AGREEMENT_TIMEOUT_S = BOUND_S
    timeout = datetime.timedelta(seconds=60)  # gloo's own bound on the broadcast: a mismatch fails the test, not CI
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout)
    report: dict = {"error": None}
    if rank == 0:
        data = DataOptions(stream=StreamOptions(cache_limit=1 << 20, folder=Path(out_dir) / "cache"))
        start = time.monotonic()
        try:
            DALILoader(dataset, TinySpec(), batch_size=4, run=RunOptions(device="cpu"), data=data).close()
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names what it expected
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["seconds"] = time.monotonic() - start
    sent = torch.tensor([SENT if rank == 0 else -1], dtype=torch.int64)
    try:
        dist.broadcast(sent, src=0)
        report["received"] = int(sent.item())
    except Exception as exc:  # noqa: BLE001 - a mismatched collective, reported
        report["broadcast_error"] = f"{type(exc).__name__}: {exc}"
    (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_loader_built_on_one_rank_only_fails_in_bounded_time_and_the_next_collective_still_matches(tmp_path):
    dataset = write_dataset(tmp_path / "ds", 10)
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [ctx.Process(target=only_rank_zero_builds, args=(r, port, str(dataset), str(tmp_path))) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    try:
        for proc in ranks:
            proc.join(150)
        reports = {r: tmp_path / f"rank-{r}.json" for r in (0, 1)}
        assert reports[0].exists(), "rank 0 never got past its loader and the broadcast: it hangs"
        first, second = (json.loads(reports[r].read_text()) for r in (0, 1))
        error = first["error"]
        assert error is not None and error.startswith("LoaderError: rank 0: rank(s) 1 did not build"), first
        assert f"their streaming loader within {BOUND_S:g} s" in error
        assert "every rank must build its streaming loader" in error
        assert first["seconds"] < BOUND_S + 60  # generous: opening the loader's cache is the rest
        # No collective was left behind: the broadcast that both ranks make next carries rank 0's value.
        assert first.get("received") == SENT and second.get("received") == SENT, (first, second)
        assert [proc.exitcode for proc in ranks] == [0, 0]  # and both leave
    finally:
        for proc in ranks:
            if proc.is_alive():
                proc.kill()


def one_rank_fails_to_open(rank: int, port: int, out_dir: str) -> None:
    """One rank of a 2-rank gloo job agreeing on a window: rank 1 failed to open its stream (``None``), rank 0 had
    a window of 8 and a bound far above the test's; each writes what it met and when to ``rank-N.json``."""
    import torch.distributed as dist

    from dali_pipes.loading import stream_setup

    stream_setup.AGREEMENT_TIMEOUT_S = 120.0
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    start = time.monotonic()
    report: dict = {"error": None}
    try:
        report["window"] = stream_setup.agree_on_window(8 if rank == 0 else None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - start
    (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_failed_to_open_its_stream_makes_the_others_fail_at_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [ctx.Process(target=one_rank_fails_to_open, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    try:
        for proc in ranks:
            proc.join(90)
        first, second = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
        assert first["error"] == (
            "LoaderError: rank 0: rank 1 of the job could not open its stream (its error says why); this rank stops "
            "with it"
        ), first
        assert first["seconds"] < 60  # not the 120 s bound: rank 1 said so at once
        assert second == {"error": None, "window": 0, "seconds": second["seconds"]}
    finally:
        for proc in ranks:
            if proc.is_alive():
                proc.kill()
