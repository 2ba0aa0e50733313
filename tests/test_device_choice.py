"""Which GPU a process feeds, as launchers hand devices out (torchrun, SLURM, a user's set_device).

These run on CPU machines: ``torch.cuda``'s device queries are patched to describe a node.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dali_pipes.loading.world import pick_gpu, resolve_device


@pytest.fixture
def node(monkeypatch):
    """``node(count, current=None, visible=None)``: a node showing ``count`` GPUs to this process.

    ``current`` is the device the process set (``torch.cuda.set_device``), None if it set none;
    ``visible`` the launcher's ``CUDA_VISIBLE_DEVICES``, None if unset.
    """

    def describe(count: int, current: int | None = None, visible: str | None = None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: current is not None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0 if current is None else current)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    return describe


def test_torchrun_with_every_gpu_visible_feeds_local_rank(node, caplog):
    node(8)
    with caplog.at_level(logging.DEBUG, logger="dali_pipes.loading.world"):
        assert resolve_device("auto", 3) == ("gpu", 3)
    assert [r.getMessage() for r in caplog.records] == ["feeding cuda:3: LOCAL_RANK 3 of 8 visible device(s)"]


def test_slurm_one_gpu_per_task_feeds_the_one_visible_device(node, caplog):
    # srun --gpus-per-task=1: each task sees one GPU, while LOCAL_RANK runs 0..7.
    node(1, visible="5")
    with caplog.at_level(logging.INFO, logger="dali_pipes.loading.world"):
        assert resolve_device("gpu", 5) == ("gpu", 0)
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("feeding cuda:0: CUDA_VISIBLE_DEVICES='5' gives this process 1 device(s)"), message


def test_a_device_the_process_set_wins_over_local_rank(node):
    # The user called torch.cuda.set_device(2) (say, from their own rank arithmetic): feed what the model is on.
    node(8, current=2)
    assert pick_gpu(5) == 2


def test_several_devices_per_task_use_the_set_one_or_the_first(node):
    # --gpus-per-task=2: LOCAL_RANK 3 does not index the two devices this task sees.
    node(2, visible="6,7")
    assert pick_gpu(3) == 0
    node(2, current=1, visible="6,7")
    assert pick_gpu(3) == 1


def test_more_processes_than_gpus_with_all_visible_is_refused_naming_the_fix(node):
    node(4)
    with pytest.raises(ValueError) as excinfo:
        resolve_device("auto", 4)
    message = str(excinfo.value)
    assert "LOCAL_RANK 4 has no GPU" in message
    assert "--nproc_per_node=4" in message
    assert "CUDA_VISIBLE_DEVICES" in message


def test_without_cuda_auto_is_the_cpu_and_gpu_is_refused(node):
    node(0)
    assert resolve_device("auto", 0) == ("cpu", None)
    assert resolve_device("cpu", 7) == ("cpu", None)
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("gpu", 0)
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu", 0)
