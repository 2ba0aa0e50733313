"""``dali-pipes tune``: find the fastest loader settings on this machine, and save them for ``DALILoader``.

A short coordinate search from the benchmark's default settings: each of
``num_threads``, ``py_num_workers`` and ``prefetch`` in turn (and, on a GPU with a
hardware JPEG decoder, the decoder's ``hw_decoder_load``) takes the value with
the highest median images/s, keeping the others fixed. A change is taken only
when it is faster by more than :data:`MARGIN`, so noise does not buy threads.

The saved file (JSON, ``kind: dali-pipes-settings``)::

    loader = DALILoader("shards/train", spec, batch_size=256, **load_settings("settings.json"))
    spec = apply_settings(ClassificationTrain(size=224), "settings.json")   # hw_decoder_load, if tuned

:func:`load_settings` returns only ``DALILoader`` keyword arguments, so it can be
spread into the call; the decoder hint belongs to the spec (:func:`apply_settings`).
This module imports no DALI or torch at the top: reading a settings file is cheap.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dali_pipes._fileio import atomic_write_json
from dali_pipes.bench.streams import dali_in_flight

log = logging.getLogger(__name__)

SETTINGS_KIND = "dali-pipes-settings"
SETTINGS_VERSION = 1
#: ``DALILoader`` keyword arguments a settings file may hold, with their smallest valid value.
LOADER_KEYS: dict[str, int] = {"num_threads": 1, "py_num_workers": 0, "prefetch": 1}
#: A candidate must beat the incumbent by this fraction to be taken.
MARGIN = 0.03
#: GPUs with nvJPEG's hardware decoder (a name match: CUDA does not report the engine).
HW_DECODER_GPUS = ("A100", "A800", "A30", "H100", "H200", "H800", "H20", "GH200", "B100", "B200", "GB200")


@dataclass
class Trial:
    """One measured setting: the loader keyword arguments, the decoder load, and the figure or the error."""

    settings: dict[str, int]
    hw_decoder_load: float | None
    images_per_s: float | None = None
    spread: float | None = None
    error: str | None = None

    def key(self) -> tuple:
        return (tuple(sorted(self.settings.items())), self.hw_decoder_load)


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
            "decoder": {} if self.best.hw_decoder_load is None else {"hw_decoder_load": self.best.hw_decoder_load},
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


def has_hw_decoder() -> bool:
    """True on a CUDA GPU known to carry the hardware JPEG decoder."""
    import torch

    if not torch.cuda.is_available():
        return False
    name = torch.cuda.get_device_name(torch.cuda.current_device())
    return any(model in name for model in HW_DECODER_GPUS)


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
    from dali_pipes.loader import resolve_device

    inputs = bench_inputs(dataset, batch_size=batch_size, dtype=dtype)
    device, _ = resolve_device(device, int(os.environ.get("LOCAL_RANK") or 0))
    target = Target()
    plan = TimingPlan.quick() if quick else TimingPlan(warmup_batches=3, repeats=3, min_batches=5, min_seconds=1.0)
    space = candidates(inputs.cores, quick)
    notes: list[str] = []
    loads: list[float] = []
    if device == "gpu" and has_hw_decoder():
        loads = [0.0, 0.65, 1.0] if quick else [0.0, 0.25, 0.5, 0.65, 0.75, 0.9, 1.0]
    elif device == "gpu":
        notes.append("hw_decoder_load not searched: this GPU has no hardware JPEG decoder (A100, H100 and later do)")
    else:
        notes.append("hw_decoder_load not searched: it applies to the GPU decoder only")
    done: dict[tuple, Trial] = {}
    total = sum(len(v) for v in space.values()) + len(loads)
    bar = tqdm(total=total, desc="tune", unit="trial", disable=not progress, leave=False)

    def run(settings: dict[str, int], load: float | None) -> Trial:
        trial = Trial(dict(settings), load)
        if trial.key() in done:
            return done[trial.key()]
        spec = inputs.spec
        if load is not None:
            spec = dataclasses.replace(spec, decoder=dataclasses.replace(spec.decoder, hw_decoder_load=load))

        def factory():
            return dali_loader_stream(
                inputs.dataset, spec, batch_size=batch_size, device=device, target=target, settings=settings
            )

        bar.set_postfix_str(
            " ".join(f"{k}={v}" for k, v in settings.items()) + (f" hw={load}" if load is not None else "")
        )
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
    finally:
        bar.close()
    context = {**inputs.describe(), "device": device, "quick": quick, "search": space, "hw_decoder_loads": loads}
    return TuneResult(best, default, list(done.values()), context, machine_description(), notes)


def _better(candidate: Trial, incumbent: Trial) -> bool:
    if candidate.images_per_s is None or incumbent.images_per_s is None:
        return False
    return candidate.images_per_s > incumbent.images_per_s * (1 + MARGIN)


def save_settings(result: TuneResult, path: str | os.PathLike) -> Path:
    """Write the tuned settings file that :func:`load_settings` reads."""
    return atomic_write_json(path, result.to_json())


def _read(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no such settings file; write one with 'dali-pipes tune DATASET --out {path}'"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON settings file ({exc})") from exc
    if not isinstance(data, dict) or data.get("kind") != SETTINGS_KIND:
        raise ValueError(f"{path}: not a dali-pipes settings file (kind should be {SETTINGS_KIND!r})")
    if data.get("version") != SETTINGS_VERSION:
        raise ValueError(
            f"{path}: settings version {data.get('version')!r}; this dali-pipes reads version {SETTINGS_VERSION}"
        )
    return data


def load_settings(path: str | os.PathLike) -> dict[str, int]:
    """The ``DALILoader`` keyword arguments saved by ``dali-pipes tune`` (``num_threads``, ``py_num_workers``, ``prefetch``)."""
    loader = _read(path).get("loader")
    if not isinstance(loader, dict):
        raise ValueError(f"{path}: 'loader' must be an object of DALILoader keyword arguments")
    settings: dict[str, int] = {}
    for key, value in loader.items():
        if key not in LOADER_KEYS:
            raise ValueError(f"{path}: unknown loader setting {key!r}; expected some of {', '.join(LOADER_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < LOADER_KEYS[key]:
            raise ValueError(f"{path}: {key} must be an integer >= {LOADER_KEYS[key]}, got {value!r}")
        settings[key] = value
    return settings


def decoder_settings(path: str | os.PathLike) -> dict[str, float]:
    """The GPU decoder hints saved by ``dali-pipes tune`` (``{"hw_decoder_load": x}``, or empty)."""
    decoder = _read(path).get("decoder") or {}
    if not isinstance(decoder, dict) or set(decoder) - {"hw_decoder_load"}:
        raise ValueError(f"{path}: 'decoder' may only hold hw_decoder_load, got {decoder!r}")
    return {key: float(value) for key, value in decoder.items()}


def apply_settings(spec: Any, path: str | os.PathLike) -> Any:
    """``spec`` with the tuned decoder hints of ``path`` (unchanged when none were tuned)."""
    decoder = decoder_settings(path)
    if not decoder or not hasattr(spec, "decoder"):
        return spec
    return dataclasses.replace(spec, decoder=dataclasses.replace(spec.decoder, **decoder))


def format_tune(result: TuneResult, saved: Path | None = None) -> str:
    """What ``dali-pipes tune`` prints: every trial, then the best and how much it gains."""
    lines = [
        f"tuning {result.context['dataset']} on {result.context['device']}, batch {result.context['batch_size']}, "
        f"{result.context['cores']} cores"
    ]
    for trial in result.trials:
        setting = " ".join(f"{k}={v}" for k, v in trial.settings.items())
        if trial.hw_decoder_load is not None:
            setting += f" hw_decoder_load={trial.hw_decoder_load}"
        figure = (
            f"{trial.images_per_s:10.1f} images/s ±{100 * (trial.spread or 0):.0f}%"
            if trial.images_per_s
            else f"failed: {trial.error}"
        )
        mark = "  <- best" if trial is result.best else ""
        lines.append(f"  {setting:<58} {figure}{mark}")
    best = " ".join(f"{k}={v}" for k, v in result.best.settings.items())
    if result.best.hw_decoder_load is not None:
        best += f", hw_decoder_load={result.best.hw_decoder_load}"
    gain = f" ({result.speedup:.2f}x the default)" if result.speedup else ""
    lines.append(f"fastest: {best}: {result.best.images_per_s:.1f} images/s{gain}")
    lines.extend(result.notes)
    if saved is not None:
        lines.append(
            f"saved to {saved}; use it with DALILoader(path, spec, batch_size=..., **load_settings({str(saved)!r}))"
        )
    return "\n".join(lines)
