"""Counts in the command's output: ``1 sample``, ``2 samples``, never ``1 samples``."""

from __future__ import annotations


def counted(count: int, word: str, plural: str | None = None) -> str:
    """``count`` (with thousands separators) and ``word`` in its number; ``plural`` for an irregular one."""
    if count == 1:
        return f"{count:,} {word}"
    return f"{count:,} {plural or (word + 'es' if word.endswith(('s', 'x', 'ch', 'sh')) else word + 's')}"
