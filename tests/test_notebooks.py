"""The notebooks in ``notebooks/`` run top to bottom on tiny data, and are committed without outputs.

Each notebook reads its data location and sizes from ``DALI_PIPES_NB_*``
environment variables (its parameters cell); the kernel inherits them from
this process. A notebook that does not run is a defect, as a failing test is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ("quickstart.ipynb", "gpu_augmentation_benchmark.ipynb", "bottleneck_hunt.ipynb")

#: Small enough for about a minute each on 2 cores.
TINY = {
    "DALI_PIPES_NB_NUM_IMAGES": "48",
    "DALI_PIPES_NB_IMAGE_SIZE": "128x96",
    "DALI_PIPES_NB_BATCH_SIZE": "8",
    "DALI_PIPES_NB_CROP": "64",
    "DALI_PIPES_NB_WORKERS": "1",
    "DALI_PIPES_NB_QUICK": "1",
    "DALI_PIPES_NB_MODEL": "tiny",
    "DALI_PIPES_NB_STEPS": "3",
}


def _outputs(path: Path) -> list[int]:
    cells = json.loads(path.read_text())["cells"]
    return [
        i for i, c in enumerate(cells) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))
    ]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_without_outputs(name):
    path = NOTEBOOKS / name
    assert path.is_file(), f"{path} is missing"
    assert not _outputs(path), f"{name}: cells {_outputs(path)} carry outputs; clear them before committing"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name",
    # The benchmark notebook's 40 s re-run bench code that tests/test_bench.py covers: with the slow tests.
    [
        pytest.param(name, marks=pytest.mark.slow) if name == "gpu_augmentation_benchmark.ipynb" else name
        for name in NAMES
    ],
)
def test_notebook_runs_on_tiny_data(name, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for key, value in {
        **TINY,
        "DALI_PIPES_NB_WORKDIR": str(tmp_path / "work"),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }.items():
        monkeypatch.setenv(key, value)
    # The kernel's own inline backend draws the figures into the outputs; a backend forced from outside would not.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        book, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on the first failing cell

    outputs = [out for cell in book.cells if cell.cell_type == "code" for out in cell.outputs]
    errors = [out for out in outputs if out.output_type == "error"]
    assert not errors, errors
    # Every notebook ends its work in a figure: a PNG grid (quickstart) or matplotlib plots.
    assert any("image/png" in out.get("data", {}) for out in outputs), f"{name} showed no image"
    assert (tmp_path / "work" / "shards" / "index.json").exists()
