"""Run one batch of encoded images through a pipeline spec, outside the loader (shared by the CPU and GPU tests)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from nvidia.dali import Pipeline, fn, pipeline_def
from nvidia.dali.tensors import TensorListGPU

from dali_pipes.pipelines import PipelineSpec


def dali_cuda_devices() -> int:
    """CUDA devices DALI sees (0 with a CPU-only DALI build or no driver)."""
    try:
        from nvidia.dali.backend import GetCUDADeviceCount

        return int(GetCUDADeviceCount())
    except Exception:  # a CPU-only DALI build or no driver: no GPU either way
        return 0


#: The marks of a module of GPU tests: conftest skips `gpu` tests when torch sees no CUDA; DALI must see it too.
DALI_GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(dali_cuda_devices() == 0, reason="needs a CUDA GPU visible to DALI"),
]


def run_spec_batch(
    spec: PipelineSpec, data: list[np.ndarray], *, device: str = "cpu", seed: int = 42
) -> tuple[list[np.ndarray], list[int], Any, Any]:
    """One batch of ``data`` (encoded files, labelled 10, 11, ...) through ``spec`` on ``device``.

    Returns the images and labels as host numpy values, and DALI's raw outputs (to check
    where they live). Plain specs go through ``with pipe:``, specs that need conditionals
    through ``@pipeline_def(enable_conditionals=True)``: the two ways the loader may use.
    """
    labels = [np.array(10 + i, dtype=np.int64) for i in range(len(data))]
    kwargs = dict(
        batch_size=len(data), num_threads=2, device_id=0 if device == "gpu" else None, seed=seed, prefetch_queue_depth=1
    )

    def graph():
        image = fn.external_source(source=lambda: data, batch=True)
        label = fn.external_source(source=lambda: labels, batch=True)
        out = spec.build({"image": image, "label": label}, device=device)
        assert set(out) == {"image", "label"}
        return out["image"], out["label"]

    if spec.needs_conditionals:
        pipe = pipeline_def(graph, enable_conditionals=True, **kwargs)()
    else:
        pipe = Pipeline(**kwargs)
        with pipe:
            pipe.set_outputs(*graph())
    pipe.build()
    images, out_labels = pipe.run()
    host_images = images.as_cpu() if isinstance(images, TensorListGPU) else images
    host_labels = out_labels.as_cpu() if isinstance(out_labels, TensorListGPU) else out_labels
    return [np.array(t) for t in host_images], [int(np.array(t)) for t in host_labels], images, out_labels
