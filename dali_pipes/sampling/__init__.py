"""Who reads which sample when: the epoch order, each DDP rank's share, padding and resume.

Pure functions over integers and numpy arrays (no DALI, no I/O), in
:mod:`dali_pipes.sampling.rules`; the loader, the RAM cache and the public API
all import them from here.
"""

# The names and their list live once, in rules.py.
from dali_pipes.sampling.rules import *  # noqa: F403
from dali_pipes.sampling.rules import __all__ as __all__
