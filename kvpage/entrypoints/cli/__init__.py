"""The ``kvpage`` command line and its subcommands."""
