"""Where this process runs: its rank in the data-parallel job, the device it feeds, and its cores.

:func:`detect_world` reads ``torch.distributed`` (or the launcher's ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``); :func:`resolve_device` turns ``device="auto"``
into a GPU or the CPU; :func:`rank_cores` says how many cores are this rank's.
``torch`` is imported when called, not at import.
"""

from __future__ import annotations

import logging
import os

from dali_pipes.loading.config import DEVICES
from dali_pipes.sampling import World
from dali_pipes.sampling import check_int as _check_int

__all__ = ["detect_world", "node_cpus", "pick_gpu", "rank_cores", "resolve_device"]

logger = logging.getLogger(__name__)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def detect_world(rank: int | None = None, world_size: int | None = None) -> tuple[World, int]:
    """``(World, local_rank)`` from ``torch.distributed``, else ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, else 0 of 1.

    Explicit ``rank``/``world_size`` override the environment, and must agree
    with an initialised process group.
    """
    import torch.distributed as dist

    if rank is not None:
        _check_int("rank", rank, 0)
    if world_size is not None:
        _check_int("world_size", world_size, 1)
    if dist.is_available() and dist.is_initialized():
        group_rank, group_size = dist.get_rank(), dist.get_world_size()
        if (rank is not None and rank != group_rank) or (world_size is not None and world_size != group_size):
            raise ValueError(
                f"rank={rank}, world_size={world_size} contradict torch.distributed (rank {group_rank} of "
                f"{group_size}); leave them out to use the process group's"
            )
        rank, world_size = group_rank, group_size
    else:
        if rank is None:
            rank = _env_int("RANK") or 0
        if world_size is None:
            world_size = _env_int("WORLD_SIZE") or 1
    world = World(rank, world_size)
    local_rank = _env_int("LOCAL_RANK")
    if local_rank is None:
        local_rank = world.rank % max(1, _cuda_device_count())
    return world, local_rank


def resolve_device(device: str, local_rank: int) -> tuple[str, int | None]:
    """``("gpu", device_id)`` or ``("cpu", None)`` for ``device`` in ``auto``, ``gpu``/``cuda``, ``cpu``.

    The GPU is chosen by :func:`pick_gpu`, as launchers hand devices out.
    """
    import torch

    if device not in DEVICES:
        raise ValueError(f"device must be 'auto', 'gpu' or 'cpu', got {device!r}")
    cuda = torch.cuda.is_available()
    if device == "auto":
        device = "gpu" if cuda else "cpu"
    if device in ("gpu", "cuda"):
        if not cuda:
            raise ValueError("device='gpu' but CUDA is not available here; use device='auto' or 'cpu'")
        return "gpu", pick_gpu(local_rank)
    return "cpu", None


def pick_gpu(local_rank: int) -> int:
    """The CUDA device this process feeds, as its launcher meant it; one log line says which and why.

    In order: the device the process already chose (``torch.cuda.set_device`` to
    other than device 0); ``local_rank`` when that many devices are visible (torchrun
    with every GPU visible); else the first visible device when the launcher gave
    this process its own (``CUDA_VISIBLE_DEVICES`` per process, as SLURM's
    ``--gpus-per-task`` does). Only more processes than devices on a node whose
    devices are all visible is refused.
    """
    import torch

    count = torch.cuda.device_count()
    if torch.cuda.is_initialized() and torch.cuda.current_device() != 0:
        chosen, why = torch.cuda.current_device(), "the device this process set (torch.cuda.set_device)"
    elif local_rank < count:
        chosen, why = local_rank, f"LOCAL_RANK {local_rank} of {count} visible device(s)"
    elif count == 1 or os.environ.get("CUDA_VISIBLE_DEVICES"):
        chosen = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        given = f"CUDA_VISIBLE_DEVICES={visible!r} gives" if visible else "it sees"
        why = f"{given} this process {count} device(s), which LOCAL_RANK {local_rank} does not index"
    else:
        raise ValueError(
            f"LOCAL_RANK {local_rank} has no GPU: this node shows all of its {count} GPU(s) to every process, so it "
            f"runs more processes than GPUs; start at most {count} per node (torchrun --nproc_per_node={count}), or "
            "give each process its own GPU (CUDA_VISIBLE_DEVICES, SLURM --gpus-per-task=1)"
        )
    # Said at INFO only where the choice is not plain LOCAL_RANK (the loader's own summary line names the GPU).
    logger.log(logging.DEBUG if chosen == local_rank else logging.INFO, "feeding cuda:%d: %s", chosen, why)
    return chosen


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_cores(affinity: frozenset[int] | set[int], node: frozenset[int] | set[int], local_ranks: int) -> int:
    """This rank's cores: its ``affinity``, split among the ``local_ranks`` of the node only when it is the node's.

    ``node``: the cores the node lets the job use (:func:`node_cpus`). A launcher that
    pins each rank to its share (``srun --cpu-bind``, ``torchrun --numa-binding`` in a per-rank mode,
    ``numactl`` per rank) leaves each an affinity smaller than the node's, which is
    already that rank's share: dividing it again gave 2 pinned cores among 8 ranks 1
    thread. An affinity that is the whole node is shared by every rank on it. An
    affinity narrower than the node but too wide to be one of ``local_ranks`` disjoint
    shares (``taskset -c 0-11`` around a launch of 8 ranks on 16 cores) is shared too.
    """
    cores = max(1, len(affinity))
    local_ranks = max(1, local_ranks)
    pinned = set(affinity) < set(node) and cores * local_ranks <= len(node)
    return cores if pinned else max(1, cores // local_ranks)


#: Where the cgroup file systems say which cores a process's group may use (v2, then v1).
_CPUSET_FILES = (("/sys/fs/cgroup", "cpuset.cpus.effective"), ("/sys/fs/cgroup/cpuset", "cpuset.effective_cpus"))


def node_cpus() -> frozenset[int]:
    """The cores this process's container (its cgroup's cpuset) may use, else every core of the machine.

    The process's own affinity is no measure of this: a launcher may have narrowed it.
    """
    for root, name in _CPUSET_FILES:
        for group in _cgroup_paths():
            path = os.path.join(root, group.lstrip("/"))
            while True:  # the nearest group with the cpuset controller says, up to the root
                listed = _read_cpu_list(os.path.join(path, name))
                if listed:
                    return listed
                if os.path.normpath(path) == os.path.normpath(root):
                    break
                path = os.path.dirname(path)
    return frozenset(range(os.cpu_count() or 1))


#: Where the cgroup file systems hold a group's CPU time quota: v2's ``cpu.max``, v1's quota and period.
_QUOTA_V2 = ("/sys/fs/cgroup", "cpu.max")
_QUOTA_V1 = ("/sys/fs/cgroup/cpu", "cpu.cfs_quota_us", "cpu.cfs_period_us")


def quota_cpus() -> int | None:
    """The cores' worth of CPU time this process's container may use (a CFS quota, as Kubernetes' CPU limit sets),
    rounded up; ``None`` without a quota. A pod limited to 16 CPUs on a 128-core node sees 128 cores in its
    cpuset and affinity, and threads sized by those would queue for the 16."""
    for group in _cgroup_paths("cpu"):
        v2 = _read_text(os.path.join(_QUOTA_V2[0], group.lstrip("/"), _QUOTA_V2[1]))
        if v2:
            return cpus_of_quota(*v2.split()[:2]) if len(v2.split()) >= 2 else None
        folder = os.path.join(_QUOTA_V1[0], group.lstrip("/"))
        quota, period = (_read_text(os.path.join(folder, name)) for name in _QUOTA_V1[1:])
        if quota and period:
            return cpus_of_quota(quota, period)
    return None


def cpus_of_quota(quota: str, period: str) -> int | None:
    """Whole cores of a CFS ``quota`` per ``period`` (microseconds; ``max`` or a negative quota: none), rounded up."""
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no limit
        return None
    return None if q <= 0 or p <= 0 else max(1, -(-q // p))


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _cgroup_paths(controller: str = "cpuset") -> list[str]:
    """This process's cgroup paths (``/proc/self/cgroup``: the unified one and ``controller``'s), or ``["/"]``."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return ["/"]
    paths = [
        line.split(":", 2)[2]
        for line in lines
        if line.count(":") >= 2 and (not line.split(":")[1] or controller in line.split(":")[1].split(","))
    ]
    return paths or ["/"]


def _read_cpu_list(path: str) -> frozenset[int]:
    """The cores of a cpuset list file (``0-3,8-11``); empty when it cannot be read."""
    try:
        with open(path) as f:
            text = f.read().strip()
        cores: set[int] = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
        return frozenset(cores)
    except (OSError, ValueError):
        return frozenset()
