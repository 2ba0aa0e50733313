"""``dali-pipes bench``, ``tune`` and ``doctor`` on a tiny dataset with ``--quick``.

Speed is reported, never asserted: these tests check that every row runs or is
skipped with its reason, that the figures and the machine description reach the
JSON, that the plot is drawn, and that the saved settings drive a real loader.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from converters.runner import convert
from converters.sources import ImageFolderSource
from converters.synth import make_imagefolder
from dali_pipes.bench.runner import Job, Skipped, Target, TimingPlan, measure, time_stream

CLI = (sys.executable, "-m", "dali_pipes")  # the CLI wherever the package imports, no script needed
BATCH = 8

#: Every row of the main table, in order.
MAIN_ROWS = [
    "dali-pipes gpu",
    "dali-pipes cpu",
    "dali-pipes cpu",  # antialias=False
    "DataLoader+PIL shards",
    "DataLoader+PIL files",
    "DataLoader+torchvision shards",
    "DataLoader+Albumentations shards",
    "DataLoader+Albumentations shards",  # antialias=False
    "torchvision gpu",
    "DALI readers.file gpu",
    "DALI readers.file gpu hw_decoder_load=1",
    "DALI readers.file cpu",
    "decode-ceiling (full)",
    "decode-ceiling (reduced)",
]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _imports(module: str) -> bool:
    from dali_pipes.bench.backends import require  # sets what keeps Albumentations off the network

    try:
        require(module)
    except Skipped:
        return False
    return True


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """48 small JPEGs in 4 classes, converted to LMDB; the manifest records the image folder."""
    root = tmp_path_factory.mktemp("bench")
    images = make_imagefolder(root / "images", 48, size=(128, 96), classes=4, workers=1)
    out = root / "shards"
    convert(ImageFolderSource(images.resolve()), out, format="lmdb", workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def bench_cli(dataset, tmp_path_factory):
    """The main bench, run once through the real CLI (``python -m dali_pipes``) with --json and --plot."""
    out = tmp_path_factory.mktemp("bench-out")
    proc = subprocess.run(
        [
            *CLI,
            "bench",
            str(dataset),
            "--quick",
            "--batch-size",
            str(BATCH),
            "--no-progress",
            "--json",
            str(out / "bench.json"),
            "--plot",
            str(out / "bench.png"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"dali-pipes bench failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc, out


# --- the main bench, through the console script -------------------------------------------


def test_bench_json_holds_every_row_and_the_machine(bench_cli):
    proc, out = bench_cli
    report = json.loads((out / "bench.json").read_text())
    # The first row of each name (the spec's own antialias setting, True by default).
    rows = {row["name"]: row for row in reversed(report["rows"])}
    assert [row["name"] for row in report["rows"]] == MAIN_ROWS
    for row in report["rows"]:
        assert row["error"] is None, row
        if row["skipped"] is not None:
            assert row["skipped"].strip() and row["images_per_s"] is None, row
        else:
            assert row["images_per_s"] > 0, row
            spread = row["spread"]
            assert spread["min"] <= row["images_per_s"] <= spread["max"] and spread["relative"] >= 0, row
            assert len(spread["windows"]) == report["context"]["timing"]["repeats"]
            # The cost column: CPU time of the whole process tree over the timed images.
            assert row["cpu_seconds"] > 0, row
            assert row["cpu_seconds_per_1k_images"] == pytest.approx(1000 * row["cpu_seconds"] / row["timed_images"])
    # What must be measured on any machine, and what is skipped exactly when it cannot run here.
    for name in (
        "dali-pipes cpu",
        "DataLoader+PIL shards",
        "DataLoader+PIL files",
        "DALI readers.file cpu",
        "decode-ceiling (full)",
        "decode-ceiling (reduced)",
    ):
        assert rows[name]["images_per_s"] is not None, rows[name]
    for name in ("dali-pipes gpu", "DALI readers.file gpu"):
        assert (rows[name]["skipped"] is None) == _cuda(), rows[name]
    assert (rows["torchvision gpu"]["skipped"] is None) == (_cuda() and _imports("torchvision"))
    assert (rows["DataLoader+Albumentations shards"]["skipped"] is None) == _imports("albumentations")
    assert (rows["DataLoader+torchvision shards"]["skipped"] is None) == _imports("torchvision")
    # Both resize qualities, each on both sides of the Albumentations comparison.
    for name in ("dali-pipes cpu", "DataLoader+Albumentations shards"):
        assert sorted(r["params"]["antialias"] for r in report["rows"] if r["name"] == name) == [False, True]
    reference = rows[MAIN_ROWS[3]]["images_per_s"]
    assert rows["dali-pipes cpu"]["ratio_to_reference"] == pytest.approx(
        rows["dali-pipes cpu"]["images_per_s"] / reference
    )

    machine = report["machine"]
    for key in ("cores", "cpu", "platform", "python", "torch", "dali", "gpu", "dali_pipes"):
        assert key in machine, key
    assert machine["cores"] >= 1 and (machine["gpu"] is not None) == _cuda()
    context = report["context"]
    assert context["batch_size"] == BATCH and context["num_samples"] == 48 and context["images_folder"]
    assert context["augmentation"]["random_resized_crop"]["size"] == 224
    assert "dali-pipes cpu / DataLoader+PIL shards" in report["summary"]
    assert "dali-pipes cpu / DALI readers.file cpu" in report["summary"]
    assert context["augmentation"]["antialias"] is True

    # The table a person reads names every row, and the skipped ones with their reason.
    for name in MAIN_ROWS:
        assert name in proc.stdout
    assert "skipped" in proc.stdout or _cuda()


def test_bench_plot_is_drawn(bench_cli):
    pytest.importorskip("matplotlib")
    from PIL import Image

    _, out = bench_cli
    pixels = np.asarray(Image.open(out / "bench.png").convert("L"), dtype=np.float32)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert pixels.std() > 10 and (pixels < 128).mean() > 0.01, "the plot is blank"


# --- the suites ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "suite", ["feed", "albumentations", "cpu-vs-gpu", "workers", "formats", "stages", "storage", "recipe", "train"]
)
def test_each_suite_runs_and_returns_its_table(dataset, suite):
    from dali_pipes.bench.report import format_table
    from dali_pipes.bench.suites import run_bench

    report = run_bench(dataset, suite=suite, batch_size=BATCH, quick=True, progress=False)
    assert report.suite == suite and report.rows
    measured = [row for row in report.rows if row.timing is not None]
    assert measured, "no row was measured"
    for row in report.rows:
        assert row.error is None, (row.name, row.params, row.error)
        assert (row.timing is None) == (row.skipped is not None), row
        if row.timing is not None:
            assert row.timing.median > 0 and row.timing.spread >= 0
    table = format_table(report)
    for row in report.rows:
        assert row.name in table
    data = report.to_json()
    assert data["suite"] == suite and data["machine"]["cores"] >= 1 and len(data["rows"]) == len(report.rows)
    json.dumps(data)  # every figure serialises

    names = {(row.name, tuple(sorted(row.params.items()))) for row in report.rows}
    if suite == "formats":
        assert {row.name for row in report.rows} == {"files", "lmdb", "hdf5", "tfrecord"}
        assert {row.params["reader"] for row in report.rows} >= {"read-only", "DataLoader+PIL"}
    if suite == "stages":
        cpu = [row for row in report.rows if row.params["device"] == "cpu"]
        assert [row.name for row in cpu] == [
            "read shards",
            "+ decode random crop",
            "+ resize",
            "+ colour jitter",
            "+ flip, normalise, cast, layout",
        ]
        assert all("ms_per_image_added" in row.extra and "cpu_ms_added" in row.extra for row in cpu)
        # Reading alone is cheaper than reading and decoding: the prefixes really differ in work (in wall
        # time, or in CPU time, which a loaded machine moves less; quick windows are short for either).
        read, decoded = cpu[0].timing, cpu[1].timing
        assert read.median > decoded.median or read.cpu_seconds_per_1k < decoded.cpu_seconds_per_1k
    if suite == "feed":
        # DALI's reader, the loader as it comes (reading in its own process), and with worker processes.
        assert [row.name for row in report.rows] == ["DALI readers.file feed", "dali-pipes feed", "dali-pipes feed"]
        assert report.rows[1].params["py_num_workers"] == 0 and report.rows[2].params["py_num_workers"] >= 1
        assert all(row.timing is not None for row in report.rows)
        ratios = [entry["value"] for entry in report.summary.values()]
        assert len(ratios) == 2 and all(value > 0 for value in ratios)
    if suite == "workers":
        assert {row.params["num_workers"] for row in report.rows} >= {0}
    if suite == "cpu-vs-gpu":
        assert all(row.extra["seconds"] > 0 for row in measured)
    if suite == "storage":
        epochs = [row for row in report.rows if "epoch" in row.params]
        assert [(row.name, row.params["epoch"]) for row in epochs] == [
            (name, epoch) for name in ("original", "staged /dev/shm", "cache=ram") for epoch in (1, 2)
        ]
        from dali_pipes.bench import object_storage, stream_rows

        s3_rows = [row for row in report.rows if "epoch" not in row.params]
        # From a local S3 server (skipped without moto): the copies, then a loader staged and one streamed.
        assert [row.name for row in s3_rows] == object_storage.row_names() + stream_rows.row_names((0,))  # quick
        stream = report.row(stream_rows.STREAM)
        if stream.skipped is None or "moto" not in stream.skipped:  # 3 shards: a tenth holds less than three
            assert "--samples-per-shard" in stream.skipped and report.row(stream_rows.STAGED).timing is not None
        assert all(row.extra["MB_s"] > 0 for row in s3_rows if row.timing is not None)
        # Through the latency proxy, and the report says with which latency.
        assert all(row.extra["latency_ms"] == 30 for row in s3_rows if row.timing is not None)
        assert any("first byte 30 ms" in note for note in report.notes)
        shm = {row.name: row.extra["shm_MB"] for row in epochs}
        size = sum(p.stat().st_size for p in dataset.glob("shard-*")) / 1e6
        # Staging holds the whole dataset in the tmpfs; the cache the shards (all: the rows shuffle).
        assert shm["original"] == 0 and shm["staged /dev/shm"] >= round(size, 1) - 0.1
        assert shm["cache=ram"] == pytest.approx(size, abs=0.1)
    if suite == "recipe":
        cpu = [row for row in report.rows if row.params["device"] == "cpu"]
        assert [row.name for row in cpu] == ["plain 160px", "recipe 160px", "plain 224px", "recipe 224px"]
        assert all(row.extra["epoch_s"] > 0 for row in cpu)
        models = [row for row in report.rows if row.name.startswith("resnet50 step")]
        import torch

        assert len(models) == 2 and all(row.skipped for row in models) != torch.cuda.is_available()
    if suite == "train":
        _check_train_report(report)
    assert len(names) == len(report.rows), "two rows measure the same thing"


def _check_train_report(report) -> None:
    """Each model alone and fed by each loader; ratios to the model's own rate; which side bounds each run."""
    from dali_pipes.bench.suites.train import CPU_MODELS, GPU_MODELS

    models = GPU_MODELS if _cuda() else CPU_MODELS
    names = ["model alone", "dali-pipes", "DALI readers.file", "DataLoader+PIL"]
    assert [(row.name, row.params["model"], row.params["size"]) for row in report.rows] == [
        (name, model, size) for model, size in models for name in names
    ]
    assert all(row.timing is not None for row in report.rows), [(r.name, r.skipped) for r in report.rows]
    for row in report.rows:
        share = report.ratio(row)
        if row.name == "model alone":
            assert share == 1.0 and "bound_by" not in row.extra
        else:  # the side that bounds it follows the share of the model's rate it reached
            assert row.extra["bound_by"] == ("model" if share >= 0.95 else "input")
        assert (row.extra["gpu_busy"] is None) == (not _cuda())
    # The DataLoader row runs as a training script's: a worker per core, pinned memory where CUDA is.
    assert f"num_workers={report.context['cores']}, pin_memory, persistent_workers" in report.rows[3].description
    assert "its defaults" in report.rows[1].description
    for model, size in models:
        ours = report.row("dali-pipes", model=model, size=size).images_per_s
        dataloader = report.row("DataLoader+PIL", model=model, size=size).images_per_s
        entry = report.summary[f"{model} {size}px: dali-pipes / DataLoader+PIL"]
        assert entry["value"] == pytest.approx(ours / dataloader)
    assert [m["model"] for m in report.context["models"]] == [m for m, _ in models]


def test_gpu_busy_averages_the_samples_inside_a_rows_windows_only():
    from dali_pipes.bench.runner import Row, Timing
    from dali_pipes.bench.suites.train import GpuBusy

    busy = GpuBusy(Target("cpu"))
    with busy:  # no GPU here: nothing is sampled, and a row gets no figure
        pass
    row = Row("r", timing=Timing((1.0, 1.0), 2, 2.0, spans=((10.0, 11.0), (20.0, 21.0))))
    assert busy.share(row) is None
    busy._samples = [(9.9, 0.0), (10.2, 0.5), (10.9, 0.7), (15.0, 0.0), (20.5, 0.9), (21.1, 0.0)]
    assert busy.share(row) == pytest.approx(0.7)
    assert busy.share(Row("unmeasured")) is None


def test_albumentations_holds_opencv_to_one_thread_before_its_first_use(dataset):
    # The in-process row runs before the DataLoader rows fork their workers: a worker forked
    # while OpenCV's thread pool is running can deadlock (seen with 500x375 images), so the
    # transform must keep OpenCV from ever starting that pool.
    import random

    from dali_pipes.bench.backends import AlbumentationsTrainTransform
    from dali_pipes.pipelines import ClassificationTrain
    from dali_pipes.stores import open_store

    if not _imports("albumentations"):
        pytest.skip("albumentations does not import")
    import cv2

    transform = AlbumentationsTrainTransform(ClassificationTrain(size=224))
    store = open_store(dataset)
    try:
        image = transform.from_bytes(store[0]["image"], random.Random(0))
    finally:
        store.close()
    assert tuple(image.shape) == (3, 224, 224) and cv2.getNumThreads() == 1


# --- tune ----------------------------------------------------------------------------------


def test_tune_saves_settings_that_the_loader_accepts(dataset, tmp_path):
    from dali_pipes import DALILoader, RunOptions
    from dali_pipes.bench.tune import format_tune, save_settings, tune
    from dali_pipes.pipelines import ClassificationTrain
    from dali_pipes.settings import apply_settings, load_settings

    result = tune(dataset, batch_size=BATCH, quick=True, progress=False)
    assert result.best.images_per_s > 0 and len(result.trials) >= 3
    # The incumbent is measured again beside each setting's values: one setting, several trials.
    assert len(result.trials) > len({trial.key() for trial in result.trials})
    assert all(t.cpu_seconds_per_1k and t.cpu_seconds_per_1k > 0 for t in result.trials if t.images_per_s)
    assert "fastest:" in format_tune(result)
    path = save_settings(result, tmp_path / "settings.json")
    settings = load_settings(path)
    assert settings == result.best.settings and set(settings) == {"num_threads", "py_num_workers", "prefetch"}
    spec = apply_settings(ClassificationTrain(size=224), path)
    with DALILoader(dataset, spec, batch_size=BATCH, run=RunOptions(device="cpu", **settings)) as loader:
        seen = sum(len(batch["image"]) for batch in loader)
    assert seen == 48
    # The same file given to the loader directly; explicit arguments win over it.
    run = RunOptions(device="cpu", settings=path)
    with DALILoader(dataset, ClassificationTrain(size=224), batch_size=BATCH, run=run) as loader:
        assert sum(len(batch["image"]) for batch in loader) == 48
    # `dali-pipes bench --settings` runs the dali-pipes rows with them.
    from dali_pipes.bench.inputs import bench_inputs

    assert bench_inputs(dataset, batch_size=BATCH, settings=path).loader_settings == settings
    path.write_text(path.read_text().replace(f'"num_threads": {settings["num_threads"]}', '"num_threads": 0'))
    with pytest.raises(ValueError, match="num_threads"):
        DALILoader(dataset, ClassificationTrain(size=224), batch_size=BATCH, run=run)


def test_load_settings_refuses_what_it_cannot_use(tmp_path):
    from dali_pipes.pipelines import ClassificationTrain
    from dali_pipes.settings import SETTINGS_KIND, apply_settings, load_settings

    def write(data) -> Path:
        path = tmp_path / "s.json"
        path.write_text(json.dumps(data))
        return path

    good = {
        "kind": SETTINGS_KIND,
        "version": 1,
        "loader": {"num_threads": 2, "prefetch": 3},
        "decoder": {"hw_decoder_load": 0.9},
    }
    assert load_settings(write(good)) == {"num_threads": 2, "prefetch": 3}
    assert apply_settings(ClassificationTrain(), write(good)).decoder.hw_decoder_load == 0.9
    for bad, message in [
        ({**good, "kind": "other"}, "not a dali-pipes settings file"),
        ({**good, "version": 2}, "version"),
        ({**good, "loader": {"num_threads": 0}}, "num_threads must be an integer >= 1"),
        ({**good, "loader": {"threads": 2}}, "unknown loader setting 'threads'"),
        ({**good, "loader": {"prefetch": True}}, "prefetch must be an integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_settings(write(bad))
    with pytest.raises(FileNotFoundError, match="dali-pipes tune"):
        load_settings(tmp_path / "missing.json")


# --- doctor --------------------------------------------------------------------------------


def test_doctor_reports_three_throughputs_and_a_verdict(dataset):
    from dali_pipes.bench.doctor import format_doctor, run_doctor

    report = run_doctor(dataset, model="tiny", batch_size=BATCH, steps=3, quick=True, progress=False)
    for row in (report.loader, report.model_only, report.combined):
        assert row.error is None and row.images_per_s > 0, row
    # The verdict's first words and the flag agree ("NOT DATA-BOUND..." whenever the flag is False).
    assert report.verdict.startswith("DATA-BOUND:") == report.data_bound and report.advice
    text = format_doctor(report)
    for word in ("loader-only", "model-only", "combined", "change first:"):
        assert word in text
    json.dumps(report.to_json())


def test_diagnose_says_which_side_bounds_training():
    from dali_pipes.bench.doctor import diagnose

    bound, verdict, advice, figures = diagnose(100.0, 400.0, 95.0, loader_device="cpu", cuda=True, cores=8)
    assert bound is True and verdict.startswith("DATA-BOUND") and "device='gpu'" in advice
    assert figures["model_could_go_faster_by"] == pytest.approx(400 / 95)
    bound, verdict, advice, _ = diagnose(100.0, 400.0, 95.0, loader_device="gpu", cuda=True, cores=8)
    assert bound is True and advice.startswith("num_threads") and "dali-pipes tune" in advice
    bound, verdict, advice, _ = diagnose(1000.0, 400.0, 390.0, loader_device="gpu", cuda=True, cores=8)
    assert bound is False and verdict.startswith("NOT DATA-BOUND:") and "model" in advice
    bound, verdict, advice, _ = diagnose(1000.0, 400.0, 150.0, loader_device="cpu", cuda=False, cores=2)
    assert bound is False and "CONTENDED" in verdict and advice.startswith("num_threads")
    assert diagnose(None, 400.0, 390.0, loader_device="cpu", cuda=False, cores=2)[0] is None


def test_models_have_the_reference_sizes():
    import torch

    from dali_pipes.bench.doctor import MODELS
    from dali_pipes.bench.models import build_model

    # torchvision's parameter counts for 1000 classes: the same architectures, layer for layer.
    expected = {"resnet50": 25_557_032, "resnet18": 11_689_512, "mobilenet": 3_504_872}
    for name in MODELS:
        model = build_model(name, 1000)
        if name in expected:
            assert sum(p.numel() for p in model.parameters()) == expected[name], name
    assert build_model("tiny", 4)(torch.randn(2, 3, 64, 64)).shape == (2, 4)
    with pytest.raises(ValueError, match="unknown model"):
        build_model("vgg", 10)


# --- pieces --------------------------------------------------------------------------------


def test_timing_leaves_out_the_warm_up_and_keeps_every_window():
    taken = []

    def stream():
        while True:
            taken.append(1)
            yield 4

    plan = TimingPlan(warmup_batches=3, repeats=4, min_batches=2, min_seconds=0.0, warmup_seconds=0.0)
    timing = time_stream(stream(), plan, Target("cpu"), in_flight=2)
    assert len(taken) == 3 + 2 + 4 * 2  # warm-up (with the in-flight batches), then 4 windows of 2
    assert len(timing.values) == 4 and timing.images == 4 * 2 * 4
    assert timing.low <= timing.median <= timing.high and timing.spread >= 0


def test_a_row_is_measured_skipped_or_failed_never_lost():
    import contextlib

    plan = TimingPlan.quick()

    @contextlib.contextmanager
    def skip():
        raise Skipped("not here")
        yield  # pragma: no cover

    @contextlib.contextmanager
    def fail():
        yield iter([1])  # runs dry during the warm-up

    row = measure(Job("s", skip), plan, Target("cpu"))
    assert row.skipped == "not here" and row.timing is None and row.to_json()["images_per_s"] is None
    row = measure(Job("f", fail), plan, Target("cpu"))
    assert row.error and row.error.startswith("StopIteration") and row.skipped is None


def test_the_image_folder_is_found_or_its_absence_explained(dataset, tmp_path):
    from dali_pipes.bench.inputs import find_image_folder
    from dali_pipes.dataset.manifest import load_manifest

    manifest = load_manifest(dataset)
    root, reason = find_image_folder(dataset, manifest, None)
    assert root is not None and root.is_dir() and reason is None
    _, reason = find_image_folder(dataset, replace(manifest, source={"kind": "list"}), None)
    assert "'list' source" in reason and "--images" in reason
    _, reason = find_image_folder(
        dataset, replace(manifest, source={"kind": "imagefolder", "root": str(tmp_path / "gone")}), None
    )
    assert "not there any more" in reason
    _, reason = find_image_folder(dataset, manifest, tmp_path / "nope")
    assert "is not a folder" in reason


def test_bench_errors_are_one_line(dataset, tmp_path, capsys):
    from dali_pipes.cli import main

    assert main(["bench", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dali-pipes: error:") and "index.json" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", str(dataset), "--batch-size", "100"]) == 2
    assert "less than one batch of 100" in capsys.readouterr().err


def test_step_costs_are_differences_of_time_per_image():
    from dali_pipes.bench.suites.stages import step_costs, step_differences

    assert step_costs([1000.0, 500.0, 250.0]) == [1.0, 1.0, 2.0]
    # A row next to an unmeasured one has no cost.
    assert step_costs([1000.0, None, 250.0, 200.0]) == [1.0, None, None, 1.0]
    assert step_differences([0.5, 1.25, None, 2.0]) == [0.5, 0.75, None, None]


def test_graph_prefixes_run_the_training_steps_in_order(dataset):
    """The last prefix is the whole spec; earlier ones hand out 1x1 crops of their images."""
    from dali_pipes import ClassificationTrain, DALILoader, RunOptions
    from dali_pipes.bench.suites.stages import GraphPrefix

    spec = ClassificationTrain(size=32)
    cpu = RunOptions(device="cpu")
    steps = len(spec.image_stages(device="cpu"))
    shapes = []
    for k in range(steps + 1):
        loader = DALILoader(dataset, GraphPrefix(spec, k), batch_size=BATCH, run=cpu, seed=3, shuffle=False)
        shapes.append(tuple(next(iter(loader))["image"].shape))
        loader.close()
    assert shapes[0] == (BATCH, 1)  # the encoded lengths
    assert all(shape == (BATCH, 1, 1, 3) for shape in shapes[1:-1])
    assert shapes[-1] == (BATCH, 3, 32, 32)
    whole = DALILoader(dataset, spec, batch_size=BATCH, run=cpu, seed=3, shuffle=False)
    last = DALILoader(dataset, GraphPrefix(spec, steps), batch_size=BATCH, run=cpu, seed=3, shuffle=False)
    # Same seed, same operators in the same order: the whole prefix is the spec itself.
    assert (next(iter(whole))["image"] == next(iter(last))["image"]).all()
    whole.close()
    last.close()


def test_doctor_says_how_long_it_will_take_and_refuses_a_run_over_the_limit(dataset, caplog):
    from dali_pipes.bench.doctor import run_doctor

    with caplog.at_level("INFO", logger="dali_pipes.bench"):
        run_doctor(dataset, model="tiny", batch_size=BATCH, steps=3, quick=True, progress=False)
    assert re.search(r"doctor: about \d+ s \(\d+ training steps of tiny at [\d.]+ s each on the cpu", caplog.text)
    # A limit no real step can meet: refused before any measurement, naming the smaller models.
    with pytest.raises(ValueError, match=r"doctor would take about .* one mobilenet training step of batch 8") as exc:
        run_doctor(dataset, model="mobilenet", batch_size=BATCH, steps=3, quick=True, progress=False, max_minutes=1e-9)
    assert "--model tiny" in str(exc.value) and "--max-minutes" in str(exc.value)


@pytest.mark.slow  # 25 s: doctor's whole run through the command; its estimate and refusal stay in the default suite
def test_doctor_cli_shows_progress_and_the_estimate(dataset):
    # On a terminal the bar counts the steps (no total: the warm-ups run for a time, not a count); in a log, no bar.
    command = [*CLI, "doctor", str(dataset), "--model", "tiny", "--batch-size", str(BATCH), "--steps", "3", "--quick"]
    primary, secondary = pty.openpty()
    # A terminal 100 columns wide: a new pty is 0 x 0, into which tqdm fits an empty bar.
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        on_terminal = subprocess.run(command, stdout=subprocess.PIPE, stderr=secondary, timeout=300)
        os.close(secondary)
        secondary = None
        shown = _read_all(primary)
    finally:
        os.close(primary)
        if secondary is not None:
            os.close(secondary)
    assert on_terminal.returncode == 0, shown
    assert "doctor: about " in shown and re.search(r"doctor: \d+step", shown) and "/" not in shown.split("step")[0], (
        shown
    )
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "doctor: about " in proc.stderr and "step/s" not in proc.stderr, proc.stderr
    refused = subprocess.run(
        [*CLI, "doctor", str(dataset), "--model", "resnet18", "--batch-size", str(BATCH), "--max-minutes", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("dali-pipes: error: doctor would take about ")
    assert "--model mobilenet or tiny" in refused.stderr


def _read_all(fd: int) -> str:
    """Everything written to a pseudo-terminal whose other end is closed."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other end is closed and all was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow  # a search of trials that each train a model: the slow stage
def test_tune_with_a_model_searches_the_training_rate_and_says_the_models_own(dataset, tmp_path):
    # Issue 57: a small model shares the GPU with the decoding, so its loader settings are chosen by the rate of
    # training it; on the CPU the tiny model stands in (the search, the file and the figures are the same).
    proc = subprocess.run(
        [*CLI, "tune", str(dataset), "--quick", "--device", "cpu", "--batch-size", str(BATCH), "--model", "tiny"]
        + ["--size", "32", "--no-progress", "--out", str(tmp_path / "s.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((tmp_path / "s.json").read_text())
    context = saved["context"]
    assert (context["model"], context["size"]) == ("tiny", 32) and context["model_alone_images_per_s"] > 0
    assert saved["measured"]["images_per_s"] > 0 and set(saved["loader"]) == {
        "num_threads",
        "py_num_workers",
        "prefetch",
    }
    assert "training tiny at 32 px" in proc.stdout and "tiny alone (one batch on the device):" in proc.stdout
    fed = float(re.search(r"fed: ([0-9.]+)x", proc.stdout).group(1))
    assert fed == pytest.approx(saved["measured"]["images_per_s"] / context["model_alone_images_per_s"], abs=0.006)
    # A model the benches do not know is refused by name before anything runs.
    bad = subprocess.run([*CLI, "tune", str(dataset), "--model", "vgg"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "vgg" in bad.stderr and "resnet18" in bad.stderr


def test_tune_measures_the_best_and_the_default_again_side_by_side_for_its_gain(dataset):
    # The gain printed ("1.17x the default") once divided figures of groups measured minutes apart (it read 0.77x
    # for a setting chosen as faster); now both are measured again in one last group.
    from dali_pipes.bench.inputs import bench_inputs
    from dali_pipes.bench.runner import Target, TimingPlan
    from dali_pipes.bench.tune import Trial, _Search

    search = _Search(bench_inputs(dataset, batch_size=BATCH), "cpu", TimingPlan.quick(), Target(), False)
    default = Trial({"num_threads": 1, "py_num_workers": 0, "prefetch": 2}, None, images_per_s=1.0)
    best = Trial({"num_threads": 2, "py_num_workers": 0, "prefetch": 2}, None, images_per_s=2.0)
    again_default, again_best = search.against_default(default, best)
    assert search.trials == [again_default, again_best]  # one group, both new trials of the same settings
    assert (again_default.key(), again_best.key()) == (default.key(), best.key())
    assert again_default.images_per_s > 0 and again_best.images_per_s > 0
    assert (again_default.images_per_s, again_best.images_per_s) != (1.0, 2.0)
    assert search.against_default(best, best) == (best, best)  # nothing to compare: nothing measured
    assert len(search.trials) == 2


def test_tune_takes_a_setting_only_when_it_beats_the_incumbent_measured_beside_it():
    from dali_pipes.bench.tune import MARGIN, Trial, choose

    def trial(threads: int, speed: float | None) -> Trial:
        return Trial({"num_threads": threads}, None, images_per_s=speed)

    incumbent = trial(2, 100.0)
    slightly = trial(4, 100.0 * (1 + MARGIN / 2))
    assert choose([slightly, incumbent], incumbent) is incumbent  # within the margin: noise buys no threads
    clearly = trial(4, 100.0 * (1 + 2 * MARGIN))
    assert choose([incumbent, clearly, slightly], incumbent) is clearly
    failed = trial(8, None)
    assert choose([failed, incumbent], incumbent) is incumbent


def test_tune_decoder_only_is_refused_off_the_gpu_naming_the_device(dataset, tmp_path):
    # The decoder hints are the mixed decoder's; on the CPU there would be nothing to search.
    proc = subprocess.run(
        [*CLI, "tune", str(dataset), "--device", "cpu", "--decoder-only", "--out", str(tmp_path / "s.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "--decoder-only" in proc.stderr and "'cpu'" in proc.stderr, proc.stderr
    assert not (tmp_path / "s.json").exists()


def test_bench_rows_measures_only_the_named_rows_and_refuses_unknown_names(dataset, tmp_path):
    # A short lease times the rows it needs: the others are neither opened nor reported.
    # The command's own main in this process (bench_cli runs the console command): the flag as a user writes it.
    from dali_pipes.cli import main

    out = tmp_path / "rows.json"
    command = ["bench", str(dataset), "--quick", "--batch-size", str(BATCH), "--no-progress"]
    assert main([*command, "--rows", "dali-pipes cpu, DALI readers.file cpu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # Two dali-pipes cpu rows (antialias both ways) and the anchor, nothing else.
    assert sorted(row["name"] for row in data["rows"]) == ["DALI readers.file cpu", "dali-pipes cpu", "dali-pipes cpu"]
    assert all(row["images_per_s"] for row in data["rows"])
    assert data["context"]["rows"] == ["dali-pipes cpu", "DALI readers.file cpu"]
    from dali_pipes.bench.suites import run_bench

    with pytest.raises(ValueError, match="no row named 'dali-pipes tpu'.*'dali-pipes gpu'"):
        run_bench(dataset, batch_size=BATCH, quick=True, progress=False, rows=["dali-pipes tpu"])
    with pytest.raises(ValueError, match="--rows applies to the main suite, not to --suite stages"):
        run_bench(dataset, suite="stages", batch_size=BATCH, quick=True, progress=False, rows=["dali-pipes cpu"])


def test_the_gpu_decoder_suite_sets_our_defaults_beside_plain_dali_at_both_decoder_loads(dataset):
    from dali_pipes.bench.suites import run_bench

    report = run_bench(dataset, suite="gpu-decoder", batch_size=BATCH, quick=True, progress=False)
    rows = [(row.name, row.params.get("hw_decoder_load"), row.params.get("py_num_workers")) for row in report.rows]
    defaults = report.rows[2].params["py_num_workers"]
    assert rows[:4] == [
        ("DALI readers.file gpu", 0.65, None),
        ("DALI readers.file gpu", 1.0, None),
        ("dali-pipes gpu", None, defaults),  # the load chosen for the machine
        ("dali-pipes gpu", 0.65, defaults),
    ]
    assert rows[4] == ("dali-pipes gpu", 0.85, defaults)  # both decoders at once
    # The former default of 4 DALI threads, where today's differs (on this machine's cores).
    former = [] if report.rows[2].params["num_threads"] == 4 else [4]
    assert [row.params["num_threads"] for row in report.rows[5 : 5 + len(former)]] == former
    # Reading in the loader's thread and with 8 processes, whichever the defaults are not.
    assert sorted(w for _, _, w in rows[5 + len(former) :]) == sorted({0, 8} - {defaults})
    values = [entry["value"] for entry in report.summary.values()]
    if _cuda():
        assert all(row.timing is not None for row in report.rows), [(r.name, r.error) for r in report.rows]
        assert all(v > 0 for v in values)
    else:
        assert all("CUDA" in (row.skipped or "") for row in report.rows), [r.skipped for r in report.rows]
        assert values == [None, None]


def test_the_rows_take_the_loaders_own_defaults_on_each_device_and_a_tuned_file_on_both(dataset, tmp_path):
    from dali_pipes.bench.inputs import bench_inputs

    inputs = bench_inputs(dataset, batch_size=BATCH, cores=16)
    # LMDB batches: read in the loader's thread on the CPU, by reader processes where the GPU decodes (16 cores).
    assert inputs.settings_for("cpu")["py_num_workers"] == 0
    assert inputs.settings_for("gpu")["py_num_workers"] == 4
    small = bench_inputs(dataset, batch_size=BATCH, cores=2)
    assert small.settings_for("gpu")["py_num_workers"] == 0
    tuned = tmp_path / "tuned.json"
    tuned.write_text(
        json.dumps({"kind": "dali-pipes-settings", "version": 1, "loader": {"py_num_workers": 2, "num_threads": 3}})
    )
    inputs = bench_inputs(dataset, batch_size=BATCH, cores=16, settings=tuned)
    assert (
        inputs.settings_for("cpu")
        == inputs.settings_for("gpu")
        == {"num_threads": 3, "py_num_workers": 2, "prefetch": 2}
    )


def test_repeats_below_one_are_refused_by_the_command_line(dataset, capsys):
    from dali_pipes.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", str(dataset), "--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats: must be at least 1, got 0" in capsys.readouterr().err


def test_without_batch_size_a_small_dataset_gets_a_batch_it_fills_and_is_told_which(
    dataset, imagenet_mini, tmp_path, capsys
):
    # The package's own 47 sample photos were refused at the default batch of 64: the batch was never chosen by the user.
    mini = tmp_path / "mini"
    convert(ImageFolderSource(imagenet_mini), mini, format="lmdb", workers=1, progress=False)
    # One row (the batch is chosen for the whole table): the plain DALI anchor, one pipeline.
    command = ["bench", str(mini), "--quick", "--rows", "DALI readers.file cpu", "--no-progress"]
    proc = subprocess.run([*CLI, *command], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "batch size 32, not the default 64: " in proc.stderr and "holds only 47 samples" in proc.stderr, proc.stderr
    assert "47 samples, batch 32," in proc.stdout, proc.stdout
    # Given explicitly, a batch the dataset cannot fill is still refused, naming the flag (the command's own
    # main, in this process: the refusal comes before anything runs).
    from dali_pipes.cli import main

    capsys.readouterr()
    assert main([*command, "--batch-size", "64"]) == 2
    refusal = capsys.readouterr().err
    assert "less than one batch of 64; use a smaller --batch-size" in refusal, refusal
    from dali_pipes.bench.inputs import fitting_batch_size

    assert [fitting_batch_size(dataset, n) for n in (1, 2, 47, 63, 64, 1000)] == [1, 2, 32, 32, 64, 64]
