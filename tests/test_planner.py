"""Shard planning is deterministic and depends on the input alone."""

from __future__ import annotations

import pytest

from converters.base import ConversionError, Item
from converters.planner import auto_shard_size, parse_size, plan_shards


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


def test_shards_never_span_an_input_file():
    items = _items([10] * 10)
    # Files of 4, 3 and 3 small items: by default one shard each; by count or size, cut within each file.
    assert [(p.start, p.stop) for p in plan_shards(items, boundaries=[4, 7])] == [(0, 4), (4, 7), (7, 10)]
    by_count = plan_shards(items, samples_per_shard=3, boundaries=[4, 7])
    assert [(p.start, p.stop) for p in by_count] == [(0, 3), (3, 4), (4, 7), (7, 10)]
    by_size = plan_shards(items, shard_size=20, boundaries=[4, 7])
    assert [(p.start, p.stop) for p in by_size] == [(0, 2), (2, 4), (4, 6), (6, 7), (7, 9), (9, 10)]
    assert [p.number for p in by_size] == list(range(6))
    # An empty input file (a repeated boundary) and out-of-range ones add no shard.
    assert len(plan_shards(items, boundaries=[0, 4, 4, 10, 12])) == 2


def test_a_large_input_file_is_cut_by_the_automatic_size():
    # One 2 GB file and a small one, no count or size given: the big file is spread over several shards
    # (it was one shard, written by one core), and still no shard spans the two files.
    items = _items([50 * 1000**2] * 40)
    plan = plan_shards(items, boundaries=[38])
    auto = auto_shard_size(sum(item.size for item in items))
    assert [(p.start, p.stop) for p in plan] == [(a, a + 2) for a in range(0, 38, 2)] + [(38, 40)]
    assert all(sum(item.size for item in items[p.start : p.stop]) <= auto for p in plan)
