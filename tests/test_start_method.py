"""How the loader starts DALI's Python workers: fork, or spawn once the CUDA driver is initialised.

On a CUDA machine ``torch.cuda.is_available()`` initialises the driver, after
which DALI refuses to fork. These tests run real scripts in fresh interpreters
in which DALI's own test, ``nvidia.dali.backend.IsDriverInitialized``, is made
to answer True (the one thing this CPU machine cannot do for real), and check
that the loader then spawns its workers and still delivers a whole epoch, and
that the spawned workers never re-run the script: one without an
``if __name__ == "__main__":`` guard, or with module-level code such as
``dist.init_process_group``, works and runs its top level once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dali_pipes import RunOptions
from dali_pipes.loading.start_method import choose_start_method, driver_initialized

from loader_helpers import free_port, write_dataset

TESTS = Path(__file__).resolve().parent
N = 10

# Run first in every script: what a CUDA machine's process looks like to DALI after torch.cuda.is_available().
DRIVER_INITIALISED = "import nvidia.dali.backend as _b\n_b.IsDriverInitialized = lambda: True\n"

LOAD_ONE_EPOCH = """
import json, sys
sys.path.insert(0, {tests!r})
from dali_pipes import BatchFormat, DALILoader, RunOptions
from loader_helpers import TinySpec

def main():
    loader = DALILoader({path!r}, TinySpec(), batch_size=4, shuffle=False, batch_format=BatchFormat(with_index=True),
                        run=RunOptions(device="cpu", py_num_workers=1{extra}))
    seen = [int(i) for batch in loader for i in batch["index"]]
    print(json.dumps({{"start_method": loader.py_start_method, "seen": seen}}))
    loader.close()
"""


def run_script(tmp_path: Path, body: str, name: str = "train.py") -> subprocess.CompletedProcess:
    script = tmp_path / name
    script.write_text(DRIVER_INITIALISED + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("ds") / "ds", N, samples_per_shard=4)


def test_default_is_fork_while_the_driver_is_untouched():
    import torch

    if torch.cuda.is_available():  # which initialises the driver: the scripts below cover that case
        pytest.skip("on a CUDA machine the driver is initialised in every test process")
    if os.environ.get("DALI_PIPES_TEST_DRIVER_INITIALISED") == "1":
        pytest.skip("this run makes DALI's driver test say True, as on a CUDA machine")
    # No CUDA here, so nothing initialised the driver: the cheaper fork stays the default.
    assert not driver_initialized()
    assert choose_start_method(None) == "fork"
    assert choose_start_method("spawn") == "spawn"
    with pytest.raises(ValueError, match="RunOptions.py_start_method"):
        RunOptions(py_start_method="forkserver")


@pytest.mark.timeout(240)
def test_spawns_when_the_driver_is_initialised_and_delivers_the_epoch(tmp_path, dataset):
    body = (
        LOAD_ONE_EPOCH.format(tests=str(TESTS), path=str(dataset), extra="")
        + "\nif __name__ == '__main__':\n    main()\n"
    )
    proc = run_script(tmp_path, body)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["start_method"] == "spawn"
    assert result["seen"] == list(range(N))


@pytest.mark.timeout(240)
def test_forcing_fork_after_the_driver_is_initialised_is_what_dali_refuses(tmp_path, dataset):
    # Why the default matters: the old default (fork unless torch made a context) hit this on every CUDA machine.
    extra = ', py_start_method="fork"'
    body = (
        LOAD_ONE_EPOCH.format(tests=str(TESTS), path=str(dataset), extra=extra)
        + "\nif __name__ == '__main__':\n    main()\n"
    )
    proc = run_script(tmp_path, body)
    assert proc.returncode != 0
    assert "Cannot fork a process when the CUDA has been initialized" in proc.stderr


# Top-level code that counts how often the script runs: once per process that runs it.
COUNT_RUNS = """
import os
with open({runs!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
"""


@pytest.mark.timeout(240)
def test_a_script_without_a_main_guard_spawns_workers_that_do_not_rerun_it(tmp_path, dataset):
    runs = tmp_path / "runs.txt"
    body = COUNT_RUNS.format(runs=str(runs)) + LOAD_ONE_EPOCH.format(tests=str(TESTS), path=str(dataset), extra="")
    proc = run_script(tmp_path, body + "\nprint(os.getpid())\nmain()\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"start_method": "spawn", "seen": list(range(N))}
    assert runs.read_text().split() == [str(proc_pid(proc))]


def proc_pid(proc: subprocess.CompletedProcess) -> int:
    """The script's own process id, printed on the line before its result."""
    return int(proc.stdout.strip().splitlines()[-2])


@pytest.mark.timeout(240)
def test_module_level_init_process_group_and_a_compound_main_guard(tmp_path, dataset):
    # `if __name__ == "__main__" and ...:` is a guard too; module-level init_process_group would hang or fail in
    # a worker that re-ran the script (a second rank 0 of a world of 1 on the same port).
    runs = tmp_path / "runs.txt"
    body = (
        COUNT_RUNS.format(runs=str(runs))
        + textwrap.dedent(
            f"""
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            """
        )
        + LOAD_ONE_EPOCH.format(tests=str(TESTS), path=str(dataset), extra="")
        + "\nif __name__ == '__main__' and dist.is_initialized():\n    print(os.getpid())\n    main()\n"
        + "    dist.destroy_process_group()\n"
    )
    proc = run_script(tmp_path, body)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"start_method": "spawn", "seen": list(range(N))}
    assert runs.read_text().split() == [str(proc_pid(proc))]
