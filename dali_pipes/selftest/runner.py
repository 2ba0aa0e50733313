"""``dali-pipes selftest``: does every pipeline run on this machine, on each of its devices?

The first thing to run on a new machine or cluster node. On small datasets made
at run time (:mod:`dali_pipes.selftest.data`), it runs every pipeline spec
(classification train and val, auto-augment, the recipe graph: a resolution
schedule with RandomErasing and MixUp/CutMix, detection, instance and semantic
segmentation train and val, features)
through the real :class:`~dali_pipes.DALILoader` on each device, with 0 and with
1 Python worker, for two epochs; checks the outputs (shape, dtype, device, value
range, ``is_pad`` and that every sample comes once, boxes inside the image,
feature values equal to the stored ones); reports the versions that matter and
a short throughput figure per row (the second epoch: tiny images, so a sign of
life, not a benchmark). Every failure names the spec, device, worker count and
step, with DALI's message.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dali_pipes.dataset.fileio import atomic_write_json
from dali_pipes.selftest.checks import check_batch
from dali_pipes.selftest.data import CATEGORY_IDS, CLASSES, SampleData, make_sample_data

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "gpu")
BATCH_SIZE = 5  # 12 samples: two full batches and a padded one, so is_pad is exercised
WORKER_COUNTS = (0, 1)
SPEC_NAMES = (
    "classification-train",
    "classification-val",
    "auto-augment",
    "recipe",
    "detection-train",
    "detection-val",
    "instance-train",
    "instance-val",
    "semantic-train",
    "semantic-val",
    "features",
)


@dataclass
class Row:
    """One spec on one device with one worker count: passed, failed (where and why) or skipped (why)."""

    spec: str
    device: str
    workers: int | None
    status: str  # "ok", "failed" or "skipped"
    step: str | None = None  # where it failed: "build", "epoch 1", "check", "epoch 2"
    message: str = ""
    images_per_s: float | None = None

    @property
    def line(self) -> str:
        """The row as one line of the report."""
        where = f"{self.spec:<21} {self.device:<4} workers={'-' if self.workers is None else self.workers}"
        if self.status == "ok":
            return f"ok      {where}  {self.images_per_s:9.1f} samples/s"
        if self.status == "skipped":
            return f"skipped {where}  {self.message}"
        return f"FAILED  {where}  at {self.step}: {self.message}"


@dataclass
class SelftestReport:
    """What ``dali-pipes selftest`` found: the machine's versions and one :class:`Row` per run."""

    versions: dict[str, Any]
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no row failed (skipped rows, such as the GPU's on a CPU-only machine, do not fail)."""
        return all(row.status != "failed" for row in self.rows)

    @property
    def lines(self) -> list[str]:
        """The report, one line each: versions, then rows, then the verdict."""
        out = [f"{name:<16} {value}" for name, value in self.versions.items()]
        out += [row.line for row in self.rows]
        failed = sum(row.status == "failed" for row in self.rows)
        out.append("selftest passed" if self.passed else f"selftest FAILED: {failed} of {len(self.rows)} rows")
        return out

    def as_json(self) -> dict[str, Any]:
        """Everything in the report, for ``--json``."""
        return {
            "passed": self.passed,
            "versions": self.versions,
            "rows": [asdict(row) for row in self.rows],
            "lines": self.lines,
        }


def run_selftest(
    device: str = "auto", *, workdir: str | os.PathLike | None = None, json_out: str | os.PathLike | None = None
) -> SelftestReport:
    """Run every spec on ``device`` (``auto``: the CPU, and the GPU when there is one) and report.

    ``workdir`` keeps the sample datasets (default: a temporary folder, removed after).
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    report = SelftestReport(versions=machine_versions())
    with tempfile.TemporaryDirectory(prefix="dali-pipes-selftest-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        log.info("selftest: making the sample datasets in %s", root)
        data = make_sample_data(root)
        for name in SPEC_NAMES:
            for dev in _devices(device):
                report.rows += _run_spec(name, dev, data, asked_for_gpu=device == "gpu")
    for line in report.lines:
        log.debug(line)
    if json_out is not None:
        atomic_write_json(Path(json_out), report.as_json())
    return report


def machine_versions() -> dict[str, Any]:
    """DALI, torch, the CUDA driver and runtime, the GPU and whether it has a hardware JPEG decoder."""
    import nvidia.dali as dali
    import torch
    from nvidia.dali import backend

    cuda = torch.cuda.is_available()
    driver = int(backend.GetCudaVersion()) if cuda else 0
    versions: dict[str, Any] = {
        "dali": dali.__version__,
        "dali_cuda_build": _cuda_version(getattr(dali, "__cuda_version__", 0)),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,  # the CUDA runtime torch was built with
        "cuda_driver": _cuda_version(driver) if driver else None,
        "gpu": torch.cuda.get_device_name(torch.cuda.current_device()) if cuda else None,
        "hw_jpeg_decoder": None,
        "cpu_cores": os.cpu_count(),
    }
    if cuda:
        from dali_pipes.settings import has_hw_decoder

        versions["hw_jpeg_decoder"] = has_hw_decoder()
    return versions


def _cuda_version(number: int) -> str | None:
    """CUDA's integer version (12040) as text (``12.4``)."""
    number = int(number or 0)
    return f"{number // 1000}.{number % 1000 // 10}" if number else None


def _devices(device: str) -> list[str]:
    return ["cpu", "gpu"] if device == "auto" else [device]


def _spec(name: str) -> Any:
    from dali_pipes import pipelines as p
    from dali_pipes.pipelines import (
        ClassificationTrain,
        ClassificationVal,
        Detection,
        DetectionVal,
        Features,
        Mix,
        RandomErasing,
    )

    # Const erasing: its fill (0) stays inside the normalised range the checks expect; noise would not.
    recipe = dict(mix=Mix(mixup_alpha=0.8, cutmix_alpha=1.0, mode="elem"), erasing=RandomErasing(prob=0.5))
    return {
        "instance-train": lambda: p.InstanceSegmentation(size=(48, 64)),
        "instance-val": lambda: p.InstanceSegmentationVal(size=40, max_size=64),
        "semantic-train": lambda: p.SemanticSegmentation(size=(48, 64), scale=(0.3, 1.5)),
        "semantic-val": lambda: p.SemanticSegmentationVal(size=40),
        "classification-train": lambda: ClassificationTrain(size=32),
        "classification-val": lambda: ClassificationVal(size=32, resize=36),
        "auto-augment": lambda: ClassificationTrain(size=32, auto_augment="rand_augment", dtype="float16"),
        "recipe": lambda: ClassificationTrain(size=(32, 64, 0, 1), **recipe),
        "detection-train": lambda: Detection(size=(48, 64)),
        "detection-val": lambda: DetectionVal(size=40, max_size=64),
        "features": lambda: Features(fields=("features", "label")),
    }[name]()


def _dataset(name: str, data: SampleData) -> Path:
    if name.startswith("detection"):
        return data.detection
    if name.startswith(("instance", "semantic")):
        return data.instance if name.startswith("instance") else data.semantic
    return data.features if name == "features" else data.classification


def _run_spec(name: str, device: str, data: SampleData, *, asked_for_gpu: bool) -> list[Row]:
    import torch

    if device == "gpu" and not torch.cuda.is_available():
        if asked_for_gpu:  # --device gpu on a node whose GPU torch cannot see: that is the finding
            return [Row(name, "gpu", None, "failed", "device", "no CUDA: torch.cuda.is_available() is False")]
        return [Row(name, "gpu", None, "skipped", message="skipped: no CUDA")]
    if _dataset(name, data) is None:
        return [Row(name, device, None, "skipped", message="skipped: pycocotools is not installed (dali-pipes[coco])")]
    return [_run_one(name, device, workers, data) for workers in WORKER_COUNTS]


def _run_one(name: str, device: str, workers: int, data: SampleData) -> Row:
    """One spec, device and worker count through the real loader: build, an epoch checked, an epoch timed."""
    from dali_pipes.loading.compat import BatchFormat
    from dali_pipes.loading.config import RunOptions
    from dali_pipes.loading.loader import DALILoader

    row = Row(name, device, workers, "failed")
    loader = None
    try:
        row.step = "build"
        loader = DALILoader(
            _dataset(name, data),
            _spec(name),
            batch_size=BATCH_SIZE,
            seed=1,
            batch_format=BatchFormat(with_index=True),
            run=RunOptions(device=device, py_num_workers=workers, num_threads=2),
        )
        row.step = "epoch 1"
        batches = [_to_host(batch) | {"_device": _devices_of(batch)} for batch in loader]
        row.step = "check"
        problem = check_batches(name, device, batches, len(loader.store), data, loader.pipeline)
        if problem:
            row.message = problem
            return row
        row.step = "epoch 2"
        row.images_per_s = _timed_epoch(loader)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row that names spec, device and step
        row.message = f"{type(exc).__name__}: {exc}"
        log.debug("selftest: %s on %s with %d workers failed", name, device, workers, exc_info=True)
        return row
    finally:
        if loader is not None:
            loader.close()
    row.status, row.step = "ok", None
    return row


def _timed_epoch(loader: Any) -> float:
    start, samples = time.perf_counter(), 0
    for batch in loader:
        samples += int((~batch["is_pad"].bool()).sum())
    return samples / (time.perf_counter() - start)


def _devices_of(batch: dict[str, Any]) -> dict[str, str]:
    return {name: value.device.type for name, value in batch.items()}


def _to_host(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: value.cpu().numpy() for name, value in batch.items()}


def check_batches(
    name: str, device: str, batches: list[dict[str, Any]], num_samples: int, data: SampleData, spec: Any
) -> str | None:
    """The first thing wrong with an epoch's batches, or ``None``: every sample once, then each batch's outputs."""
    expected_device = "cuda" if device == "gpu" else "cpu"
    seen: list[int] = []
    for number, batch in enumerate(batches):
        devices = batch.pop("_device")
        wrong = {out: dev for out, dev in devices.items() if dev != expected_device}
        if wrong:
            return f"batch {number}: outputs on the wrong device {wrong} (expected {expected_device})"
        pad = batch["is_pad"]
        if pad.dtype != np.bool_:
            return f"batch {number}: is_pad has dtype {pad.dtype}, expected bool"
        seen += [int(i) for i in batch["index"][~pad]]
        problem = check_batch(name, batch, spec, data, classes=CLASSES, categories=len(CATEGORY_IDS))
        if problem:
            return f"batch {number}: {problem}"
    if sorted(seen) != list(range(num_samples)):
        return f"the epoch's samples (is_pad false) are not each of the {num_samples} samples once: {sorted(seen)}"
    return None


def format_lines(report: SelftestReport, emit: Callable[[str], None]) -> None:
    """Hand each line of the report to ``emit`` (``print`` in the CLI)."""
    for line in report.lines:
        emit(line)
