"""One staged file: what it must be (size, SHA-256), and how it is written so that only a whole one is kept.

Shared by the local copy (:mod:`dali_pipes.staging.stage`) and the download from object storage
(:mod:`dali_pipes.staging.remote`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dali_pipes.dataset.fileio import fsync_dir

#: Prefix of the temporary names of files being copied (removed by the next stager).
TMP_PREFIX = ".dali-pipes-staging-"


class StageError(ValueError):
    """A dataset that cannot be staged: a source that does not match its manifest, a full disk, a bad DEST."""


@dataclass(frozen=True)
class StageItem:
    """One file to stage: its path relative to DEST, its source, size and expected SHA-256 (if recorded)."""

    rel: str
    source: Path | str  # a local path, or the path of an object within its remote filesystem
    bytes: int
    sha256: str | None


class MismatchError(StageError):
    """What was copied is not what the manifest says (its size or SHA-256): damaged at the source, or on the way."""


def write_checked(item: StageItem, target: Path, fill: Callable[[Any], tuple[int, str]], shown: str) -> None:
    """Write ``target`` through a temporary name: ``fill(file)`` writes the bytes and returns ``(size, sha256)``,
    which must match the item before the rename. ``shown`` names the source in errors."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{TMP_PREFIX}{target.name}-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as out:
            size, digest = fill(out)
            out.flush()
            os.fsync(out.fileno())
        if size != item.bytes:
            raise MismatchError(
                f"{shown}: is {size if size < item.bytes else f'more than {item.bytes}'} bytes, the manifest says {item.bytes}: the source changed or is damaged "
                "(truncated or replaced); run 'dali-pipes verify' on it"
            )
        if item.sha256 is not None and digest != item.sha256:
            raise MismatchError(
                f"{shown}: SHA-256 does not match the manifest: the source shard is damaged or was replaced; "
                "run 'dali-pipes verify' on it and re-convert"
            )
        os.replace(tmp, target)
    except OSError as exc:
        raise StageError(f"{target}: cannot stage {shown} ({exc})") from exc
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)


__all__ = ["TMP_PREFIX", "MismatchError", "StageError", "StageItem", "write_checked"]
