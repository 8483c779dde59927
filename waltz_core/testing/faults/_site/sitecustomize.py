"""Test-only interpreter hook: journal fsync/fdatasync when WALTZ_TEST_SYNC_JOURNAL is set.

On ``PYTHONPATH`` only for subprocesses started by the reliability tests
(:func:`waltz_core.testing.faults.disk.sync_journal_env`).
"""

import os

if os.environ.get("WALTZ_TEST_SYNC_JOURNAL"):
    from waltz_core.testing.faults.disk import install_sync_journal

    install_sync_journal(os.environ["WALTZ_TEST_SYNC_JOURNAL"])
