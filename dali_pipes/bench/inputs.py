"""What every benchmark row shares: the dataset, its original image files, the spec and the core count."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dali_pipes.dataset.manifest import Manifest, load_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchInputs:
    """The shared setting of one benchmark run.

    ``files`` are the original images as ``(path, label)`` (empty when they are
    not available; ``files_reason`` then says why). ``loader_settings`` are the
    :class:`~dali_pipes.DALILoader` keyword arguments the ``dali-pipes`` rows use
    (``num_threads``, ``py_num_workers``, ``prefetch``).
    """

    dataset: Path
    manifest: Manifest
    spec: Any
    batch_size: int
    cores: int
    files: tuple[tuple[Path, int], ...] = ()
    files_reason: str | None = None
    images_root: Path | None = None
    loader_settings: dict[str, int] = field(default_factory=dict)
    rows: tuple[str, ...] = ()
    #: The rows' settings on the GPU, where they differ from ``loader_settings`` (:meth:`settings_for`).
    gpu_loader_settings: dict[str, int] = field(default_factory=dict)
    #: Whether the settings came from a file saved by ``dali-pipes tune`` (else they are the loader's defaults).
    tuned: bool = False

    def settings_for(self, device: str) -> dict[str, int]:
        """The ``dali-pipes`` rows' loader settings on ``device``: a tuned file's as they are, else the
        loader's own defaults there (reader processes on the GPU where the CPU reads in the loader's thread)."""
        if device == "gpu" and self.gpu_loader_settings:
            return dict(self.gpu_loader_settings)
        return dict(self.loader_settings)

    def with_decoder_load(self, load: float) -> "BenchInputs":
        """These inputs with the spec's GPU decoder sending ``load`` of the JPEGs to the hardware decoder."""
        decoder = dataclasses.replace(self.spec.decoder, hw_decoder_load=load)
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, decoder=decoder))

    @property
    def num_samples(self) -> int:
        return self.manifest.num_samples

    def selected(self, jobs: list) -> list:
        """``jobs`` cut to the rows ``rows`` names (every row when it names none); an unknown name is refused."""
        if not self.rows:
            return jobs
        names = {job.name for job in jobs}
        unknown = [name for name in self.rows if name not in names]
        if unknown:
            raise ValueError(
                f"--rows: no row named {', '.join(map(repr, unknown))} in this suite; its rows are "
                f"{', '.join(map(repr, sorted(names)))}"
            )
        return [job for job in jobs if job.name in self.rows]

    def describe(self) -> dict[str, Any]:
        """The context of the figures, for the JSON and the table header."""
        spec = self.spec
        jitter = getattr(spec, "jitter", None)
        return {
            "dataset": str(self.dataset),
            "format": self.manifest.format,
            "num_samples": self.num_samples,
            "images_folder": str(self.images_root) if self.images_root else None,
            "images_folder_reason": self.files_reason,
            "batch_size": self.batch_size,
            "cores": self.cores,
            "augmentation": {
                "spec": type(spec).__name__,
                "random_resized_crop": {
                    "size": spec.size,
                    "scale": list(getattr(spec, "scale", ())),
                    "ratio": list(getattr(spec, "ratio", ())),
                },
                "flip": getattr(spec, "flip", None),
                "color_jitter": None
                if jitter is None
                else {
                    "brightness": jitter.brightness,
                    "contrast": jitter.contrast,
                    "saturation": jitter.saturation,
                    "hue": jitter.hue,
                },
                "normalize": {"mean": list(spec.mean), "std": list(spec.std)},
                "dtype": spec.dtype,
                "antialias": spec.antialias,
            },
            "loader_settings": dict(self.loader_settings),
            "rows": list(self.rows) or "all",
        }


def default_loader_settings(cores: int, fmt: str, gpu: bool = False) -> dict[str, int]:
    """The ``dali-pipes`` rows' settings without a tuned file: DALI gets every core, as the DataLoader does;
    the reader processes are the loader's own default for the dataset's format (``gpu``: for images decoded there)."""
    from dali_pipes.loading.options import default_py_num_workers

    workers = default_py_num_workers(fmt, True, cores, gpu_images=gpu)
    return {"num_threads": cores, "py_num_workers": workers, "prefetch": 2}


#: The benchmarks' batch size when none is given (a smaller dataset gets a smaller one: :func:`fitting_batch_size`).
DEFAULT_BATCH_SIZE = 64


def bench_inputs(
    dataset: str | os.PathLike,
    *,
    batch_size: int | None = None,
    images: str | os.PathLike | None = None,
    cores: int | None = None,
    dtype: str = "float32",
    settings: str | os.PathLike | None = None,
    rows: Sequence[str] = (),
) -> BenchInputs:
    """Load the manifest, find the original images, and fix the spec, batch size and settings.

    ``rows`` names the rows to measure (the main suite's :meth:`BenchInputs.selected`; default all).
    ``batch_size=None`` (not given) is :data:`DEFAULT_BATCH_SIZE`, or a smaller one that a small dataset fills
    (:func:`fitting_batch_size`); one given that the dataset cannot fill once is refused, naming ``--batch-size``.
    """
    from dali_pipes.pipelines import ClassificationTrain

    if batch_size is not None and batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    cores = cores or os.cpu_count() or 1
    if cores < 1:
        raise ValueError(f"the core count must be at least 1, got {cores}")
    dataset = Path(dataset)
    manifest = load_manifest(dataset)
    if "image" not in manifest.fields or not manifest.fields["image"].is_image:
        raise ValueError(f"{dataset}: the benchmark needs an image dataset with an encoded 'image' field")
    batch_size = fitting_batch_size(dataset, manifest.num_samples, batch_size)
    spec = ClassificationTrain(size=224, dtype=dtype)
    loader_settings = default_loader_settings(cores, manifest.format)
    gpu_settings = default_loader_settings(cores, manifest.format, gpu=True)
    if settings is not None:
        from dali_pipes.settings import apply_settings, load_settings

        tuned = load_settings(settings)
        loader_settings.update(tuned)
        gpu_settings.update(tuned)
        spec = apply_settings(spec, settings)
    root, reason, files = _original_files(dataset, manifest, images)
    return BenchInputs(
        dataset,
        manifest,
        spec,
        batch_size,
        cores,
        files,
        reason,
        root,
        loader_settings,
        tuple(rows),
        gpu_settings,
        tuned=settings is not None,
    )


def _original_files(
    dataset: Path, manifest: Manifest, images: str | os.PathLike | None
) -> tuple[Path | None, str | None, tuple[tuple[Path, int], ...]]:
    """The original image folder, the reason there is none, and its images as ``(path, label)``."""
    root, reason = find_image_folder(dataset, manifest, images)
    if root is None:
        return root, reason, ()
    from converters.base import ConversionError
    from dali_pipes.bench.baselines import imagefolder_files

    try:
        files = tuple(imagefolder_files(root))
    except (OSError, ConversionError) as exc:  # not a ROOT/CLASS/IMAGE tree, or empty: the file rows skip
        return None, str(exc), ()
    if len(files) != manifest.num_samples:
        log.warning(
            "%s holds %d images but the dataset %d samples; the file rows read the folder as it is now",
            root,
            len(files),
            manifest.num_samples,
        )
    return root, reason, files


def fitting_batch_size(dataset: Path, num_samples: int, given: int | None = None) -> int:
    """The batch size: ``given``, refused (naming ``--batch-size``) when the dataset cannot fill one batch; or,
    not given, :data:`DEFAULT_BATCH_SIZE`, or for a dataset of fewer samples the largest power of two it holds
    (logged, with why).

    A batch larger than the dataset would time repeats of its samples padding every batch; powers of two keep
    the figure comparable with other runs' batch sizes.
    """
    if given is not None:
        if num_samples < given:
            raise ValueError(
                f"{dataset}: {num_samples} samples is less than one batch of {given}; use a smaller --batch-size"
            )
        return given
    if num_samples >= DEFAULT_BATCH_SIZE:
        return DEFAULT_BATCH_SIZE
    if num_samples < 1:
        raise ValueError(f"{dataset}: the dataset holds no samples to benchmark")
    chosen = 1 << (num_samples.bit_length() - 1)
    log.info(
        "batch size %d, not the default %d: %s holds only %d sample%s, and %d is the largest power of two that "
        "fits (give --batch-size to choose another)",
        chosen,
        DEFAULT_BATCH_SIZE,
        dataset,
        num_samples,
        "" if num_samples == 1 else "s",
        chosen,
    )
    return chosen


def find_image_folder(
    dataset: Path, manifest: Manifest, explicit: str | os.PathLike | None
) -> tuple[Path | None, str | None]:
    """The original image folder: ``explicit``, else the manifest's imagefolder ``source.root``; or the reason there is none."""
    if explicit is not None:
        path = Path(explicit)
        return (path, None) if path.is_dir() else (None, f"--images {path} is not a folder")
    source = manifest.source
    kind = source.get("kind")
    if kind != "imagefolder":
        return None, f"the dataset came from a {kind!r} source, not an image folder; pass --images DIR"
    root = Path(str(source.get("root", "")))
    # The converter records the root absolute; a root recorded relative (by an older converter) is tried
    # from here and from beside the dataset (where `convert` is usually run).
    candidates = [root] if root.is_absolute() else [Path.cwd() / root, dataset.parent / root]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate, None
    return None, f"the source folder {root} recorded in the manifest is not there any more; pass --images DIR"
