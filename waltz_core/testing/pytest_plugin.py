"""pytest plugin for Waltz and its plugins (opt in with ``-p waltz_core.testing.pytest_plugin``).

It registers the markers and the ``--waltz-transport`` / ``--waltz-coordination`` options with
which the end-to-end suite runs against any backend pair.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("waltz")
    # Empty (the default) means every backend: the end-to-end suite then runs its whole matrix.
    group.addoption("--waltz-transport", default=os.environ.get("WALTZ_TEST_TRANSPORT", ""),
                    help="transport backend(s) for end-to-end tests, comma separated "
                         "(default: all of the matrix, or $WALTZ_TEST_TRANSPORT)")
    group.addoption("--waltz-coordination", default=os.environ.get("WALTZ_TEST_COORDINATION", ""),
                    help="coordination backend(s) for end-to-end tests, comma separated "
                         "(default: all of the matrix, or $WALTZ_TEST_COORDINATION)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: needs a real ZooKeeper, etcd or Spark (started by fixtures)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
