"""The tuned-settings file that ``dali-pipes tune`` writes and ``RunOptions(settings=...)`` reads.

The file (JSON, ``kind: dali-pipes-settings``)::

    run = RunOptions(**load_settings("settings.json"))
    spec = apply_settings(ClassificationTrain(size=224), "settings.json")   # hw_decoder_load, if tuned
    loader = DALILoader("shards/train", spec, batch_size=256, run=run)

:func:`load_settings` returns only :class:`~dali_pipes.RunOptions` fields, so it can be
spread into the call; the decoder hint belongs to the spec (:func:`apply_settings`).
The search that writes the file is :mod:`dali_pipes.bench.tune`; this module sits
below the loader and imports no DALI or torch at the top: reading a settings file is cheap.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "HW_DECODER_GPUS",
    "LOADER_KEYS",
    "SETTINGS_KIND",
    "SETTINGS_VERSION",
    "apply_settings",
    "decoder_settings",
    "has_hw_decoder",
    "load_settings",
]

SETTINGS_KIND = "dali-pipes-settings"
SETTINGS_VERSION = 1
#: ``RunOptions`` fields a settings file may hold, with their smallest valid value.
LOADER_KEYS: dict[str, int] = {"num_threads": 1, "py_num_workers": 0, "prefetch": 1}
#: GPUs with nvJPEG's hardware decoder (a name match: CUDA does not report the engine).
HW_DECODER_GPUS = ("A100", "A800", "A30", "H100", "H200", "H800", "H20", "GH200", "B100", "B200", "GB200")


def has_hw_decoder(device: int | None = None) -> bool:
    """True on a CUDA GPU (``device``, default the current one) known to carry the hardware JPEG decoder."""
    import torch

    if not torch.cuda.is_available():
        return False
    name = torch.cuda.get_device_name(torch.cuda.current_device() if device is None else device)
    return any(model in name for model in HW_DECODER_GPUS)


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
    """The ``RunOptions`` fields saved by ``dali-pipes tune`` (``num_threads``, ``py_num_workers``, ``prefetch``)."""
    loader = _read(path).get("loader")
    if not isinstance(loader, dict):
        raise ValueError(f"{path}: 'loader' must be an object of RunOptions fields")
    settings: dict[str, int] = {}
    for key, value in loader.items():
        if key not in LOADER_KEYS:
            raise ValueError(f"{path}: unknown loader setting {key!r}; expected some of {', '.join(LOADER_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < LOADER_KEYS[key]:
            raise ValueError(f"{path}: {key} must be an integer >= {LOADER_KEYS[key]}, got {value!r}")
        settings[key] = value
    return settings


def decoder_settings(path: str | os.PathLike) -> dict[str, Any]:
    """The GPU decoder hints saved by ``dali-pipes tune``: ``hw_decoder_load`` and ``jpeg_fancy_upsampling``, or none."""
    decoder = _read(path).get("decoder") or {}
    if not isinstance(decoder, dict) or set(decoder) - {"hw_decoder_load", "jpeg_fancy_upsampling"}:
        raise ValueError(f"{path}: 'decoder' may only hold hw_decoder_load and jpeg_fancy_upsampling, got {decoder!r}")
    hints: dict[str, Any] = {}
    if "hw_decoder_load" in decoder:
        hints["hw_decoder_load"] = float(decoder["hw_decoder_load"])
    if "jpeg_fancy_upsampling" in decoder:
        if not isinstance(decoder["jpeg_fancy_upsampling"], bool):
            raise ValueError(
                f"{path}: jpeg_fancy_upsampling must be true or false, got {decoder['jpeg_fancy_upsampling']!r}"
            )
        hints["jpeg_fancy_upsampling"] = decoder["jpeg_fancy_upsampling"]
    return hints


def apply_settings(spec: Any, path: str | os.PathLike) -> Any:
    """``spec`` with the tuned decoder hints of ``path`` (unchanged when none were tuned)."""
    decoder = decoder_settings(path)
    if not decoder or not hasattr(spec, "decoder"):
        return spec
    return dataclasses.replace(spec, decoder=dataclasses.replace(spec.decoder, **decoder))
