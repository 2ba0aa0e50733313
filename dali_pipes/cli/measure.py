"""The measuring subcommands of ``dali-pipes``: bench, bench-convert, tune, doctor and selftest.

Each ``add_*`` adds one subcommand to the parser of :mod:`dali_pipes.cli.command`; its
handler parses the arguments and calls one library function.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from dali_pipes.cli.exit_codes import EXIT_FAILED
from dali_pipes.dataset.fileio import atomic_write_json
from dali_pipes.dataset.manifest import FORMATS

log = logging.getLogger("dali_pipes.cli")
_T = TypeVar("_T")


def add_bench_convert(commands) -> None:
    p = commands.add_parser(
        "bench-convert", help="conversion throughput of each format against a plain file copy, side by side"
    )
    p.add_argument(
        "images", type=Path, nargs="?", help="an image folder (default: a synthetic one in a temporary folder)"
    )
    p.add_argument("--num", type=int, default=1000, help="synthetic images when no folder is given (default: 1000)")
    p.add_argument("--workers", type=int, default=2, help="writer processes (default: 2)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="runs per row; the median is reported (default: 3)")
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    p.set_defaults(handler=_bench_convert)


def _bench_convert(args) -> int:
    from converters.bench import format_report, run_conversion_benchmark

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    report = run_conversion_benchmark(
        **named(args, "images", "num", "workers", "repeats"), formats=formats, json_out=args.json
    )
    print(format_report(report))
    return 0


def add_bench(commands) -> None:
    from dali_pipes.bench.suites import SUITES

    p = commands.add_parser(
        "bench",
        help="images/s of this package's loader against the DataLoader baselines, DALI's file reader and decode-only",
    )
    p.add_argument(
        "dataset",
        type=Path,
        nargs="?",
        help="a dataset folder written by 'dali-pipes convert' (--suite scale, scale-out: the folder for its data)",
    )
    p.add_argument("--suite", choices=(*SUITES, "scale", "scale-out"), default="main", help="which comparison")
    p.add_argument(
        "--max-n",
        type=int,
        default=1_000_000,
        metavar="N",
        help="--suite scale: the largest sample count (10k, 100k, 1M, 10M up to it; default 1M)",
    )
    _add_scale_out(p)
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write every figure and the machine description here")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="write a bar chart here (needs matplotlib)")
    p.add_argument(
        "--quick", action="store_true", help="tiny timing windows: checks that every row runs, figures are noise"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help="batch size of every row (default: 64, or the largest power of two a smaller dataset holds)",
    )
    p.add_argument(
        "--images", type=Path, metavar="DIR", help="the original image folder (default: the manifest's source)"
    )
    p.add_argument(
        "--settings",
        type=Path,
        metavar="FILE",
        help="loader settings saved by 'dali-pipes tune' for the dali-pipes rows",
    )
    _add_dtype(p, "output dtype of the DALI rows (default: float32, as the baselines)")
    p.add_argument(
        "--rows",
        type=_row_names,
        default=(),
        metavar="NAME,...",
        help="main suite: measure only these rows, named as its table names them "
        "(e.g. 'dali-pipes gpu,DALI readers.file gpu'): a shorter run",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        metavar="N",
        help="timed windows per row, the median reported (default: 5; 3 for a short GPU lease)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_bench)


def _add_scale_out(p: argparse.ArgumentParser) -> None:
    """``--mds-python``, the scale-out suite's peer (:mod:`dali_pipes.bench.scale_out`)."""
    p.add_argument(
        "--mds-python",
        metavar="PYTHON",
        help="--suite scale-out: a Python with mosaicml-streaming for the peer rows (default: "
        "$DALI_PIPES_BENCH_MDS_PYTHON; without one they are skipped)",
    )


def _add_dtype(p: argparse.ArgumentParser, text: str) -> None:
    """``--dtype``, the output dtype of the measured pipelines (bench and tune), with its help ``text``."""
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help=text)


def _positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _row_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError("give at least one row name")
    return names


def _bench_scale(args) -> int:
    import tempfile

    from dali_pipes.bench.scale import format_scale, run_scale, write_scale_json

    if args.max_n < 1:
        raise SystemExit(f"dali-pipes bench: --max-n must be at least 1, got {args.max_n}")
    with contextlib.ExitStack() as stack:
        folder = args.dataset or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dali-pipes-scale-")))
        rows = run_scale(folder, max_n=args.max_n)
    print(format_scale(rows))
    if args.json is not None:
        print(f"figures: {write_scale_json(rows, args.json)}")
    return 0


def _measure(function: Callable[..., _T], args: argparse.Namespace, *names: str) -> _T:
    """How bench, tune and doctor call their library function: ``function(args.dataset, progress=...)`` with the
    parsed arguments ``names`` under the same names, the loaders' INFO lines kept out of the table."""
    with _quiet_loaders(args):
        return function(args.dataset, progress=not args.no_progress, **named(args, *names))


def named(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The parsed arguments ``names``, as keyword arguments of the same names (a library function's parameters are
    named as the command line's options)."""
    return {name: getattr(args, name) for name in names}


@contextlib.contextmanager
def _quiet_loaders(args) -> Iterator[None]:
    # The benchmarks build dozens of loaders; their lines each (the loader's, and the thread and reader counts it
    # chose, logged where they are chosen) would bury the table.
    loggers = [logging.getLogger(f"dali_pipes.loading.{name}") for name in ("loader", "options")]
    levels = [logger.level for logger in loggers]
    if not args.verbose:
        for logger in loggers:
            logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)  # main() may run in-process (tests, notebooks): leave logging as found


def _bench(args) -> int:
    from dali_pipes.bench.report import format_table, write_json, write_plot
    from dali_pipes.bench.suites import run_bench

    if args.suite == "scale":
        return _bench_scale(args)
    if args.suite == "scale-out":
        from dali_pipes.bench.scale_out import scale_out_report

        report = scale_out_report(args.dataset, args.quick, args.mds_python, args.json)
        print("\n".join([report["table"], *report["goals"]]))
        return EXIT_FAILED if any(row.get("error") for row in report["rows"]) else 0
    if args.dataset is None:
        raise SystemExit("dali-pipes bench: give the dataset folder to benchmark")
    report = _measure(run_bench, args, "suite", "batch_size", "images", "quick", "settings", "dtype", "rows", "repeats")
    print(format_table(report))
    if args.json is not None:
        print(f"figures: {write_json(report, args.json)}")
    if args.plot is not None:
        plot = write_plot(report, args.plot)
        print(
            f"plot: {plot}" if plot else 'plot: skipped, matplotlib does not import (pip install "dali-pipes[bench]")'
        )
    return EXIT_FAILED if report.failed else 0


def add_tune(commands) -> None:
    from dali_pipes.bench.model_names import MODELS

    p = commands.add_parser(
        "tune", help="search num_threads, py_num_workers, prefetch (and hw_decoder_load) for the fastest loader"
    )
    p.add_argument("dataset", type=Path)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("dali-pipes-settings.json"),
        metavar="FILE",
        help="where to save the settings (default: dali-pipes-settings.json)",
    )
    p.add_argument("--quick", action="store_true", help="a few short trials: checks that tuning runs")
    p.add_argument(
        "--batch-size", type=int, default=64, metavar="B", help="the batch size you train with (default: 64)"
    )
    p.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"))
    _add_dtype(p, "output dtype of the pipeline")
    p.add_argument(
        "--decoder-only",
        action="store_true",
        help="GPU only: keep the loader settings, search only hw_decoder_load and jpeg_fancy_upsampling",
    )
    p.add_argument(
        "--model",
        dest="train_model",
        choices=MODELS,
        metavar="NAME",
        help=f"search for the fastest training of this model ({', '.join(MODELS)}) on the loader's batches, not the "
        "loader's own rate: a small model shares the GPU with the decoding",
    )
    p.add_argument(
        "--size", type=int, default=224, metavar="PX", help="with --model: the training images' size (default: 224)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_tune)


def _tune(args) -> int:
    from dali_pipes.bench.tune import TrainedModel, format_tune, save_settings, tune

    args.model = TrainedModel(args.train_model, args.size) if args.train_model else None
    result = _measure(tune, args, "batch_size", "quick", "device", "dtype", "decoder_only", "model")
    print(format_tune(result, save_settings(result, args.out)))
    return 0


def add_doctor(commands) -> None:
    from dali_pipes.bench.model_names import MODELS

    p = commands.add_parser("doctor", help="is training data-bound? loader-only, model-only and combined throughput")
    p.add_argument("dataset", type=Path)
    p.add_argument("--model", choices=MODELS, default="resnet50", help="the model to train (default: resnet50)")
    p.add_argument("--batch-size", type=int, default=64, metavar="B", help="(default: 64)")
    p.add_argument(
        "--steps", type=int, default=30, metavar="N", help="timed training steps per measurement (default: 30)"
    )
    p.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"), help="where the loader runs")
    p.add_argument("--settings", type=Path, metavar="FILE", help="loader settings saved by 'dali-pipes tune'")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="also write the figures and the verdict here")
    p.add_argument("--quick", action="store_true", help="shorter warm-up: checks that every measurement runs")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=10.0,
        metavar="M",
        help="refuse up front a run estimated to take longer, naming smaller models (default: 10)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_doctor)


def _doctor(args) -> int:
    from dali_pipes.bench.doctor import format_doctor, run_doctor

    report = _measure(run_doctor, args, "model", "batch_size", "steps", "quick", "device", "settings", "max_minutes")
    print(format_doctor(report))
    if args.json is not None:
        print(f"figures: {atomic_write_json(args.json, report.to_json())}")
    return 0


def add_selftest(commands) -> None:
    p = commands.add_parser(
        "selftest", help="run every pipeline through the loader on this machine's devices, on small sample data"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"), help="default: the CPU and any GPU")
    p.add_argument("--json", type=Path, help="also write every line and figure to this JSON file")
    p.set_defaults(handler=_selftest)


def _selftest(args) -> int:
    from dali_pipes.selftest.runner import format_lines, run_selftest

    report = run_selftest(args.device, json_out=args.json)
    format_lines(report, print)
    return 0 if report.passed else EXIT_FAILED
