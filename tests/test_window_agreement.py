"""The ranks' agreement on a stream's window (issue 54 item 9): on the loader's own device, and bounded.

``agree_on_window`` is a collective of the default process group: in an NCCL group its tensor must be on this
loader's GPU (it was ``cuda:current_device()``, GPU 0 on every rank that had not called ``set_device``), and a
streaming loader built on some ranks only must not hang the ranks that built theirs. The second is checked with
two real processes in a gloo group where only rank 0 builds its loader.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from dali_pipes.loading.stream_setup import agreement_device

from loader_helpers import TinySpec, free_port, quiet_dali_logs, write_dataset

#: The agreement's bound in the ranks of the test (the library waits 300 s by default).
BOUND_S = 3.0


@pytest.mark.parametrize(
    ("backend", "device_id", "expected"),
    [("nccl", 3, torch.device("cuda", 3)), ("nccl", 0, torch.device("cuda", 0)), ("gloo", 3, torch.device("cpu"))],
)
def test_the_agreement_runs_on_the_loader_s_device(backend, device_id, expected):
    assert agreement_device(backend, device_id) == expected


def only_rank_zero_builds(rank: int, port: int, dataset: str, out_dir: str) -> None:
    """One rank of a 2-rank gloo job: rank 0 builds a streaming loader, rank 1 goes on without one (as a script
    that builds its loader under ``if rank == 0`` does), waiting for rank 0's report before it leaves."""
    import torch.distributed as dist

    from dali_pipes import DALILoader, DataOptions, RunOptions, StreamOptions
    from dali_pipes.loading import stream_setup

    quiet_dali_logs()
    stream_setup.AGREEMENT_TIMEOUT_S = BOUND_S
    report = Path(out_dir) / "rank-0.json"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        deadline = time.monotonic() + 120
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    data = DataOptions(stream=StreamOptions(cache_limit=1 << 20, folder=Path(out_dir) / "cache"))
    start = time.monotonic()
    try:
        DALILoader(dataset, TinySpec(), batch_size=4, run=RunOptions(device="cpu"), data=data).close()
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names what it expected
        error = f"{type(exc).__name__}: {exc}"
    report.write_text(json.dumps({"error": error, "seconds": time.monotonic() - start}))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_streaming_loader_built_on_one_rank_only_fails_in_bounded_time_instead_of_hanging(tmp_path):
    dataset = write_dataset(tmp_path / "ds", 10)
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [ctx.Process(target=only_rank_zero_builds, args=(r, port, str(dataset), str(tmp_path))) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    try:
        for proc in ranks:
            proc.join(120)
        report = tmp_path / "rank-0.json"
        assert report.exists(), "rank 0 never finished building its loader: it hangs"
        result = json.loads(report.read_text())
        assert result["error"] is not None and result["error"].startswith("LoaderError: rank 0:"), result
        assert f"did not agree on the stream's window within {BOUND_S:g} s" in result["error"]
        assert "every rank must build its streaming loader" in result["error"]
        assert result["seconds"] < BOUND_S + 60  # generous: opening the loader's cache is the rest
        assert [proc.exitcode for proc in ranks] == [0, 0]  # and both leave
    finally:
        for proc in ranks:
            if proc.is_alive():
                proc.kill()
