"""The ``dali-pipes`` command, for people: it parses, calls one library function, and prints.

``command`` builds the parser and runs ``convert``, ``inspect``, ``verify``,
``merge``, ``stage``, ``synth``, ``demo`` and ``show``; ``measure`` adds
``bench``, ``bench-convert``, ``tune``, ``doctor`` and ``selftest``;
``exit_codes`` holds the exit codes both share. ``demo``, ``show``, ``verify``
and ``inspect`` are the subcommands with more to them than a call.
"""

from dali_pipes.cli.command import build_parser, main

__all__ = ["build_parser", "main"]
