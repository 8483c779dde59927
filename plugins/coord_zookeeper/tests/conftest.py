"""Fixtures: real ZooKeeper servers on free loopback ports (session scoped), kazoo log levels."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from waltz_core.testing import require
from waltz_core.testing.servers import ZooKeeperServer, zookeeper_available


@pytest.fixture(autouse=True, scope="session")
def _quiet_kazoo() -> Iterator[None]:
    # kazoo logs every dropped connection at WARNING; failover tests drop many on purpose.
    names = ("kazoo", "waltz.coordination.zookeeper.kazoo")
    previous = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    yield
    for n, level in previous.items():
        logging.getLogger(n).setLevel(level)


@pytest.fixture(scope="session")
def zk_server() -> Iterator[ZooKeeperServer]:
    """A standalone ZooKeeper shared by the whole session (tests use their own roots)."""
    require(zookeeper_available(), "ZooKeeper (apt zookeeper: /usr/share/java/zookeeper.jar and java)")
    server = ZooKeeperServer(nodes=1).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def zk_ensemble() -> Iterator[ZooKeeperServer]:
    """A 3-node ensemble for failover tests (module scoped: tests may kill nodes)."""
    require(zookeeper_available(), "ZooKeeper (apt zookeeper: /usr/share/java/zookeeper.jar and java)")
    server = ZooKeeperServer(nodes=3).start()
    yield server
    server.stop()
