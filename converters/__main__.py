"""``python -m converters imagefolder ROOT OUT ...``: the same as ``dali-pipes convert``."""

import sys

from dali_pipes.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
