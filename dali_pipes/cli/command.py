"""The ``dali-pipes`` command: convert, inspect, verify, merge, stage, mixing, synth and the benchmarks.

Each subcommand parses its arguments here (the measuring ones in :mod:`dali_pipes.cli.measure`)
and calls one library function; the work lives in the library. Errors a user can fix are printed as one line
(``dali-pipes: error: ...``) with a non-zero exit, never as a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from dali_pipes.cli.exit_codes import EXIT_ERROR, EXIT_FAILED
from dali_pipes.cli.measure import add_bench, add_bench_convert, add_doctor, add_selftest, add_tune, named
from dali_pipes.cli.mixing import add_mixing
from dali_pipes.cli.remote_args import (
    add_output_url_options,
    add_storage_options,
    convert_to_url_from_args,
    dataset_arg,
    quiet_backends,
    reading_inputs,
    shown,
    storage_options,
)
from dali_pipes.cli.synth import add_synth
from dali_pipes.cli.words import counted
from dali_pipes.dataset.manifest import FORMATS, ManifestError
from dali_pipes.remote.urls import is_url, join, redact_log_lines

log = logging.getLogger("dali_pipes.cli")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dali-pipes`` console script."""
    try:
        parser = build_parser()  # imports most of the package: a Ctrl-C often lands here
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        code = _interrupted()
        if argv is None:  # the command itself, interrupted while importing: nothing ran, nothing to clean up
            # Exit now: the interpreter's teardown met a library imported part-way (h5py printed a traceback from
            # its objects' dealloc once, in CI).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s" if args.verbose else "%(message)s",
        stream=sys.stderr,
    )
    quiet_backends(args.verbose)
    redact_log_lines()
    if not hasattr(args, "handler"):
        parser.print_help()
        return EXIT_ERROR
    return _run(args.handler, args)


def _run(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    from converters.base import ConversionError, SampleError
    from dali_pipes.stores import StoreError

    try:
        with reading_inputs(args):
            return handler(args)
    except SampleError as exc:
        print(
            shown(f"dali-pipes: error: {exc.name}: {exc.reason} (nothing was kept; use --on-error skip to leave such "
                  "inputs out)"),
            file=sys.stderr,
        )  # fmt: skip
    # RemoteError and StageError are ValueErrors: one line naming the URL or file and what to do.
    except (ConversionError, ManifestError, StoreError, FileNotFoundError, NotADirectoryError, ValueError) as exc:
        print(shown(f"dali-pipes: error: {exc}"), file=sys.stderr)
    except KeyboardInterrupt:
        return _interrupted()
    return EXIT_ERROR


def _interrupted() -> int:
    """Ctrl-C: one line, no traceback, and the shell's status for it (128 + SIGINT)."""
    print("dali-pipes: interrupted; run the same command again to continue where it stopped", file=sys.stderr)
    return 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="dali-pipes",
        description="Convert training sets into LMDB/HDF5/TFRecord shards and feed them to PyTorch through NVIDIA DALI.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more detail")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_convert(commands)
    _add_inspect(commands)
    _add_verify(commands)
    _add_merge(commands)
    _add_stage(commands)
    add_mixing(commands)
    add_synth(commands)
    add_bench_convert(commands)
    _add_demo(commands)
    _add_show(commands)
    add_bench(commands)
    add_tune(commands)
    add_doctor(commands)
    add_selftest(commands)
    return parser


def _version() -> str:
    from dali_pipes._version import __version__

    return __version__


# --- convert ------------------------------------------------------------------------------


def _add_convert(commands) -> None:
    convert = commands.add_parser("convert", help="convert a training set into shards with one manifest")
    kinds = convert.add_subparsers(title="input kinds", metavar="KIND", required=True)

    # Inputs are str, not Path: a URL (s3://bucket/train) must reach the source as written (Path folds its "//").
    p = kinds.add_parser("imagefolder", help="ImageNet-style ROOT/CLASS/IMAGE folders")
    p.add_argument("root", help="folder of class folders, or a URL of one (s3://bucket/train)")
    p.add_argument(
        "--allow-empty-classes",
        action="store_true",
        help="keep a class folder that yields no image as a class without samples (default: refuse it, naming it)",
    )
    _add_output_options(p, images=True)
    p.set_defaults(handler=_convert_imagefolder)

    p = kinds.add_parser("list", help="a list file of 'KEY PATH [LABEL]' lines")
    p.add_argument("list_file", help="the list (.scp, .txt), or its URL; paths are relative to its folder or absolute")
    p.add_argument(
        "--columns",
        choices=("key path label", "key path", "path label", "path"),
        help="what the columns are (default: 3 columns are KEY PATH LABEL; for 2 columns, "
        "PATH LABEL when every second column is an integer, KEY PATH when none is)",
    )
    _add_output_options(p, images=True)
    p.set_defaults(handler=_convert_list)

    p = kinds.add_parser("coco", help="COCO instances JSON plus its image folder")
    p.add_argument("--images", required=True, help="the image folder")
    p.add_argument("--annotations", required=True, help="instances JSON (e.g. instances_train2017.json)")
    p.add_argument(
        "--masks",
        action="store_true",
        help="also store each annotation's segmentation as an instance mask (needs pycocotools: pip install "
        "'dali-pipes[coco]'); an image with a bad segmentation is left out and listed in errors.jsonl",
    )
    _add_output_options(p, images=True)
    p.set_defaults(handler=_convert_coco)

    p = kinds.add_parser("arrays", help="feature arrays from .npy, .npz or HDF5 files")
    p.add_argument("files", type=dataset_arg, nargs="+", help="input files, then the output folder last")
    p.add_argument("--fields", help="comma-separated field names to keep (default: all)")
    _add_output_options(p, images=False, positional_out=False)
    p.set_defaults(handler=_convert_arrays)

    # Packed inputs (WebDataset, TFRecord, Parquet, LMDB): each module declares its own arguments.
    import importlib

    from converters.sources import PACKED_SOURCE_MODULES

    for name in PACKED_SOURCE_MODULES:
        module = importlib.import_module(name)
        p = kinds.add_parser(module.KIND, help=module.HELP)
        module.add_arguments(p)
        _add_output_options(p, images=True, positional_out=False)
        p.set_defaults(handler=_convert_packed, source_from_args=module.from_args)


def _add_output_options(p: argparse.ArgumentParser, *, images: bool, positional_out: bool = True) -> None:
    if positional_out:
        p.add_argument("out", type=dataset_arg, help="output dataset folder (created), or a URL (s3://bucket/ds)")
    p.add_argument("--format", default="lmdb", help=f"shard format: {', '.join(FORMATS)} (default: lmdb)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--samples-per-shard", type=int, metavar="N", help="samples in each shard")
    size.add_argument(
        "--shard-size",
        metavar="SIZE",
        help="input bytes per shard, like 1GB or 512MB (default: 1GB, less for small sets)",
    )
    p.add_argument("--workers", type=int, metavar="K", help="writer processes (default: all cores)")
    p.add_argument(
        "--engine",
        choices=("local", "dask"),
        default="local",
        help="where shards are written: local processes, or a Dask cluster (needs dali-pipes[dask]) (default: local)",
    )
    p.add_argument(
        "--scheduler", metavar="ADDRESS", help="the Dask scheduler, e.g. tcp://10.0.0.1:8786 (with --engine dask)"
    )
    p.add_argument(
        "--on-error",
        choices=("skip", "fail"),
        default="skip",
        help="bad inputs: leave out and list (skip) or stop (fail)",
    )
    p.add_argument(
        "--order",
        choices=("auto", "shuffled", "source"),
        default="auto",
        help="sample order: shuffled (seeded), or the source's; auto: shuffled for class-ordered inputs (image "
        "folders, list files with labels), else the source's (default: auto)",
    )
    p.add_argument("--order-seed", type=int, default=0, metavar="S", help="the shuffled order's seed (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_output_url_options(p)
    if images:
        p.add_argument(
            "--max-size", type=int, metavar="PX", help="resize images whose longest side is larger (re-encodes as JPEG)"
        )
        p.add_argument("--quality", type=int, default=90, metavar="Q", help="JPEG quality when resizing (default: 90)")


def _image_options(args):
    from converters.base import ConversionError, ImageOptions

    if args.max_size is not None and args.max_size < 1:
        raise ConversionError(f"--max-size must be a positive number of pixels, got {args.max_size}")
    if not 1 <= args.quality <= 100:
        raise ConversionError(f"--quality must be between 1 and 100, got {args.quality}")
    return ImageOptions(max_size=args.max_size, quality=args.quality)


def _convert_imagefolder(args) -> int:
    from converters.sources import ImageFolderSource

    source = ImageFolderSource(args.root, _image_options(args), allow_empty_classes=args.allow_empty_classes)
    return _convert(source, args.out, args)


def _convert_list(args) -> int:
    from converters.sources import ListFileSource

    return _convert(ListFileSource(args.list_file, _image_options(args), columns=args.columns), args.out, args)


def _convert_coco(args) -> int:
    from converters.sources import CocoSource

    return _convert(CocoSource(args.images, args.annotations, _image_options(args), masks=args.masks), args.out, args)


def _convert_arrays(args) -> int:
    from converters.base import ConversionError
    from converters.sources import ArraysSource

    if len(args.files) < 2:
        raise ConversionError("give one or more input files and then the output folder")
    *files, out = args.files
    fields = [f.strip() for f in args.fields.split(",") if f.strip()] if args.fields else None
    return _convert(ArraysSource(files, fields=fields), out, args)


def _convert_packed(args) -> int:
    source, out = args.source_from_args(args, _image_options(args))
    code = _convert(source, dataset_arg(str(out)), args)
    source.release()  # after a conversion that completed; a failed one keeps its download for the re-run
    return code


def _convert(source, out: Path, args) -> int:
    from converters.planner import parse_size
    from converters.runner import convert
    from dali_pipes.dataset.manifest import ERRORS_NAME, human_bytes

    if storage_options(args) and not is_url(out):
        raise ValueError(
            "--storage-option is for an output URL, and the output is a local folder; give the options of "
            "input URLs with --input-storage-option KEY=VALUE"
        )
    result = (convert if not is_url(out) else convert_to_url_from_args(args))(
        source,
        out,
        format=args.format,
        samples_per_shard=args.samples_per_shard,
        shard_size=parse_size(args.shard_size) if args.shard_size else None,
        workers=args.workers,
        on_error=args.on_error,
        progress=not args.no_progress,
        engine=args.engine,
        scheduler=args.scheduler,
        order=args.order,
        order_seed=args.order_seed,
    )
    # One summary line, always with the count of inputs left out (also when it is 0); the parts of kept inputs
    # that were left out (a degenerate COCO polygon) are counted apart: their images are in the dataset.
    parts = sum(1 for error in result.errors if error.get("part"))
    left_out = (
        f"left out {len(result.errors) - parts} input(s)"
        + (f" and {parts} part(s) of kept inputs" if parts else "")
        + (f", listed in {join(out, ERRORS_NAME) if is_url(out) else out / ERRORS_NAME}:" if result.errors else "")
    )
    samples = counted(result.num_samples, "sample")
    if result.already_complete:
        print(f"{shown(out)}: already complete ({samples}), nothing to do; {left_out}")
    else:
        rate = result.num_samples / result.seconds if result.seconds else 0.0
        print(
            f"{shown(out)}: {samples} in {len(result.manifest.shards)} {args.format} shard(s), "
            f"{human_bytes(result.bytes)}, {result.seconds:.1f} s ({rate:,.0f} samples/s)"
            + (f", {result.resumed_shards} shard(s) kept from an earlier run" if result.resumed_shards else "")
            + f"; {left_out}"
        )
    if result.errors:
        for error in result.errors[:10]:
            print(f"  {error['input']}: {error['reason']}")
        if len(result.errors) > 10:
            print(f"  ... and {len(result.errors) - 10} more")
    return 0


# --- inspect, verify, merge ---------------------------------------------------------------


def _add_inspect(commands) -> None:
    p = commands.add_parser("inspect", help="summarise a dataset (a folder, or a URL such as s3://bucket/ds)")
    p.add_argument("dataset", type=dataset_arg)
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    add_storage_options(p)
    p.set_defaults(handler=_inspect)


def _inspect(args) -> int:
    from dali_pipes.cli.inspect import format_summary, summarize, summary_json

    options = storage_options(args)
    summary = summarize(args.dataset, storage_options=options)
    print(summary_json(args.dataset, storage_options=options) if args.json else format_summary(summary))
    return 0


def _add_verify(commands) -> None:
    p = commands.add_parser("verify", help="check every shard's size, checksum and records (of a URL: size and hash)")
    p.add_argument("dataset", type=dataset_arg)
    add_storage_options(p)
    p.add_argument("--decode", action="store_true", help="also decode every image")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_verify)


def _verify(args) -> int:
    from dali_pipes.cli.verify import verify_dataset

    report = verify_dataset(
        args.dataset, decode=args.decode, progress=not args.no_progress, storage_options=storage_options(args)
    )
    if report.ok:
        decoded = f", {counted(report.images_decoded, 'image')} decoded" if args.decode else ""
        read = (
            f"{counted(report.samples_read, 'sample')} read"
            if report.samples_read
            else "sizes and SHA-256 read remotely"
        )
        print(f"{shown(args.dataset)}: OK: {report.num_shards} shard(s), {read}{decoded}")
        return 0
    print(f"{shown(args.dataset)}: {len(report.problems)} problem(s):", file=sys.stderr)
    for problem in report.problems:
        print(f"  {problem}", file=sys.stderr)
    print("re-convert the dataset, or restore the damaged shards from a copy", file=sys.stderr)
    return EXIT_FAILED


def _add_merge(commands) -> None:
    p = commands.add_parser("merge", help="merge an HDF5 dataset's shards into one file (physical or virtual)")
    p.add_argument("dataset", type=Path)
    p.add_argument("merged", type=Path, help="the merged .h5 file to write")
    p.add_argument("--virtual", action="store_true", help="virtual datasets that point at the shards (no copy)")
    p.set_defaults(handler=_merge)


def _merge(args) -> int:
    from converters.merge import merge_hdf5

    path = merge_hdf5(args.dataset, args.merged, virtual=args.virtual)
    kind = "virtual" if args.virtual else "physical"
    print(f"{path}: {kind} merge of {args.dataset}")
    return 0


def _add_stage(commands) -> None:
    p = commands.add_parser(
        "stage", help="copy a dataset (a folder, a merged .h5, or a URL) to a local disk or /dev/shm, resumably"
    )
    p.add_argument("dataset", type=dataset_arg, help="a dataset folder, a merged .h5 file, or a URL (s3://bucket/ds)")
    p.add_argument("dest", type=Path, help="the local folder to copy it into (e.g. /dev/shm/NAME)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="re-hash the staged copy, also when it is reused (a merged file, which records no hash, against its source)",
    )
    p.add_argument("--workers", type=int, default=4, help="files copied (or downloaded) at once (default: 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_storage_options(p)
    p.set_defaults(handler=_stage)


def _stage(args) -> int:
    from dali_pipes.staging.stage import stage_dataset

    # A StageError is a ValueError: _run prints it as one line.
    report = stage_dataset(
        args.dataset,
        args.dest,
        verify=args.verify,
        workers=args.workers,
        progress=not args.no_progress,
        storage_options=storage_options(args),
    )
    if report.reused:
        print(f"{report.path}: already staged, reused" + (" (verified)" if args.verify else ""))
    else:
        print(f"{report.path}: staged, {len(report.copied)} file(s) copied, {len(report.kept)} already in place")
    return 0


# --- demo and show -------------------------------------------------------------------------


def _add_demo(commands) -> None:
    p = commands.add_parser("demo", help="the main job end to end on a built-in synthetic dataset (or --data DIR)")
    p.add_argument("--data", type=Path, help="your own ImageNet-style image folder (default: synthetic images)")
    p.add_argument(
        "--workdir", type=Path, help="where the files go (default: ~/.cache/dali-pipes/demo, reused by later runs)"
    )
    p.add_argument("--num-images", type=int, default=512, help="synthetic images (default: 512)")
    p.add_argument(
        "--seconds", type=float, default=2.0, help="warm-up, and each of the 3 timed windows per loader (default: 2)"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"))
    p.set_defaults(handler=_demo)


def _demo(args) -> int:
    from dali_pipes.cli.demo import format_report, run_demo

    for name in ("num_images", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not args.seconds > 0:
        raise ValueError(f"--seconds must be above 0, got {args.seconds}")
    report = run_demo(args.data, **named(args, "workdir", "num_images", "seconds", "batch_size", "device"))
    print(format_report(report))
    return 0


def _add_show(commands) -> None:
    from dali_pipes.cli.show import PIPELINES

    p = commands.add_parser(
        "show", help="a PNG grid of augmented samples with their labels (and boxes), to check by eye"
    )
    p.add_argument("dataset", type=Path, help="a dataset folder written by 'dali-pipes convert'")
    p.add_argument("--pipeline", choices=PIPELINES, default="train", help="which augmentation (default: train)")
    p.add_argument("--out", type=Path, default=Path("grid.png"), metavar="OUT.png", help="(default: grid.png)")
    p.add_argument("--num", type=int, default=16, help="samples in the grid (default: 16)")
    p.add_argument("--seed", type=int, default=0, help="another seed shows other samples and augmentations")
    p.add_argument("--size", type=int, metavar="PX", help="output size (default: 224, detection 300)")
    p.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"))
    p.set_defaults(handler=_show)


def _show(args) -> int:
    from dali_pipes.cli.show import show

    path = show(
        args.dataset, args.out, pipeline=args.pipeline, num=args.num, seed=args.seed, size=args.size, device=args.device
    )
    from dali_pipes.cli.show import make_spec, spec_settings

    print(f"{path}: {counted(args.num, f'{args.pipeline} sample')} of {args.dataset}")
    print(f"drawn with {spec_settings(make_spec(args.pipeline, size=args.size))}")
    return 0


# --- loader benchmarks, tuning and the bottleneck report -----------------------------------
