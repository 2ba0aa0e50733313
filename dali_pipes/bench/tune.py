"""``dali-pipes tune``: find the fastest loader settings on this machine, and save them for ``DALILoader``.

A short coordinate search from the benchmark's default settings: each of
``num_threads``, ``py_num_workers`` and ``prefetch`` in turn (and, on a GPU with a
hardware JPEG decoder, the decoder's ``hw_decoder_load``) takes the value with
the highest median images/s, keeping the others fixed. A change is taken only
when it is faster by more than :data:`MARGIN`, so noise does not buy threads.

This module only searches and writes the file (JSON, ``kind: dali-pipes-settings``);
reading it (:func:`~dali_pipes.settings.load_settings`,
:func:`~dali_pipes.settings.apply_settings`) lives in :mod:`dali_pipes.settings`,
below the loader. It imports no DALI or torch at the top.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dali_pipes.bench.streams import dali_in_flight
from dali_pipes.dataset.fileio import atomic_write_json
from dali_pipes.dataset.progress import bar_disabled

# Reading the file lives below the loader, in dali_pipes.settings; these names stay importable from here.
from dali_pipes.settings import HW_DECODER_GPUS as HW_DECODER_GPUS
from dali_pipes.settings import LOADER_KEYS, SETTINGS_KIND, SETTINGS_VERSION, has_hw_decoder
from dali_pipes.settings import apply_settings as apply_settings
from dali_pipes.settings import decoder_settings as decoder_settings
from dali_pipes.settings import load_settings as load_settings

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
) -> TuneResult:
    """Search the loader settings for the highest images/s on this machine (see the module docstring)."""
    from tqdm import tqdm

    from dali_pipes.bench.inputs import bench_inputs
    from dali_pipes.bench.report import machine_description
    from dali_pipes.bench.runner import Job, Target, TimingPlan, measure
    from dali_pipes.bench.streams import dali_loader_stream
    from dali_pipes.loading.loader import resolve_device

    inputs = bench_inputs(dataset, batch_size=batch_size, dtype=dtype)
    device, _ = resolve_device(device, int(os.environ.get("LOCAL_RANK") or 0))
    target = Target()
    plan = TimingPlan.quick() if quick else TimingPlan(warmup_batches=3, repeats=3, min_batches=5, min_seconds=1.0)
    space = candidates(inputs.cores, quick)
    loads, notes = _decoder_loads(device, quick)
    done: dict[tuple, Trial] = {}
    total = sum(len(v) for v in space.values()) + len(loads) + (1 if device == "gpu" else 0)
    bar = tqdm(total=total, desc="tune", unit="trial", disable=bar_disabled(progress), leave=False)

    def run(settings: dict[str, int], load: float | None, fancy: bool | None = None) -> Trial:
        trial = Trial(dict(settings), load, fancy)
        if trial.key() in done:
            return done[trial.key()]
        spec = inputs.spec
        if trial.decoder():
            spec = dataclasses.replace(spec, decoder=dataclasses.replace(spec.decoder, **trial.decoder()))

        def factory():
            return dali_loader_stream(
                inputs.dataset, spec, batch_size=batch_size, device=device, target=target, settings=settings
            )

        bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in {**settings, **trial.decoder()}.items()))
        row = measure(Job("tune", factory, in_flight=dali_in_flight(settings)), plan, target)
        trial.images_per_s = row.images_per_s
        trial.spread = row.timing.spread if row.timing else None
        trial.error = row.error or row.skipped
        done[trial.key()] = trial
        bar.update(1)
        return trial

    try:
        start = {k: inputs.loader_settings[k] for k in LOADER_KEYS}
        default = best = run(start, None if not loads else inputs.spec.decoder.hw_decoder_load)
        if default.images_per_s is None:
            raise ValueError(f"{dataset}: the loader failed with its default settings: {default.error}")
        for name, values in space.items():
            for value in values:
                trial = run({**best.settings, name: value}, best.hw_decoder_load)
                if _better(trial, best):
                    best = trial
        for load in loads:
            trial = run(best.settings, load)
            if _better(trial, best):
                best = trial
        if device == "gpu":
            # Chroma upsampling as libjpeg-turbo does it (on) or nvJPEG's own (off): measured both ways, since
            # whether the decoders keep their fast paths with it on depends on the nvJPEG version.
            fancy = inputs.spec.decoder.jpeg_fancy_upsampling
            trial = run(best.settings, best.hw_decoder_load, not fancy)
            if _better(trial, best):
                best = trial
    finally:
        bar.close()
    context = {**inputs.describe(), "device": device, "quick": quick, "search": space, "hw_decoder_loads": loads}
    return TuneResult(best, default, list(done.values()), context, machine_description(), notes)


def _decoder_loads(device: str, quick: bool) -> tuple[list[float], list[str]]:
    """The ``hw_decoder_load`` values to try on ``device``, and a note where none are."""
    if device == "gpu" and has_hw_decoder():
        return ([0.0, 0.65, 1.0] if quick else [0.0, 0.25, 0.5, 0.65, 0.75, 0.9, 1.0]), []
    if device == "gpu":
        return [], ["hw_decoder_load not searched: this GPU has no hardware JPEG decoder (A100, H100 and later do)"]
    return [], ["hw_decoder_load not searched: it applies to the GPU decoder only"]


def _better(candidate: Trial, incumbent: Trial) -> bool:
    if candidate.images_per_s is None or incumbent.images_per_s is None:
        return False
    return candidate.images_per_s > incumbent.images_per_s * (1 + MARGIN)


def save_settings(result: TuneResult, path: str | os.PathLike) -> Path:
    """Write the tuned settings file that :func:`load_settings` reads."""
    return atomic_write_json(path, result.to_json())


def format_tune(result: TuneResult, saved: Path | None = None) -> str:
    """What ``dali-pipes tune`` prints: every trial, then the best and how much it gains."""
    lines = [
        f"tuning {result.context['dataset']} on {result.context['device']}, batch {result.context['batch_size']}, "
        f"{result.context['cores']} cores"
    ]
    for trial in result.trials:
        setting = " ".join(f"{k}={v}" for k, v in {**trial.settings, **trial.decoder()}.items())
        figure = (
            f"{trial.images_per_s:10.1f} images/s ±{100 * (trial.spread or 0):.0f}%"
            if trial.images_per_s
            else f"failed: {trial.error}"
        )
        mark = "  <- best" if trial is result.best else ""
        lines.append(f"  {setting:<58} {figure}{mark}")
    best = " ".join(f"{k}={v}" for k, v in {**result.best.settings, **result.best.decoder()}.items())
    gain = f" ({result.speedup:.2f}x the default)" if result.speedup else ""
    lines.append(f"fastest: {best}: {result.best.images_per_s:.1f} images/s{gain}")
    lines.extend(result.notes)
    if saved is not None:
        lines.append(
            f"saved to {saved}; use it with DALILoader(path, spec, batch_size=..., **load_settings({str(saved)!r}))"
        )
    return "\n".join(lines)
