"""How the example scripts answer a mistake in their flags or data: one line naming the flag, exit status 2.

A wrong path, a folder that is not a converted dataset, a dataset of the wrong
kind, a mixture whose class lists disagree or a batch larger than the data are
the user's to fix, so each script says which flag to change, as argparse says of
a malformed flag, instead of printing a traceback::

    train_imagenet.py: error: shards/train and --mix-with shards/extra have different class lists (...): add --mix-labels offset ...

A one-line answer is kept for the mistakes that are surely the user's: the
scripts' own checks of their flags and data (:class:`UsageError`, made before
anything is built) and the library's refusals of the data, each of its own type
(:data:`DATA_REFUSALS`). :func:`user_errors` catches nothing else: a plain
``ValueError``, ``TypeError`` or ``RuntimeError`` while the spec, the DALI graph
or the loader is built is what DALI, numpy and torch raise for a bug too, and a
bug keeps its traceback (exit status 1). Where a plain error does mean the
user's file (a ``--checkpoint`` torch cannot load), a script catches it around
that one call. The argparse ``type=`` helpers here refuse out-of-range numbers
before anything is opened.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import re
import sys
from typing import Any, Callable, Iterator, Mapping, NoReturn, Sequence

from dali_pipes import Manifest, ManifestError, RemoteError, StoreError, open_store
from dali_pipes.remote.dataset import load_remote_manifest
from dali_pipes.remote.fs import LOOK
from dali_pipes.remote.urls import is_url
from dali_pipes.staging.checked import StageError

logger = logging.getLogger(__name__)

#: argparse's exit status for a usage error; the scripts use it for every mistake in their flags or data.
EXIT_USAGE = 2


#: The library's refusals of the data it was given, each raised on purpose with a message naming the dataset:
#: a path that is no converted dataset or a manifest that cannot be read (``ManifestError``), a shard that cannot
#: be read (``StoreError``), object storage that cannot be used (``RemoteError``), a copy that does not match its
#: manifest (``StageError``). The package's own types, unlike a plain ``ValueError``, which also means a bug.
DATA_REFUSALS: tuple[type[Exception], ...] = (ManifestError, StoreError, RemoteError, StageError)


class UsageError(Exception):
    """A mistake in the flags or in the data they name; the message names the flag to change."""


def fail(message: str, cause: BaseException | None = None) -> NoReturn:
    """Print ``PROG: error: MESSAGE`` on one line, as argparse does for a bad flag, and exit with status 2.

    ``cause``: the error refused, whose traceback is logged at DEBUG (for a user who wants to see where it came from).
    """
    if cause is not None:
        logger.debug("the error behind the one-line answer", exc_info=cause)
    prog = os.path.basename(sys.argv[0]) or "python"  # argparse's default prog, so both errors read alike
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


def say(line: str) -> None:
    """Print ``line`` to stdout in one write, flushed: under torchrun the ranks share one stdout, and ``print``'s
    separate write of the newline lets two ranks' lines run together on one line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


#: The exit status of a run stopped by Ctrl-C, as a shell reports it (128 + SIGINT).
EXIT_INTERRUPTED = 130


@contextlib.contextmanager
def interrupts(note: Callable[[], str | None] = lambda: None) -> Iterator[None]:
    """Inside: Ctrl-C ends the script with one line on stderr, ``PROG: interrupted`` and ``note()`` when it says
    something (where a rerun resumes from), and exit status 130, not a traceback. The loaders opened inside are
    closed on the way out by their own ``with`` or ``finally``; what a run killed harder leaves in a stream cache
    folder (temporaries) the next run removes."""
    try:
        yield
    except KeyboardInterrupt:
        told = note()
        prog = os.path.basename(sys.argv[0]) or "python"
        print(f"{prog}: interrupted{'; ' + told if told else ''}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Inside: a :class:`UsageError` or a refusal of the data (:data:`DATA_REFUSALS`) becomes :func:`fail`'s one line.

    Nothing else is caught. The scripts check their flags (argparse types) and
    the data the flags name (``check_data``, :func:`check_batch`) themselves, so
    a library's argument check refusing what a script passed it is the script's
    bug; and a ``ValueError``, ``TypeError``, ``RuntimeError`` or ``OSError``
    from building the spec, the DALI graph or the loader's workers is a bug
    there. Either keeps its traceback.
    """
    try:
        yield
    except (UsageError, *DATA_REFUSALS) as exc:
        fail(str(exc), cause=exc)


def raised_by(exc: BaseException, function: Callable[..., Any]) -> bool:
    """Whether ``function`` raised ``exc`` itself: its traceback ends in a frame running ``function``.

    So an argument check of the library (``restored_position`` refusing a saved
    state) can be told from an error of the same type raised deeper down (by
    DALI, numpy, torch or another function of the package) that passed through it.
    """
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code is getattr(inspect.unwrap(function), "__code__", None)


def short(exc: BaseException, limit: int = 200) -> str:
    """An exception from outside this package (torch's, say) as a short phrase for a one-line error."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def description(doc: str | None) -> str:
    """The first paragraph of a module docstring as plain text for ``--help`` (no Sphinx roles or literals)."""
    first = (doc or "").strip().split("\n\n")[0]
    # :class:`~dali_pipes.DALILoader` -> DALILoader (the tilde asks for the last part); :mod:`a.b` -> a.b
    first = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m[1].rsplit(".", 1)[-1] if "~" in m[0] else m[1], first)
    return " ".join(first.replace("``", "").split())


def counted(count: int, word: str, plural: str | None = None) -> str:
    """``1 batch``, ``2 batches``: the count and the word in its number (``plural`` for an irregular one)."""
    if count == 1:
        return f"{count} {word}"
    return f"{count} {plural or (word + 'es' if word.endswith(('s', 'x', 'ch', 'sh')) else word + 's')}"


# --- argparse types: a value out of range is a usage error naming the flag, before anything is opened -----------


def _number(convert: Callable[[str], Any], check: Callable[[Any], bool], wanted: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.__name__ = wanted  # argparse names the type in its "invalid ... value" message
    return parse


positive_int = _number(int, lambda v: v >= 1, "a whole number >= 1")
non_negative_int = _number(int, lambda v: v >= 0, "a whole number >= 0")
positive_float = _number(float, lambda v: v > 0 and v != float("inf"), "a number > 0")
non_negative_float = _number(float, lambda v: 0 <= v < float("inf"), "a number >= 0")
probability = _number(float, lambda v: 0 <= v <= 1, "a probability between 0 and 1")


# --- the data the flags name ------------------------------------------------------------------------------------


def dataset_manifest(path: str, flag: str, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest of the dataset that ``flag`` names; a missing or unconverted folder is a usage error naming it.

    A URL's ``index.json`` is read over the network as a quick look (:data:`~dali_pipes.remote.fs.LOOK`: a
    server that does not answer is said within seconds), its shards left where they are: a streamed dataset
    need not fit on this disk. A local path is read through the store, as the loader will read it: a merged
    ``.h5`` file is a dataset too (and so is one at a URL, which the loader copies whole anyway).
    """
    try:
        if is_url(path) and not str(path).endswith(".h5"):
            return load_remote_manifest(str(path), storage_options, LOOK)[0]
        store = open_store(path, storage_options=storage_options)
    except (*DATA_REFUSALS, OSError) as exc:
        raise UsageError(f"{flag}: {exc}") from exc
    try:
        return store.manifest
    finally:
        store.close()


def require_fields(manifest: Manifest, flag: str, path: str, fields: Sequence[str], advice: str) -> None:
    """Refuse a dataset without ``fields`` (the wrong kind for this script), saying what it holds and what to run."""
    missing = [name for name in fields if name not in manifest.fields]
    if missing:
        raise UsageError(
            f"{flag} {path} has no {' or '.join(map(repr, missing))} field (it holds {', '.join(manifest.fields)}): "
            f"{advice}"
        )


def class_difference(ours: Sequence[str], theirs: Sequence[str], first: str, second: str) -> str:
    """Where the class lists of datasets ``first`` and ``second`` first differ, in words."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"class {i} is {a!r} in {first} but {b!r} in {second}"
    return f"{counted(len(ours), 'class')} in {first} but {len(theirs)} in {second}"


def check_device(device: str) -> None:
    """``--device gpu`` where CUDA is not available is the user's to change, not a crash in the loader."""
    import torch

    if device == "gpu" and not torch.cuda.is_available():
        raise UsageError("--device gpu: CUDA is not available here; use --device auto (or cpu)")


def script_loader(args: argparse.Namespace, spec: Any) -> Any:
    """The ``DALILoader`` a script's flags ask for (``dataset``, ``batch_size``, ``seed``, ``device``, ``workers``),
    its batch checked against the epoch (:func:`check_batch`)."""
    from dali_pipes import DALILoader, RunOptions

    loader = DALILoader(
        args.dataset,
        spec,
        batch_size=args.batch_size,
        seed=args.seed,
        run=RunOptions(device=args.device, py_num_workers=args.workers),
    )
    check_batch(loader)
    return loader


def check_batch(loader: Any) -> None:
    """Refuse a ``--batch-size`` whose one step (on every process) holds more samples than an epoch.

    The loader would fill such a batch with repeats of the epoch's samples, so
    every step would train on copies; the largest batch that fits is named.
    """
    world = loader.world.world_size
    samples = loader.epoch_length
    if loader.batch_size * world > samples:
        loader.close()
        if samples < world:
            raise UsageError(f"an epoch holds {counted(samples, 'sample')}, fewer than the {world} processes")
        processes = f" on each of {world} processes" if world > 1 else ""
        raise UsageError(
            f"--batch-size {loader.batch_size}{processes} is more than the {counted(samples, 'sample')} of an epoch; "
            f"use --batch-size {samples // world} or less"
        )
