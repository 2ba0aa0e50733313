"""Who reads which sample when: the epoch order, each DDP rank's share, padding and resume.

Pure functions over integers and numpy arrays (no DALI, no I/O), in
:mod:`dali_pipes.sampling.rules`; the loader, the RAM cache and the public API
all import them from here.
"""

from dali_pipes.sampling.rules import (
    LAST_BATCH_POLICIES,
    World,
    check_int,
    epoch_order,
    num_batches,
    rank_indices,
    samples_consumed,
    samples_per_rank,
)

__all__ = [
    "LAST_BATCH_POLICIES",
    "World",
    "check_int",
    "epoch_order",
    "num_batches",
    "rank_indices",
    "samples_consumed",
    "samples_per_rank",
]
