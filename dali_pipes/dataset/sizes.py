"""Sizes as people write them: ``40GiB``, ``10GB``, ``512MB``, ``1.5G``, ``4096``; one reading for every flag and option.

Decimal units are powers of 1000 (``GB``: 10**9 bytes, what a disk's label and
``df -H`` say), binary ones powers of 1024 (``GiB``: 2**30, what ``40 << 30``
is). The ``B`` is optional and case does not matter (``10g`` is ``10GB``). A bare
number is in ``bare_unit``: bytes for a Python option, GB for a command-line flag
(:func:`size_flag`: ``--stream-cache 40`` and ``--cache-limit 40`` are both 40 GB).
"""

from __future__ import annotations

import argparse
import math
import numbers
import re
from typing import Callable, NamedTuple

__all__ = ["GivenSize", "SizeError", "format_size", "parse_size", "size_flag", "unit_of"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
#: The factor of each unit, keyed by its lower-case spelling without the trailing ``b``.
_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "p": 1000**5,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
    "pi": 1024**5,
}
#: How each unit is written back (``format_size``).
_SPELLED = {key: (key.upper()[:1] + key[1:] + "B" if key else "B") for key in _UNITS}


class SizeError(ValueError):
    """A size that cannot be read, or one that is not positive; the message shows how to write one."""


def _factor(unit: str, text: str) -> int:
    key = _unit_key(unit)
    if key not in _UNITS:
        raise SizeError(f"unknown size unit in {text!r}; use B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB")
    return _UNITS[key]


def parse_size(text: str | int | float, *, bare_unit: str = "B") -> int:
    """The whole number of bytes that ``text`` says: ``"40GiB"`` -> ``42949672960``, ``"10GB"`` -> ``10**10``.

    A number (``int`` or ``float``) or a string without a unit is in ``bare_unit``
    (``"B"`` by default; ``"GB"`` reads ``"40"`` as 40 GB). A fraction of a byte
    is rounded down. Raises :class:`SizeError` (a ``ValueError``) for text that is
    no size, an unknown unit, or a size below one byte.
    """
    if isinstance(text, bool) or not isinstance(text, (str, numbers.Real)):
        raise SizeError(f"a size is a number of bytes or a string such as '40GiB' or '10GB', got {text!r}")
    if isinstance(text, str):
        match = _SIZE_RE.match(text)
        if not match:
            raise SizeError(f"cannot read the size {text!r}; write it like 512MB, 10GB or 40GiB")
        number, unit = float(match[1]), match[2]
    else:
        number, unit = float(text), ""
    factor = _factor(unit or bare_unit, str(text))
    if isinstance(text, str) and not unit and factor == 1 and number != int(number):  # "0.004": GB meant?
        meant = int(number * _UNITS["g"])
        raise SizeError(f"the size {text!r} needs a unit: write {_decimal(meant)} or {meant}")
    if not math.isfinite(number) or number * factor < 1:
        raise SizeError(f"the size {text!r} must be at least one byte")
    if isinstance(text, numbers.Integral):
        return int(text) * factor  # exact for large whole numbers, which a float would round
    return int(number * factor)


def format_size(size: int, unit: str = "GB", *, up: bool = False) -> str:
    """``size`` bytes in ``unit`` as a user would type it back: ``format_size(14_000_000, "GB")`` -> ``"0.014GB"``.

    Three significant digits at least; ``up``: rounded up rather than to the nearest, for a
    least size (so that what is printed is enough)."""
    factor = _factor(unit, unit)
    value = size / factor
    digits = max(0, 3 - int(math.floor(math.log10(value))) - 1) if value > 0 else 0
    scale = 10**digits
    value = (math.ceil(value * scale - 1e-9) if up else round(value * scale)) / scale
    shown = f"{value:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{value:.0f}"
    return f"{shown}{_SPELLED[_unit_key(unit)]}"


def _decimal(size: int) -> str:
    """``size`` bytes in the largest decimal unit it fills at least once (``4_000_000`` -> ``"4MB"``)."""
    unit = next((key for key in ("p", "t", "g", "m", "k") if size >= _UNITS[key]), "")
    return format_size(size, _SPELLED[unit])


def _unit_key(unit: str) -> str:
    key = unit.lower()
    return key[:-1] if key.endswith("b") else key


def unit_of(text: str | int | float, bare_unit: str = "B") -> str:
    """The unit ``text`` is written in, spelled as :func:`format_size` writes it (``"10g"`` -> ``"GB"``), so that an
    answer about a size can be in the user's own unit; ``bare_unit`` for a number without one."""
    match = _SIZE_RE.match(text) if isinstance(text, str) else None
    key = _unit_key((match[2] if match else "") or bare_unit)
    return _SPELLED.get(key, "B")


class GivenSize(NamedTuple):
    """A size flag's value: its bytes, and the unit the user wrote it in (so an answer about it uses that unit)."""

    bytes: int
    unit: str


def size_flag(bare_unit: str = "GB") -> Callable[[str], GivenSize]:
    """An argparse type for a size such as ``40GiB``, ``10GB`` or ``512MB``; a bare number is in ``bare_unit``
    (GB for every command-line flag of the package, so that one number means one size everywhere)."""

    def parse(text: str) -> GivenSize:
        try:
            return GivenSize(parse_size(text, bare_unit=bare_unit), unit_of(text, bare_unit))
        except SizeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "size"  # argparse names the type in its "invalid ... value" message
    return parse
