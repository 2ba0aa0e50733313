"""``python -m dali_pipes.cli``: the ``dali-pipes`` command."""

import sys

from dali_pipes.cli.command import main

if __name__ == "__main__":  # spawned DALI workers import the main module again; they must not run the CLI
    sys.exit(main())
