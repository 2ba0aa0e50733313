"""Class names as a name-to-index map, refused where two classes share a name (a dict would merge them)."""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["unique_name_index"]


def unique_name_index(
    names: Iterable[Any], where: str, *, what: str = "label", first: int = 0, blank_ok: bool = False
) -> dict[str, int]:
    """``{name: position}`` of ``names``; ValueError naming each name that repeats, with its positions.

    A dict keeps one index a name: two classes of one name (ImageNet's two ``'crane'``\\ s)
    would silently become one. ``where`` starts the message; ``what`` names a position
    (``"label"``, ``"line"``), counted from ``first``. ``blank_ok``: an empty name may
    repeat (a class map's blank lines, which name no class), keeping its last position.
    """
    positions: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        positions.setdefault(str(name), []).append(index)
    repeated = {name: at for name, at in positions.items() if len(at) > 1 and (name or not blank_ok)}
    if repeated:
        shown = "; ".join(
            f"{name!r} at {what}s {', '.join(str(i + first) for i in at)}" for name, at in list(repeated.items())[:5]
        ) + ("; ..." if len(repeated) > 5 else "")
        raise ValueError(
            f"{where}: {len(repeated)} class name(s) repeat ({shown}); a name-to-index map would give each of "
            "them one index for several classes: make the names unique (e.g. 'crane (bird)', 'crane (machine)')"
        )
    return {name: at[-1] for name, at in positions.items()}
