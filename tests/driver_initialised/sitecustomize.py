"""Run by every Python process of a test run made with ``DALI_PIPES_TEST_DRIVER_INITIALISED=1``.

``tests/conftest.py`` puts this folder first on ``PYTHONPATH``, so the CLI, example and script
subprocesses the tests start load it too. It makes DALI's own test,
``nvidia.dali.backend.IsDriverInitialized``, say True, as it does in every process on a CUDA
machine once ``torch.cuda.is_available()`` has run: every loader's workers then spawn, as they
do there, and a test that only holds under fork fails here too.
"""

import os

if os.environ.get("DALI_PIPES_TEST_DRIVER_INITIALISED") == "1":
    try:
        import nvidia.dali.backend as _backend
    except ImportError:  # a process of the run that has no DALI (none should, but not ours to fail)
        pass
    else:
        _backend.IsDriverInitialized = lambda: True
