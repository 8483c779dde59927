"""The ``waltz`` command line. Subcommands come from plugins through ``waltz_add_commands``."""
