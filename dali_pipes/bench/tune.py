"""``dali-pipes tune``: find the fastest loader settings on this machine, and save them for ``DALILoader``.

A short coordinate search from the benchmark's default settings: each of
``num_threads``, ``py_num_workers`` and ``prefetch`` in turn (and, on a GPU with a
hardware JPEG decoder, the decoder's ``hw_decoder_load``) takes the value with
the highest median images/s, keeping the others fixed. The values of one setting
are measured side by side (:mod:`dali_pipes.bench.interleave`), the current best
among them, so a change of the machine's load during the search does not pick
the winner. A change is taken only when it is faster by more than
:data:`MARGIN`, so noise does not buy threads.

With a model (``dali-pipes tune DATA --model resnet18 --size 160``) each trial trains that model on the
loader's batches (the train suite's step: :func:`~dali_pipes.bench.suites.train.training_stream`) and the
search keeps the settings with the highest *training* rate: a small model on a GPU shares the GPU with
the loader's decoding, and the loader's fastest settings alone need not be the fastest to train with.
The model's own rate (one batch already on the device) is measured at the end, beside the best and the
default settings, which are measured again there: the gain over the default and the share of the model's rate
the loader feeds are then ratios of one run, not of groups measured minutes apart.

This module only searches and writes the file (JSON, ``kind: dali-pipes-settings``);
reading it (:func:`~dali_pipes.settings.load_settings`,
:func:`~dali_pipes.settings.apply_settings`) lives in :mod:`dali_pipes.settings`,
below the loader. It imports no DALI or torch at the top.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dali_pipes.bench.streams import dali_in_flight
from dali_pipes.dataset.fileio import atomic_write_json
from dali_pipes.settings import LOADER_KEYS, SETTINGS_KIND, SETTINGS_VERSION, has_hw_decoder

log = logging.getLogger(__name__)

#: A candidate must beat the incumbent by this fraction to be taken.
MARGIN = 0.03


@dataclass
class Trial:
    """One measured setting: the loader keyword arguments, the decoder load, and the figure or the error."""

    settings: dict[str, int]
    hw_decoder_load: float | None
    jpeg_fancy_upsampling: bool | None = None
    images_per_s: float | None = None
    spread: float | None = None
    cpu_seconds_per_1k: float | None = None
    error: str | None = None

    def key(self) -> tuple:
        return (tuple(sorted(self.settings.items())), self.hw_decoder_load, self.jpeg_fancy_upsampling)

    def decoder(self) -> dict[str, Any]:
        """The decoder hints this trial set (none on the CPU)."""
        hints: dict[str, Any] = {}
        if self.hw_decoder_load is not None:
            hints["hw_decoder_load"] = self.hw_decoder_load
        if self.jpeg_fancy_upsampling is not None:
            hints["jpeg_fancy_upsampling"] = self.jpeg_fancy_upsampling
        return hints


@dataclass
class TuneResult:
    """The search: the best setting, the default it started from, and every trial."""

    best: Trial
    default: Trial
    trials: list[Trial]
    context: dict[str, Any]
    machine: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        if self.best.images_per_s and self.default.images_per_s:
            return self.best.images_per_s / self.default.images_per_s
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": SETTINGS_KIND,
            "version": SETTINGS_VERSION,
            "loader": dict(self.best.settings),
            "decoder": self.best.decoder(),
            "measured": {
                "images_per_s": self.best.images_per_s,
                "spread": self.best.spread,
                "default": dataclasses.asdict(self.default),
                "speedup_over_default": self.speedup,
            },
            "context": self.context,
            "machine": self.machine,
            "trials": [dataclasses.asdict(t) for t in self.trials],
            "notes": list(self.notes),
        }


def candidates(cores: int, quick: bool) -> dict[str, list[int]]:
    """The values tried for each loader setting on ``cores`` cores."""
    if quick:
        return {"num_threads": sorted({1, cores}), "py_num_workers": [0, 1], "prefetch": [1, 2]}
    return {
        "num_threads": sorted({1, max(1, cores // 2), cores, 2 * cores}),
        "py_num_workers": sorted({0, 1, 2, max(1, cores // 4), max(1, cores // 2)}),
        "prefetch": [1, 2, 3, 4],
    }


def tune(
    dataset: str | os.PathLike,
    *,
    batch_size: int = 64,
    quick: bool = False,
    device: str = "auto",
    dtype: str = "float32",
    progress: bool = True,
    decoder_only: bool = False,
    model: TrainedModel | None = None,
) -> TuneResult:
    """Search the loader settings for the highest images/s on this machine (see the module docstring).

    ``decoder_only`` keeps the loader settings as they are and searches only the GPU
    decoder's hints: a few minutes less where the settings are known. ``model``: the images/s of training
    it at its size on the loader's batches, not of the loader alone.
    """
    from dali_pipes.bench.inputs import bench_inputs
    from dali_pipes.bench.report import machine_description
    from dali_pipes.bench.runner import Target, TimingPlan
    from dali_pipes.loading.world import resolve_device

    device, _ = resolve_device(device, int(os.environ.get("LOCAL_RANK") or 0))
    if decoder_only and device != "gpu":
        raise ValueError(f"tune --decoder-only searches the GPU decoder's hints; the device here is {device!r}")
    inputs = bench_inputs(dataset, batch_size=batch_size, dtype=dtype)
    inputs = inputs if model is None else dataclasses.replace(inputs, spec=model.resized(inputs.spec))
    plan = TimingPlan.quick() if quick else TimingPlan(warmup_batches=3, repeats=3, min_batches=5, min_seconds=1.0)
    space = {} if decoder_only else candidates(inputs.cores, quick)
    loads, notes = _decoder_loads(device, quick)
    search = _Search(inputs, device, plan, Target(), progress, model)
    start = {k: inputs.settings_for(device)[k] for k in LOADER_KEYS}
    # The load the spec would choose for the starting threads, pinned: left to choose per trial, it would change
    # with num_threads during the search and be credited to the thread count.
    start_load = inputs.spec.decoder.chosen_load(threads=start["num_threads"], hw_decoder=True)[0] if loads else None
    default = search.best_of([Trial(start, start_load)])
    if default.images_per_s is None:
        raise ValueError(f"{dataset}: the loader failed with its default settings: {default.error}")
    best = default
    for name, values in space.items():
        best = search.best_of([Trial({**best.settings, name: v}, best.hw_decoder_load) for v in values], best)
    if loads:
        best = search.best_of([Trial(best.settings, load) for load in loads], best)
    if device == "gpu":
        # Chroma upsampling as libjpeg-turbo does it (on) or nvJPEG's own (off): measured both ways, since
        # whether the decoders keep their fast paths with it on depends on the nvJPEG version. The default
        # (None) has it on for whole-image decodes only, so the other way to try is on everywhere.
        fancy = inputs.spec.decoder.jpeg_fancy_upsampling
        best = search.best_of([Trial(best.settings, best.hw_decoder_load, True if fancy is None else not fancy)], best)
    default, best = search.against_default(default, best, alone=model is not None)
    context = {
        **inputs.describe(),
        "device": device,
        "quick": quick,
        "decoder_only": decoder_only,
        "search": space,
        "hw_decoder_loads": loads,
        **(search.model_context() if model is not None else {}),
    }
    return TuneResult(best, default, search.trials, context, machine_description(), notes)


@dataclass(frozen=True)
class TrainedModel:
    """What ``tune --model NAME --size PX`` trains on each trial's batches: a model of
    :data:`~dali_pipes.bench.model_names.MODELS` at ``size`` pixels."""

    name: str
    size: int

    def resized(self, spec: Any) -> Any:
        """``spec`` at this model's training size."""
        return dataclasses.replace(spec, size=self.size)


class _Search:
    """Measures groups of trials side by side (each group in one run, so their figures compare)."""

    def __init__(
        self, inputs: Any, device: str, plan: Any, target: Any, progress: bool, model: TrainedModel | None = None
    ) -> None:
        self.inputs, self.device, self.plan, self.target, self.progress = inputs, device, plan, target, progress
        self.model = model
        self.trials: list[Trial] = []
        self.model_alone: float | None = None  # the model's own images/s (measured beside the best and the default)

    def best_of(self, group: list[Trial], incumbent: Trial | None = None) -> Trial:
        """Measure ``group`` side by side; the fastest, or ``incumbent``'s setting unless beaten by :data:`MARGIN`.

        The incumbent's own setting is measured again in the group (added when missing), so the
        comparison is between figures of one run, not against a figure from an earlier, other load.
        """
        unique = {trial.key(): trial for trial in group}
        if incumbent is not None:
            unique.setdefault(incumbent.key(), _again(incumbent))
        group = list(unique.values())
        self._measure(group)
        return choose(group, unique[incumbent.key()] if incumbent is not None else group[0])

    def against_default(self, default: Trial, best: Trial, alone: bool = False) -> tuple[Trial, Trial]:
        """``default`` and ``best`` measured again side by side (``alone``: the model on one batch already on the
        device beside them), so the gain over the default and the share of the model's rate fed are ratios of one
        run; as they were when the best is the default (and no model), or when a figure fails this time."""
        if best.key() == default.key() and not alone:
            return default, best
        pair = [_again(default)] + ([_again(best)] if best.key() != default.key() else [])
        self._measure(pair, alone)
        if any(trial.images_per_s is None for trial in pair):
            return default, best
        return pair[0], pair[-1]

    def _measure(self, group: list[Trial], alone: bool = False) -> None:
        """Fill in the figures of ``group``'s trials, measured side by side (with the model alone: ``alone``)."""
        from dali_pipes.bench.interleave import run_jobs

        jobs = [self._job(t) for t in group] + ([self._job(None)] if alone else [])
        rows = run_jobs(jobs, self.plan, self.target, progress=self.progress, title="tune")
        if alone:
            self.model_alone = rows.pop().images_per_s
        for trial, row in zip(group, rows):
            trial.images_per_s = row.images_per_s
            trial.spread = row.timing.spread if row.timing else None
            trial.cpu_seconds_per_1k = row.timing.cpu_seconds_per_1k if row.timing else None
            trial.error = row.error or row.skipped
        self.trials.extend(group)

    def model_context(self) -> dict[str, Any]:
        """What the JSON's context says of the model trained: its name, size and own rate."""
        assert self.model is not None
        return {"model": self.model.name, "size": self.model.size, "model_alone_images_per_s": self.model_alone}

    def _job(self, trial: Trial | None) -> Any:
        """The job of ``trial``: its loader's batches, trained on when a model is searched for (``None``: the
        model alone, on one batch already on the device)."""
        from dali_pipes.bench.runner import Job
        from dali_pipes.bench.streams import dali_batches, dali_loader_stream

        spec, settings = self.inputs.spec, dict(trial.settings) if trial is not None else {}
        if trial is not None and trial.decoder():
            spec = dataclasses.replace(spec, decoder=dataclasses.replace(spec.decoder, **trial.decoder()))
        options = dict(batch_size=self.inputs.batch_size, device=self.device, settings=settings)
        if self.model is None:
            factory = functools.partial(dali_loader_stream, self.inputs.dataset, spec, target=self.target, **options)
            return Job("tune", factory, in_flight=dali_in_flight(settings), runs_dali=True)
        from dali_pipes.bench.suites.train import training_stream

        batches = None if trial is None else functools.partial(dali_batches, self.inputs.dataset, spec, **options)
        num_classes = len(self.inputs.manifest.classes or ()) or 1000
        name = self.model.name
        factory = functools.partial(training_stream, batches, name, num_classes, self.inputs, self.target)
        in_flight = dali_in_flight(settings) if trial is not None else 0
        return Job("tune", factory, in_flight=in_flight, runs_dali=trial is not None)


def _again(trial: Trial) -> Trial:
    """A new, unmeasured trial of ``trial``'s setting (to measure it again beside others)."""
    return Trial(dict(trial.settings), *trial.key()[1:])


def _decoder_loads(device: str, quick: bool) -> tuple[list[float], list[str]]:
    """The ``hw_decoder_load`` values to try on ``device``, and a note where none are."""
    if device == "gpu" and has_hw_decoder():
        return ([0.0, 0.65, 1.0] if quick else [0.0, 0.25, 0.5, 0.65, 0.75, 0.9, 1.0]), []
    if device == "gpu":
        return [], ["hw_decoder_load not searched: this GPU has no hardware JPEG decoder (A100, H100 and later do)"]
    return [], ["hw_decoder_load not searched: it applies to the GPU decoder only"]


def choose(group: list[Trial], incumbent: Trial) -> Trial:
    """The fastest trial of ``group`` if it beats ``incumbent`` (a member) by more than :data:`MARGIN`, else ``incumbent``."""
    fastest = max(group, key=lambda t: t.images_per_s or 0.0)
    return fastest if _better(fastest, incumbent) else incumbent


def _better(candidate: Trial, incumbent: Trial) -> bool:
    if candidate.images_per_s is None or incumbent.images_per_s is None:
        return False
    return candidate.images_per_s > incumbent.images_per_s * (1 + MARGIN)


def save_settings(result: TuneResult, path: str | os.PathLike) -> Path:
    """Write the tuned settings file that :func:`dali_pipes.settings.load_settings` reads."""
    return atomic_write_json(path, result.to_json())


def format_tune(result: TuneResult, saved: Path | None = None) -> str:
    """What ``dali-pipes tune`` prints: every trial, then the best and how much it gains."""
    context = result.context
    trained = f", training {context['model']} at {context['size']} px" if "model" in context else ""
    lines = [
        f"tuning {context['dataset']} on {context['device']}, batch {context['batch_size']}, {context['cores']} "
        f"cores{trained}"
    ]
    for trial in result.trials:
        setting = " ".join(f"{k}={v}" for k, v in {**trial.settings, **trial.decoder()}.items())
        cost = f", {trial.cpu_seconds_per_1k:.2f} CPU s/1k" if trial.cpu_seconds_per_1k is not None else ""
        figure = (
            f"{trial.images_per_s:10.1f} images/s ±{100 * (trial.spread or 0):.0f}%{cost}"
            if trial.images_per_s
            else f"failed: {trial.error}"
        )
        mark = "  <- best" if trial is result.best else ""
        lines.append(f"  {setting:<58} {figure}{mark}")
    best = " ".join(f"{k}={v}" for k, v in {**result.best.settings, **result.best.decoder()}.items())
    gain = f" ({result.speedup:.2f}x the default)" if result.speedup else ""
    lines.append(f"fastest: {best}: {result.best.images_per_s:.1f} images/s{gain}")
    alone = context.get("model_alone_images_per_s")
    if alone:
        share = result.best.images_per_s / alone if result.best.images_per_s else 0.0
        lines.append(f"{context['model']} alone (one batch on the device): {alone:.1f} images/s; fed: {share:.2f}x")
    lines.extend(result.notes)
    if saved is not None:
        lines.append(
            f"saved to {saved}; use it with DALILoader(path, spec, batch_size=..., run=RunOptions(settings={str(saved)!r}))"
        )
    return "\n".join(lines)
