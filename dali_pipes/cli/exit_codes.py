"""Exit codes of the ``dali-pipes`` command, shared by :mod:`dali_pipes.cli.command` and :mod:`dali_pipes.cli.measure`."""

EXIT_ERROR = 2  # a usage or input problem the user can fix
EXIT_FAILED = 1  # the command ran and found problems (verify)
