"""``free_port`` (tests/loader_helpers.py): a rendezvous port that no other process is handed before the job binds it.

The DDP tests pick a port, then start processes whose rank 0 binds it. The old
helper bound port 0 and closed the socket, so under ``pytest -n auto`` the kernel
could hand the same port to another test in between. The helper now keeps it bound.
"""

from __future__ import annotations

import datetime
import errno
import socket
import sys

import pytest

from loader_helpers import free_port

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the reservation relies on Linux's SO_REUSEADDR rules")


def test_a_port_handed_out_stays_taken_for_every_other_socket():
    port = free_port()
    # What another test's probe, or any process, does: bind it. Refused while this process runs; the old helper
    # had already released it here.
    with socket.socket() as other:
        with pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
    assert refused.value.errno == errno.EADDRINUSE
    # Nor is it handed to a socket asking for any free port.
    probes = []
    try:
        for _ in range(300):
            probe = socket.socket()
            probes.append(probe)
            probe.bind(("127.0.0.1", 0))
            assert probe.getsockname()[1] != port
    finally:
        for probe in probes:
            probe.close()
    assert len({free_port() for _ in range(5)} | {port}) == 6  # each call a port of its own


@pytest.mark.parametrize("use_libuv", [True, False])
def test_torchs_store_binds_the_reserved_port_and_ranks_meet_there(use_libuv):
    import torch.distributed as dist

    port = free_port()
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout, wait_for_workers=False, use_libuv=use_libuv)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout, use_libuv=use_libuv)
    client.set("rank-1", "here")
    assert server.get("rank-1") == b"here"
    del client, server


def test_a_gloo_process_group_rendezvous_at_the_reserved_port():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 1.0
    finally:
        dist.destroy_process_group()
