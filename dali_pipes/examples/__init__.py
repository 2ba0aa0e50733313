"""Runnable examples: ``python -m dali_pipes.examples.NAME --help`` (or under ``torchrun -m``)."""
