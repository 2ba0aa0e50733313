"""A dataset folder's names (its manifest, the job folder of an unfinished conversion), and what to say
when a folder given as a dataset has no manifest: missing, unfinished, or foreign packed files.

:mod:`dali_pipes.dataset.manifest` re-exports the names; the message is advice, kept apart from the contract.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The manifest of a dataset folder, written last: a folder with one is a complete dataset.
MANIFEST_NAME = "index.json"
#: The folder an unfinished conversion keeps its job record and finished-shard records in.
JOB_DIR = ".dali-pipes-job"


def no_manifest_message(folder: Path) -> str:
    """Why ``folder`` is not a dataset, and what to do: it is missing, unfinished, or not ours."""
    if not folder.exists():
        return f"{folder}: no such folder, so no {MANIFEST_NAME}; give the folder of a dataset written by 'dali-pipes convert'"
    if not folder.is_dir():
        return f"{folder}: not a folder; give the folder of a dataset written by 'dali-pipes convert'"
    if (folder / JOB_DIR).is_dir():
        return (
            f"{folder}: no {MANIFEST_NAME} here yet: a conversion into this folder did not finish; run the same "
            "'dali-pipes convert' command again to complete it (it resumes)"
        )
    packed = _packed_input_commands(folder)
    if packed:
        return (
            f"{folder}: no {MANIFEST_NAME} here, so this is not a dataset written by 'dali-pipes convert'; "
            f"it holds {' and '.join(what for what, _ in packed)}, converted first with: "
            + "; ".join(command for _, command in packed)
        )
    return (
        f"{folder}: no {MANIFEST_NAME} here, so this is not a dataset written by 'dali-pipes convert'; image "
        "folders, COCO annotations, list files and arrays from elsewhere are converted first: "
        "dali-pipes convert {imagefolder,coco,list,arrays} ... (see dali-pipes convert --help); so are "
        "WebDataset tars, TFRecord files, Parquet files and LMDBs (webdataset, tfrecord, parquet, lmdb)"
    )


#: Foreign packed datasets told apart by their file names: (what, a name regex, the glob to give, the source).
_PACKED_INPUTS = (
    ("WebDataset tar shards", r".*\.tar", "*.tar", "webdataset"),
    ("Parquet files", r".*\.parquet", "*.parquet", "parquet"),
    ("TFRecord files", r".*\.tfrecords?", "*.tfrecord*", "tfrecord"),
    ("TFRecord files", r".*-of-\d+", "*-of-*", "tfrecord"),  # TensorFlow's train-00000-of-01024
    ("an LMDB", r"data\.mdb", "", "lmdb"),
)
#: Entries of a folder looked at for foreign inputs: a huge image folder is not listed whole for an error message.
_LOOK_AT = 10_000


def _packed_input_commands(folder: Path) -> list[tuple[str, str]]:
    """``(what, command)`` for each kind of foreign packed dataset whose files lie in ``folder`` (by name only)."""
    names = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                names.append(entry.name)
                if len(names) >= _LOOK_AT:
                    break
    except OSError:
        return []
    found: dict[str, tuple[str, str]] = {}
    for what, name_re, pattern, kind in _PACKED_INPUTS:
        if kind in found or not any(re.fullmatch(name_re, name) for name in names):
            continue
        given = f"'{folder / pattern}'" if pattern else str(folder)
        found[kind] = (what, f"dali-pipes convert {kind} {given} OUT")
    return list(found.values())
