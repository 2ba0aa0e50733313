"""Shard planning is deterministic and depends on the input alone."""

from __future__ import annotations

import pytest

from converters.base import ConversionError, Item
from converters.planner import auto_shard_size, cut_shards, parse_size, plan_shards


def _items(sizes):
    return [Item(name=f"f{i}", size=s) for i, s in enumerate(sizes)]


def _covers(plans, n):
    assert plans[0].start == 0 and plans[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(plans, plans[1:]))
    assert [p.number for p in plans] == list(range(len(plans)))


@pytest.mark.parametrize("n, per", [(1, 1), (10, 3), (10, 10), (10, 100), (97, 8)])
def test_samples_per_shard_cuts_equal_shards(n, per):
    plans = plan_shards(_items([1] * n), samples_per_shard=per)
    _covers(plans, n)
    assert all(p.count == per for p in plans[:-1]) and 0 < plans[-1].count <= per


def test_shard_size_fills_shards_up_to_the_limit_and_isolates_huge_items():
    plans = plan_shards(_items([40, 40, 40, 500, 10, 10]), shard_size=100)
    _covers(plans, 6)
    assert [(p.start, p.stop) for p in plans] == [(0, 2), (2, 3), (3, 4), (4, 6)]


def test_auto_size_is_bounded_and_plans_are_reproducible():
    assert auto_shard_size(10) == 32 * 1000**2
    assert auto_shard_size(10**13) == 1000**3
    assert auto_shard_size(1000**3) == 1000**3 // 16
    sizes = [(i * 7919) % 100_000 + 1 for i in range(5000)]
    assert plan_shards(_items(sizes)) == plan_shards(_items(sizes))


@pytest.mark.parametrize(
    "text, value", [("1GB", 10**9), ("512MB", 512 * 10**6), ("1.5G", 15 * 10**8), ("2KiB", 2048), ("4096", 4096)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "1XB", "0MB", "-1GB"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(ConversionError):
        parse_size(text)


def test_empty_input_and_conflicting_options_are_refused():
    with pytest.raises(ConversionError, match="no samples"):
        plan_shards([])
    with pytest.raises(ConversionError, match="not both"):
        plan_shards(_items([1]), samples_per_shard=1, shard_size=10)
    with pytest.raises(ConversionError, match="at least 1"):
        plan_shards(_items([1]), samples_per_shard=0)


def test_shards_are_cut_by_count_or_size_whatever_the_input_files():
    # Items of three files (4, 3 and 3 items): shards of the target count or size span them.
    items = _items([10] * 10)
    assert [(p.start, p.stop) for p in plan_shards(items, samples_per_shard=3)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [(p.start, p.stop) for p in plan_shards(items, shard_size=40)] == [(0, 4), (4, 8), (8, 10)]
    assert [(p.start, p.stop) for p in plan_shards(items)] == [(0, 10)]  # one automatic shard


def test_streamed_cutting_keeps_each_shards_first_anchor_and_a_fingerprint_of_its_items():
    items = [Item(name=f"f{i}", size=10, data=("key", i % 3), anchor=100 + i) for i in range(10)]
    plans = list(cut_shards(iter(items), shard_size=40))
    assert [p.anchor for p in plans] == [100, 104, 108]
    assert plans == plan_shards(items, shard_size=40)  # the list planner is the same rule
    # The fingerprint covers names, sizes and what the item is loaded by (a label edited makes another shard).
    edited = items[:5] + [Item(name="f5", size=10, data=("key", 99), anchor=105)] + items[6:]
    other = list(cut_shards(iter(edited), shard_size=40))
    assert [p.fingerprint == q.fingerprint for p, q in zip(plans, other)] == [True, False, True]
