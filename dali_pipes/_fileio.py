"""Old name of :mod:`dali_pipes.fileio`, kept for the modules and scripts that still import it."""

from dali_pipes.fileio import atomic_write_bytes as atomic_write_bytes
from dali_pipes.fileio import atomic_write_json as atomic_write_json
from dali_pipes.fileio import fsync_dir as fsync_dir
from dali_pipes.fileio import sha256_file as sha256_file
