"""``python -m dali_pipes ...``: the ``dali-pipes`` command, wherever the package imports."""

import sys

from dali_pipes.cli import main

if __name__ == "__main__":  # spawned DALI workers import the main module again; they must not run the CLI
    sys.exit(main())
