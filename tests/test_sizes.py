"""Sizes as people write them (``40GiB``, ``10GB``), read by one parser for every flag and option (issue 54, item 12)."""

from __future__ import annotations

import pytest

from dali_pipes import StreamOptions
from dali_pipes.dataset.sizes import SizeError, format_size, parse_size, unit_of
from dali_pipes.examples.train_imagenet import parse_args


@pytest.mark.parametrize(
    "text, value",
    [
        ("40GiB", 40 << 30),
        ("10GB", 10 * 10**9),
        ("10g", 10 * 10**9),
        ("512 MiB", 512 << 20),
        ("1.5G", 15 * 10**8),
        ("4096", 4096),
        ("2kb", 2000),
        (4096, 4096),
    ],
)
def test_sizes_read_as_written(text, value):
    assert parse_size(text) == value


def test_a_bare_number_is_in_the_callers_unit():
    assert parse_size("40", bare_unit="GB") == 40 * 10**9
    assert parse_size("0.004", bare_unit="GB") == 4 * 10**6
    assert parse_size("40GiB", bare_unit="GB") == 40 << 30  # a written unit wins
    assert unit_of("0.004", "GB") == "GB" and unit_of("40gib", "GB") == "GiB" and unit_of("10m") == "MB"


@pytest.mark.parametrize("text", ["", "lots", "1XB", "0MB", "-1GB", "0.1", "inf", True, None])
def test_what_is_no_size_is_refused_with_how_to_write_one(text):
    with pytest.raises(SizeError, match="size|unit|byte"):
        parse_size(text)


def test_a_least_size_is_printed_rounded_up_in_the_unit_asked_for():
    assert format_size(13_762_560, "GB", up=True) == "0.0138GB"
    assert parse_size(format_size(13_762_560, "GB", up=True)) >= 13_762_560
    assert format_size(40 << 30, "GiB") == "40GiB"
    assert format_size(10**12, "GB") == "1000GB"


def test_stream_options_take_a_size_and_agree_with_the_readme_bytes():
    assert StreamOptions(cache_limit="40GiB").cache_limit == 40 << 30 == StreamOptions(cache_limit=40 << 30).cache_limit
    assert StreamOptions(cache_limit="10GB").cache_limit == 10**10
    with pytest.raises(ValueError, match=r"StreamOptions.cache_limit: cannot read the size 'ten'"):
        StreamOptions(cache_limit="ten")


def test_the_examples_stream_cache_takes_units_and_keeps_a_bare_number_in_gb(capsys):
    assert parse_args(["ds", "--stream-cache", "10GB"]).stream_cache.bytes == 10**10
    assert parse_args(["ds", "--stream-cache", "40GiB"]).stream_cache == (40 << 30, "GiB")
    assert parse_args(["ds", "--stream-cache", "0.004"]).stream_cache == (4 * 10**6, "GB")  # as before: GB
    with pytest.raises(SystemExit):
        parse_args(["ds", "--stream-cache", "10XB"])
    assert "--stream-cache: unknown size unit in '10XB'" in capsys.readouterr().err


def test_a_bare_number_on_the_command_line_is_gb_for_every_size_flag():
    from dali_pipes.cli.command import build_parser

    mixing = build_parser().parse_args(["mixing", "ds", "--cache-limit", "40"]).cache_limit
    assert mixing == parse_args(["ds", "--stream-cache", "40"]).stream_cache == (40 * 10**9, "GB")
    assert build_parser().parse_args(["mixing", "ds", "--cache-limit", "4MiB"]).cache_limit == (4 << 20, "MiB")


def test_a_python_size_string_without_a_unit_and_below_a_byte_asks_for_one():
    with pytest.raises(ValueError, match=r"the size '0.004' needs a unit: write 4MB or 4000000$"):
        StreamOptions(cache_limit="0.004")
    with pytest.raises(SizeError, match=r"the size '1.5' needs a unit: write 1.5GB or 1500000000$"):
        parse_size("1.5")
