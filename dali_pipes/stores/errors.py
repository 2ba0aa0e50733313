"""The error every shard reader raises, apart so that the readers' helpers can raise it too."""

from __future__ import annotations

from typing import Iterator

__all__ = ["StoreError", "error_chain"]


class StoreError(Exception):
    """A shard that cannot be read: missing, truncated, altered or not of its format.

    The message names the dataset, the shard and, where known, the sample.
    """


def error_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and every error behind it (``__cause__`` and ``__context__``, depth first), each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        todo += [error.__context__, error.__cause__]  # the cause is looked at first
