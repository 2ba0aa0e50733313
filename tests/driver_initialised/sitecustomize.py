"""Run by every Python process of a test run made with ``DALI_PIPES_TEST_DRIVER_INITIALISED=1``.

``tests/conftest.py`` puts this folder first on ``PYTHONPATH``, so the CLI, example and script
subprocesses the tests start load it too. It makes DALI's own test,
``nvidia.dali.backend.IsDriverInitialized``, say True, as it does in every process on a CUDA
machine once ``torch.cuda.is_available()`` has run: every loader's workers then spawn, as they
do there, and a test that only holds under fork fails here too.

The patch is applied when a process imports ``nvidia.dali.backend``, not before: a process that
never imports DALI (``import dali_pipes`` alone, a Dask worker) must not be made to.
"""

import importlib.abc
import importlib.util
import os
import sys

_MODULE = "nvidia.dali.backend"


class _PatchDaliBackend(importlib.abc.MetaPathFinder):
    """Finds ``nvidia.dali.backend`` through the other finders, and patches the module once it has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # one module, once: the real finders take it from here
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            module.IsDriverInitialized = lambda: True

        loader.exec_module = exec_module
        return spec


if os.environ.get("DALI_PIPES_TEST_DRIVER_INITIALISED") == "1":
    sys.meta_path.insert(0, _PatchDaliBackend())
