"""The ``dali-pipes`` command: ``convert``, ``stage``, ``inspect``, ``verify``, ``show``, ``demo`` and the measuring commands.

``command`` builds the parser and runs a subcommand; ``measure`` adds ``bench``,
``bench-convert``, ``tune``, ``doctor`` and ``selftest``; the other modules are
the subcommands that print for people.
"""

from dali_pipes.cli.command import build_parser, main

__all__ = ["build_parser", "main"]
