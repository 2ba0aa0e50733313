"""What a loader does when not told: shuffle as the spec says, and a clear error for a spec class."""

from __future__ import annotations

import pytest

from dali_pipes import BatchFormat, ClassificationTrain, ClassificationVal, DALILoader, DetectionVal, RunOptions

from loader_helpers import TinySpec, write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("defaults") / "ds", 24, samples_per_shard=8)


def _order(dataset, spec, **kwargs) -> list[int]:
    run = RunOptions(device="cpu", py_num_workers=0)
    with DALILoader(dataset, spec, batch_size=6, run=run, batch_format=BatchFormat(with_index=True), **kwargs) as it:
        return [int(i) for batch in it for i in batch["index"]]


def test_evaluation_specs_read_in_order_and_training_specs_shuffle_by_default(dataset):
    val = ClassificationVal(size=16, resize=16)
    assert DetectionVal.shuffle_by_default is False and ClassificationVal.shuffle_by_default is False
    assert _order(dataset, val) == list(range(24))
    train = _order(dataset, ClassificationTrain(size=16))
    assert sorted(train) == list(range(24)) and train != list(range(24))
    # A spec that does not say (a user's own) shuffles, as before; an explicit argument always wins.
    assert _order(dataset, TinySpec()) != list(range(24))
    assert _order(dataset, val, shuffle=True) != list(range(24))
    assert _order(dataset, ClassificationTrain(size=16), shuffle=False) == list(range(24))


def test_a_spec_class_instead_of_an_instance_says_to_pass_an_instance(dataset):
    with pytest.raises(TypeError, match=r"pass a pipeline spec instance, ClassificationTrain\(\), not the class"):
        DALILoader(dataset, ClassificationTrain, batch_size=4, run=RunOptions(device="cpu"))


# --- this rank's cores: divided among the node's ranks only when the affinity is the whole node ----------------


def test_an_affinity_the_launcher_narrowed_is_already_this_ranks_share():
    from dali_pipes.loading.world import rank_cores

    node = frozenset(range(16))
    # torchrun --numa-binding / srun --cpu-bind: 8 ranks, each pinned to its 2 cores; before, 2 // 8 gave 1.
    assert rank_cores(frozenset({4, 5}), node, 8) == 2
    assert rank_cores(node, node, 8) == 2  # not pinned: the 8 ranks share the 16
    assert rank_cores(node, node, 1) == 16
    # Narrowed for the whole launch (taskset -c 0-11 around 8 ranks): too wide to be one rank's share, so shared.
    assert rank_cores(frozenset(range(12)), node, 8) == 1
    assert rank_cores(frozenset({0}), node, 64) == 1


CORES_SCRIPT = """
import json, os, sys
os.sched_setaffinity(0, json.loads(sys.argv[1]))
from dali_pipes.loading.options import cores_per_rank
print(cores_per_rank())
"""


def _cores_in_process_pinned_to(cores, local_ranks: int) -> int:
    """``cores_per_rank()`` in a new process whose affinity is ``cores``, as a launcher leaves a rank."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "LOCAL_WORLD_SIZE": str(local_ranks)}
    proc = subprocess.run(
        [sys.executable, "-c", CORES_SCRIPT, json.dumps(sorted(cores))],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    return int(proc.stdout.strip())


def test_a_process_on_the_whole_node_divides_it_among_the_nodes_ranks():
    from dali_pipes.loading.world import node_cpus

    node = sorted(node_cpus())
    assert _cores_in_process_pinned_to(node, 2) == max(1, len(node) // 2)
    assert _cores_in_process_pinned_to(node[:1], 8) == 1


def test_a_process_pinned_to_its_share_keeps_it():
    from dali_pipes.loading.world import node_cpus

    node = sorted(node_cpus())
    if len(node) < 4:
        pytest.skip(f"{len(node)} cores: a share of 2 cores that ranks did not divide again needs 4 or more")
    # Half as many ranks as the node's cores, each pinned to 2 of them: 2 each (1 before: divided again).
    assert _cores_in_process_pinned_to(node[:2], len(node) // 2) == 2


def test_a_containers_cpu_quota_caps_each_ranks_share():
    """A Kubernetes CPU limit is a CFS quota: the cpuset still shows every core of the node."""
    from dali_pipes.loading.world import cpus_of_quota

    assert cpus_of_quota("max", "100000") is None  # cgroup v2 without a limit
    assert cpus_of_quota("-1", "100000") is None  # cgroup v1 without a limit
    assert cpus_of_quota("1600000", "100000") == 16
    assert cpus_of_quota("150000", "100000") == 2  # 1.5 CPUs: rounded up
    assert cpus_of_quota("50000", "100000") == 1


def test_cores_per_rank_is_the_ranks_share_of_the_quota(monkeypatch):
    import os

    from dali_pipes.loading import world
    from dali_pipes.loading.options import cores_per_rank

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    mine = len(os.sched_getaffinity(0))
    monkeypatch.setattr(world, "quota_cpus", lambda: None)
    unlimited = cores_per_rank()
    monkeypatch.setattr(world, "quota_cpus", lambda: 1)
    assert cores_per_rank() == 1 <= unlimited
    monkeypatch.setattr(world, "quota_cpus", lambda: 64)  # a quota above the cores changes nothing
    assert cores_per_rank() == unlimited == mine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(world, "quota_cpus", lambda: 2)  # two ranks share 2 CPUs' worth of time
    assert cores_per_rank() == 1


def test_default_reader_processes_that_a_streamed_cache_cannot_serve_become_none_saying_why(caplog, monkeypatch):
    # Issue 56 item 2: reader processes stream, their batches pinned whole; a cache whose windows hold fewer samples
    # than those batches reads in the loader's process by default (it reads such a batch shard by shard) and says so;
    # processes the caller chose are left to the refusal at the build.
    import logging

    from dali_pipes.loading import options
    from dali_pipes.loading.options import choose_counts

    monkeypatch.setattr(options, "cores_per_rank", lambda: 16)  # a GPU node's share: reader processes by default
    asked = []

    def refusal(workers: int) -> str | None:
        asked.append(workers)
        return "the windows are too small" if workers > 0 else None

    caplog.set_level(logging.INFO, logger="dali_pipes.loading.options")
    chosen = choose_counts(2, None, "lmdb", True, gpu_images=True, refusal=refusal)  # the GPU feed's default > 0
    assert chosen == (2, 0) and asked and asked[0] > 0
    assert "0 reader processes (none by default here: the windows are too small)" in caplog.text
    assert choose_counts(2, 3, "lmdb", True, gpu_images=True, refusal=refusal) == (2, 3)
    assert choose_counts(2, None, "lmdb", True, gpu_images=True, refusal=lambda workers: None)[1] == asked[0]
