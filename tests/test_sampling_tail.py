"""The last step of an epoch under DDP: its samples dealt out evenly, so that dropping the padding leaves no rank empty.

An evaluation that drops the wrap-around filler (``BatchFormat(drop_padding=True)``)
must still hand every rank a non-empty last batch: accuracy functions divide by its
rows, and every rank takes the same number of steps. These are the pure rules
(``dali_pipes/sampling/rules.py``); ``tests/test_dataloader_shape.py`` runs real loaders.
"""

from __future__ import annotations

import itertools

import numpy as np

from dali_pipes.sampling import epoch_order, num_batches, padding_only_ranks, rank_indices, split_order

SIZES = [1, 2, 3, 4, 5, 7, 10, 13, 16, 23, 31, 64, 100]
BATCHES = [1, 2, 3, 4, 8]
WORLDS = [1, 2, 3, 4, 5, 8]


def last_batches(n, b, w, start=0):
    """Every rank's ``(indices, is_pad)`` of its last batch of the rest of epoch 0 from ``start``."""
    out = []
    for rank in range(w):
        indices, is_pad = rank_indices(n, b, rank, w, 0, 3, start=start)
        lo = (num_batches(n, b, w, start=start) - 1) * b
        out.append((indices[lo:], is_pad[lo:]))
    return out


def test_the_last_steps_samples_are_dealt_out_evenly_and_only_fewer_samples_than_ranks_leave_a_rank_none():
    cases = 0
    for n, b, w in itertools.product(SIZES, BATCHES, WORLDS):
        for start in sorted({0, 1, n // 3, n - 1} & set(range(n))):
            real = [int((~pad).sum()) for _, pad in last_batches(n, b, w, start)]
            assert max(real) - min(real) <= 1, (n, b, w, start, real)  # contiguous slices left a rank 2 short
            empty = tuple(rank for rank, count in enumerate(real) if count == 0)
            assert empty == padding_only_ranks(n, b, w, start=start), (n, b, w, start)
            tail = (n - start) % (b * w)
            assert bool(empty) == (0 < tail < w)  # only when the last step has fewer samples than ranks
            cases += 1
    assert cases > 1000


def test_sixteen_samples_in_batches_of_four_on_three_ranks_give_every_rank_a_real_last_sample():
    # The last step holds 4 samples for 3 ranks: 2, 1, 1 (before: 2, 2 and a rank of padding alone).
    order = epoch_order(16, 0, 0, shuffle=False)
    parts = [split_order(order, 4, rank, 3) for rank in range(3)]
    assert [indices[4:].tolist() for indices, _ in parts] == [[12, 13], [14, 0], [15, 1]]
    assert [is_pad[4:].tolist() for _, is_pad in parts] == [[False, False], [False, True], [False, True]]
    assert padding_only_ranks(16, 4, 3) == ()


def test_ten_samples_in_batches_of_three_on_three_ranks_leave_two_ranks_only_padding():
    # The case: one sample for the last step of three ranks; no split can give the other two one.
    assert padding_only_ranks(10, 3, 3) == (1, 2)
    assert [pad.tolist() for _, pad in last_batches(10, 3, 3)] == [[False], [True], [True]]
    assert padding_only_ranks(10, 3, 3, last_batch="drop") == ()  # nothing is padded: the step is dropped
    assert padding_only_ranks(10, 2, 3) == padding_only_ranks(10, 4, 3) == ()
    assert padding_only_ranks(10, 3, 3, start=9) == (1, 2) and padding_only_ranks(10, 3, 3, start=10) == ()


def test_a_weighted_draw_with_repeats_deals_its_last_step_out_the_same_way():
    order = np.array([5, 5, 1, 1, 2, 9, 9, 0], dtype=np.int64)  # 8 draws with repeats: 3 ranks, batches of 2
    parts = [split_order(order, 2, rank, 3) for rank in range(3)]
    assert [indices.tolist() for indices, _ in parts] == [[5, 5, 9], [1, 1, 0], [2, 9, 5]]
    assert [is_pad.tolist() for _, is_pad in parts] == [[False] * 3, [False] * 3, [False, False, True]]
