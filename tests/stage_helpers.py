"""A rank of a real DDP job (gloo, CPU DALI) that stages its dataset through ``DataOptions(stage_to=...)``."""

from __future__ import annotations

import json
import os


def staging_rank(rank: int, world_size: int, port: int, dataset: str, dest: str, out_dir: str) -> None:
    """Build a loader with ``stage_to=dest``, read one epoch, and write what staging did and what was read."""
    import torch
    import torch.distributed as dist

    from dali_pipes import BatchFormat, DALILoader, DataOptions, RunOptions

    from loader_helpers import TinySpec

    os.environ["LOCAL_RANK"] = str(rank)  # one node: the local rank is the rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        loader = DALILoader(
            dataset,
            TinySpec(),
            batch_size=3,
            batch_format=BatchFormat(with_index=True),
            run=RunOptions(device="cpu", py_num_workers=0),
            data=DataOptions(stage_to=dest),
        )
        indices = []
        for batch in loader:
            dist.all_reduce(torch.ones(1))
            indices.append(batch["index"].tolist())
        report = {
            "copied": loader.staged.copied,
            "reused": loader.staged.reused,
            "root": str(loader.store.root),
            "indices": indices,
        }
        loader.close()
        with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
