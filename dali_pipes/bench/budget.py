"""How long ``doctor`` will take, said before it starts, and its progress while it runs.

A large model on a CPU can need many seconds a training step, and ``doctor`` runs
dozens of steps: one step is timed first, the whole run is estimated from it, and a
run longer than the user's limit is refused up front, naming smaller models.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

#: ``doctor``'s default limit on its own running time, in minutes.
MAX_MINUTES = 10.0


def time_one_step(step: Callable[[], None]) -> float:
    """Seconds of one call of ``step`` after a first, untimed one (allocation, kernel choice)."""
    step()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def check_budget(
    *, model: str, smaller: tuple[str, ...], device: str, batch_size: int, step_s: float, steps: int, max_minutes: float
) -> float:
    """Estimated seconds of ``steps`` training steps of ``step_s`` each; ValueError when over ``max_minutes``.

    The estimate leaves out the loader's own time, so it is a lower bound on the CPU.
    """
    estimate = steps * step_s
    if estimate > max_minutes * 60:
        others = f"a smaller model (--model {' or '.join(smaller)}), " if smaller else ""
        raise ValueError(
            f"doctor would take about {estimate / 60:.0f} minutes: one {model} training step of batch {batch_size} "
            f"takes {step_s:.1f} s on the {device}, and it needs about {steps} of them; choose {others}a smaller "
            f"--batch-size or fewer --steps, or allow it with --max-minutes {estimate / 60 + 1:.0f}"
        )
    log.info(
        "doctor: about %s (%d training steps of %s at %.2f s each on the %s, plus the loader)",
        _minutes(estimate),
        steps,
        model,
        step_s,
        device,
    )
    return estimate


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


@contextlib.contextmanager
def counted(factory: Callable[[], Any], tick: Callable[[int], Any]) -> Iterator[Iterator[int]]:
    """``factory()``'s stream of batch sizes, calling ``tick(1)`` for every batch (a progress bar's update)."""
    with factory() as stream:

        def steps() -> Iterator[int]:
            for images in stream:
                tick(1)
                yield images

        yield steps()
