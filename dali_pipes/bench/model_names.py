"""The models ``dali-pipes doctor`` can build, by name.

Apart from :mod:`dali_pipes.bench.models` (which imports torch) so that the CLI
and :mod:`dali_pipes.bench.doctor` can list them without importing torch.
"""

from __future__ import annotations

#: The models ``doctor`` can build (:func:`dali_pipes.bench.models.build_model`), largest first.
MODELS: tuple[str, ...] = ("resnet50", "resnet18", "mobilenet", "tiny")
