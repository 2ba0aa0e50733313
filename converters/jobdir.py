"""The conversion job's folder: claiming the output, the lock, each finished shard's record, and cleaning up.

A job writes into ``out``: shards under a temporary name (:data:`TMP_SUFFIX`),
renamed into place when complete, and for each finished shard a
:class:`ShardRecord` in ``out/_job`` (``JOB_DIR``), so that a re-run of the same
command (same :func:`job_digest`) resumes where the last one stopped.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from converters.base import ConversionError, Item, Source
from converters.planner import ShardPlan
from dali_pipes.dataset.fileio import atomic_write_bytes
from dali_pipes.dataset.manifest import (
    ERRORS_NAME,
    JOB_DIR,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    Shard,
    load_manifest,
)
from dali_pipes.dataset.sample_order import SOURCE_ORDER, SampleOrder

LOCK_NAME = ".dali-pipes.lock"
#: Appended to a shard's name while it is written.
TMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class ShardRecord(Shard):
    """One finished shard, as recorded in the job folder: its manifest entry (:meth:`shard`) and the inputs left
    out of it."""

    #: The inputs left out of this shard (``--on-error skip``): ``input``, ``reason``, ``shard``.
    errors: list[dict[str, str]] = field(default_factory=list)

    @property
    def inputs_done(self) -> int:
        """Inputs this shard accounted for: its samples and the inputs left out (not the parts of kept inputs
        that were left out, such as a degenerate COCO polygon: their input is one of the samples)."""
        return self.num_samples + sum(1 for error in self.errors if not error.get("part"))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ShardRecord":
        return cls(
            path=data["path"],
            num_samples=data["num_samples"],
            bytes=data["bytes"],
            sha256=data["sha256"],
            index_path=data.get("index_path"),
            index_sha256=data.get("index_sha256"),
            errors=list(data["errors"]),
        )

    def shard(self) -> Shard:
        """The manifest's entry for this shard: the record without its errors."""
        return Shard(**{entry.name: getattr(self, entry.name) for entry in dataclasses.fields(Shard)})


def shard_name(number: int, suffix: str) -> str:
    """The file name of shard ``number``: ``shard-00042.lmdb``."""
    return f"shard-{number:05d}{suffix}"


def remove_paths(paths: Iterable[Path]) -> None:
    """Delete each of ``paths``, a file or a folder; one already gone is fine."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def job_digest(source: Source, fmt: str, plans: Sequence[ShardPlan], identity: Mapping[str, Any] | None = None) -> str:
    """A hash of everything that determines the output bytes, to recognise the same job on a re-run.

    The shards' fingerprints stand for the items (their names and sizes), so the digest needs no pass of its own.
    ``identity``: what else decides the output (:attr:`~converters.input_plan.InputPlan.identity`: a shuffled
    order and the input's fingerprint); none keeps the digest a job in the source's order always had.
    """
    header = {
        "format": fmt,
        "source": source.recorded(),
        "shards": [[p.start, p.stop, p.fingerprint] for p in plans],
        **(identity or {}),
    }
    return hashlib.sha256(json.dumps(header, sort_keys=True, default=str).encode()).hexdigest()


def legacy_job_digest(source: Source, fmt: str, items: Iterable[Item], plans: Sequence[ShardPlan]) -> str:
    """The digest that versions before streamed planning wrote into a finished manifest (the items hashed after the plan), so
    that a dataset they finished is still recognised as this job's instead of refused as another dataset."""
    digest = hashlib.sha256()
    header = {"format": fmt, "source": source.describe(), "shards": [[p.start, p.stop] for p in plans]}
    digest.update(json.dumps(header, sort_keys=True, default=str).encode())
    for item in items:
        digest.update(f"{item.name}\0{item.size}\n".encode())
    return digest.hexdigest()


def finished_dataset(
    out: Path, digest: str, legacy: Callable[[], str] | None = None, order: SampleOrder | None = None
) -> Manifest | None:
    """The manifest of ``out`` when it is a complete conversion of this very job.

    ``legacy`` computes the digest an older version would have written for this job (one more pass over the
    input, so only asked when the manifest's digest is not ``digest``). ``order``: the job's; a dataset written
    in another is refused saying so.
    """
    if not (out / MANIFEST_NAME).exists():
        return None
    try:
        manifest = load_manifest(out)
    except ManifestError as exc:
        raise ConversionError(
            f"{out} already holds a dataset whose manifest cannot be read ({exc}); choose another output folder"
        ) from exc
    recorded = manifest.source.get("job")
    if recorded != digest and (legacy is None or recorded != legacy()):
        written = manifest.order or SOURCE_ORDER  # a manifest without an order: the source's, as all were then
        hint = "" if order in (None, written) else f" (written {written.describe()}, not {order.describe()}: --order)"
        raise ConversionError(
            f"{out} already holds a different dataset{hint}; choose another output folder or delete this one"
        )
    return manifest


def make_output(out: Path) -> bool:
    """Make the output folder; whether this job created it. A file in its place is a one-line error."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConversionError(
            f"{out}: the output must be a folder, but this path (or a folder above it) is a file; "
            "choose another output folder"
        ) from None
    return created


def refuse_output_inside_input(source: Source, out: Path) -> None:
    """An output inside a folder the source reads would be read as input by the next conversion."""
    target = out.resolve()
    for folder in source.input_folders():
        folder = folder.resolve()
        if target == folder or folder in target.parents:
            raise ConversionError(
                f"{out}: the output folder is inside the input folder {folder}, so the next conversion of that "
                "input would read it as input too (a new class, for an image folder); write it elsewhere"
            )


def claim_output(out: Path, digest: str, source: Source, fmt: str, created: bool) -> None:
    """Make ``out`` this job's folder, or refuse when it holds anything else."""
    job_file = out / JOB_DIR / "job.json"
    if job_file.exists():
        try:
            previous = json.loads(job_file.read_text())
        except (OSError, json.JSONDecodeError):
            previous = {}
        if previous.get("digest") != digest:
            raise ConversionError(
                f"{out} holds an unfinished conversion of a different input, with other options or by "
                "another version of dali-pipes; re-run that command to finish it, or choose another output folder"
            )
        return
    others = [p.name for p in out.iterdir() if p.name not in (JOB_DIR, LOCK_NAME)]
    if others:
        raise ConversionError(
            f"{out} exists and is not empty ({', '.join(sorted(others)[:3])}...); choose a new or empty output folder"
        )
    (out / JOB_DIR).mkdir(exist_ok=True)
    record = {"digest": digest, "format": fmt, "source": source.recorded(), "created_output": created}
    atomic_write_bytes(job_file, json.dumps(record, indent=1, default=str).encode())


class OutputLock:
    """An exclusive lock on the output folder: two conversions into one folder refuse to run at once."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK_NAME
        self.fd: int | None = None

    def __enter__(self) -> "OutputLock":
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise ConversionError(
                f"another conversion is writing into {self.path.parent} right now; wait for it to finish"
            ) from None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


def tidy_finished(out: Path) -> None:
    """Remove the job folder and lock file that a run killed after writing its manifest left in ``out``.

    The manifest is written last but one: a kill between it and the job folder's
    removal leaves a complete dataset with its scaffolding, which a re-run (that
    finds the dataset complete) clears. A conversion holding the lock is left alone.
    """
    if not (out / JOB_DIR).exists() and not (out / LOCK_NAME).exists():
        return
    try:
        with OutputLock(out):
            shutil.rmtree(out / JOB_DIR, ignore_errors=True)
    except (ConversionError, OSError):
        pass  # another run holds the folder (it clears up after itself), or the folder is not ours to write


def remove_temporaries(out: Path) -> None:
    """Delete shard files a killed run left half-written."""
    remove_paths(out.glob(f"shard-*{TMP_SUFFIX}*"))


def done_record(
    out: Path, plan: ShardPlan, suffix: str, remote: Callable[[ShardRecord], bool] | None = None
) -> ShardRecord | None:
    """The recorded result of a shard finished by an earlier run, if its files are intact (or, its local
    files gone, when ``remote(record)`` says its upload is whole: :mod:`converters.upload`)."""
    record_file = _record_file(out, plan.number)
    if not record_file.exists():
        return None
    try:
        record = ShardRecord.from_json(json.loads(record_file.read_text()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None  # unreadable: the shard is written again
    shard_file = out / record.path
    if not shard_file.exists() and remote is not None:
        return record if remote(record) else None
    if not shard_file.exists() or shard_file.stat().st_size != record.bytes:
        return None
    if record.index_path and not (out / record.index_path).exists():
        return None
    return record


def save_record(out: Path, number: int, record: ShardRecord) -> None:
    """Record shard ``number`` as done (after its files are renamed into place), for a resumed run."""
    atomic_write_bytes(_record_file(out, number), json.dumps(record.to_json()).encode())


def _record_file(out: Path, number: int) -> Path:
    return out / JOB_DIR / f"{shard_name(number, '')}.json"


def discard_job(out: Path, created: bool) -> None:
    """Remove everything this job wrote (after ``--on-error fail``, or a result refused): the output folder too
    when this run or an earlier run of the same job (its ``job.json`` says) created it; else it stays, emptied."""
    created = created or _created_by_job(out)
    remove_paths(out.glob("shard-*"))
    shutil.rmtree(out / JOB_DIR, ignore_errors=True)
    (out / LOCK_NAME).unlink(missing_ok=True)
    if created:
        try:
            out.rmdir()
        except OSError:
            pass


def _created_by_job(out: Path) -> bool:
    """Whether the job recorded in ``out`` made the folder (a resumed run finds it there, yet it is the job's)."""
    try:
        return bool(json.loads((out / JOB_DIR / "job.json").read_text()).get("created_output"))
    except (OSError, ValueError, AttributeError):
        return False  # no readable record: keep the folder, the safe side


def read_errors(out: Path) -> list[dict[str, str]]:
    """The inputs left out of a finished dataset (its ``errors.jsonl``)."""
    path = out / ERRORS_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
