"""pytest plugin for Waltz and its plugins (opt in with ``-p waltz_core.testing.pytest_plugin``).

It registers the markers, the ``--waltz-transport`` / ``--waltz-coordination`` options with
which the end-to-end suite runs against any backend pair, and fixtures for real servers:
``zookeeper_server`` / ``etcd_server`` (one per session) and ``zookeeper_ensemble`` /
``etcd_ensemble`` (3 nodes, one per module).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .servers import EtcdServer, ZooKeeperServer


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


# ------------------------------------------------------------------------------ real servers
# Started on free loopback ports; missing packages skip locally and fail under CI=true. Tests
# sharing a server use their own cluster roots.


@pytest.fixture(scope="session")
def zookeeper_server() -> Iterator[ZooKeeperServer]:
    """A standalone ZooKeeper shared by the whole session."""
    from . import require
    from .servers import ZooKeeperServer, zookeeper_available

    require(zookeeper_available(), "ZooKeeper (apt zookeeper: /usr/share/java/zookeeper.jar and java)")
    server = ZooKeeperServer(nodes=1).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def zookeeper_ensemble() -> Iterator[ZooKeeperServer]:
    """A 3-node ensemble for failover tests (module scoped: tests may kill nodes)."""
    from . import require
    from .servers import ZooKeeperServer, zookeeper_available

    require(zookeeper_available(), "ZooKeeper (apt zookeeper: /usr/share/java/zookeeper.jar and java)")
    server = ZooKeeperServer(nodes=3).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """A single etcd shared by the whole session."""
    from . import require
    from .servers import EtcdServer, etcd_available

    require(etcd_available(), "etcd (apt etcd-server: /usr/bin/etcd)")
    server = EtcdServer(nodes=1).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def etcd_ensemble() -> Iterator[EtcdServer]:
    """A 3-member etcd cluster for failover tests (module scoped: tests may kill members)."""
    from . import require
    from .servers import EtcdServer, etcd_available

    require(etcd_available(), "etcd (apt etcd-server: /usr/bin/etcd)")
    server = EtcdServer(nodes=3).start()
    try:
        yield server
    finally:
        server.stop()
