"""``python -m waltz_core.cli``: the same as the ``waltz`` command."""

from .main import main

main()
