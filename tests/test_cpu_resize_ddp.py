"""The Numba CPU resize never takes a training job down: under torchvision's DDP script, and when Numba fails.

torchvision's reference ``utils.setup_for_distributed`` replaces ``builtins.print`` with a
function nested in its ``utils`` module before the loader builds its first CPU pipeline.
Numba registers ``builtins.print`` when it is first imported and insists that it is
reachable as ``module.name``, so ``import numba`` used to raise ``AttributeError: module
'utils' has no attribute 'print'`` from inside the loader. Each case runs in a real Python
process of its own (Numba is imported once per process, and the replaced ``print`` must not
leak into this one), with ``utils.py`` written beside the script as the reference scripts have it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba", reason='the Numba resize needs the "cpu" extra (pip install "dali-pipes[cpu]")')

ROOT = Path(__file__).resolve().parents[1]

#: torchvision's references/classification/utils.py, ``setup_for_distributed``, as it is written there.
TORCHVISION_UTILS = '''
def setup_for_distributed(is_master):
    """
    This function disables printing when not in master process
    """
    import builtins as __builtin__

    builtin_print = __builtin__.print

    def print(*args, **kwargs):
        force = kwargs.pop("force", False)
        if is_master or force:
            builtin_print(*args, **kwargs)

    __builtin__.print = print
'''

#: A replacement that keeps no reference to Python's own print (it writes to the stream itself):
#: nothing can put the original back while Numba imports, so the import fails and DALI's resize must run.
OWN_PRINT_UTILS = """
import sys


def setup_for_distributed(is_master):
    import builtins

    def print(*args, sep=" ", end="\\n", file=None, flush=False, force=False):
        if is_master or force:
            (file or sys.stdout).write(sep.join(map(str, args)) + end)

    builtins.print = print
"""

#: Rank 1 of a DDP job: print silenced, then two loaders (two CPU pipelines) read a batch each.
#: Results go out with sys.stdout.write: print is the replaced, silent one here.
SCRIPT = """
import json, logging, sys

records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)


logging.getLogger().addHandler(Keep(level=logging.WARNING))

import utils

utils.setup_for_distributed(False)

from dali_pipes import ClassificationTrain, DALILoader, RunOptions
from dali_pipes.pipelines import cpu_resize

spec = ClassificationTrain(size=64, jitter=None, flip=0.0)
shapes = []
for _ in range(2):
    with DALILoader(sys.argv[1], spec, batch_size=4, run=RunOptions(device="cpu"), shuffle=False, seed=0) as loader:
        shapes.append(list(next(iter(loader))["image"].shape))
warnings = [(r.name, r.getMessage()) for r in records if r.name.startswith("dali_pipes")]
sys.stdout.write(json.dumps({"shapes": shapes, "numba": cpu_resize.available(), "warnings": warnings}))
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, imagenet_mini) -> Path:
    """The ImageNet-mini photos as an LMDB dataset."""
    from converters.runner import convert
    from converters.sources.imagefolder import ImageFolderSource

    root = tmp_path_factory.mktemp("ddp") / "shards"
    convert(ImageFolderSource(imagenet_mini), root, format="lmdb", workers=1, progress=False)
    return root


def run_rank(tmp_path: Path, dataset: Path, utils_source: str, **env: str) -> dict:
    """Run SCRIPT as a DDP rank would, with ``utils.py`` beside it; its JSON result."""
    (tmp_path / "utils.py").write_text(textwrap.dedent(utils_source))
    (tmp_path / "rank.py").write_text(SCRIPT)
    environ = {k: v for k, v in os.environ.items() if k != "DALI_PIPES_CPU_RESIZE"}
    environ.update(env)
    run = subprocess.run(
        [sys.executable, "rank.py", str(dataset)],
        cwd=tmp_path,  # so that `import utils` finds the script's own, as in references/classification
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, f"the rank failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_torchvisions_print_replacement_keeps_the_numba_resize(tmp_path, dataset):
    result = run_rank(tmp_path, dataset, TORCHVISION_UTILS)
    assert result["shapes"] == [[4, 3, 64, 64]] * 2
    # The original print, kept by the replacement, stands in while Numba imports: the faster resize runs.
    assert result["numba"] is True
    assert result["warnings"] == []


def test_a_print_numba_cannot_import_under_falls_back_with_one_warning(tmp_path, dataset):
    result = run_rank(tmp_path, dataset, OWN_PRINT_UTILS)
    assert result["shapes"] == [[4, 3, 64, 64]] * 2
    assert result["numba"] is False
    assert len(result["warnings"]) == 1, result["warnings"]
    name, message = result["warnings"][0]
    assert name == "dali_pipes.pipelines.cpu_resize"
    assert "AttributeError" in message and "has no attribute 'print'" in message  # the cause
    assert "DALI_PIPES_CPU_RESIZE=dali" in message and "DALI's CPU resize" in message  # what runs, and the switch


def test_a_failed_compile_falls_back_with_one_warning(tmp_path, dataset):
    # NUMBA_DISABLE_JIT (set to debug one's own Numba code) leaves DALI's NumbaFunction nothing it can compile.
    result = run_rank(tmp_path, dataset, TORCHVISION_UTILS, NUMBA_DISABLE_JIT="1")
    assert result["shapes"] == [[4, 3, 64, 64]] * 2
    assert result["numba"] is False
    assert len(result["warnings"]) == 1, result["warnings"]
    name, message = result["warnings"][0]
    assert name == "dali_pipes.pipelines.cpu_resize"
    assert "TypingError" in message and "DALI_PIPES_CPU_RESIZE=dali" in message
