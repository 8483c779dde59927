"""Fixtures: real etcd servers on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from waltz_core.testing import require
from waltz_core.testing.servers import EtcdServer, etcd_available


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """A single etcd shared by the whole session (tests use their own roots)."""
    require(etcd_available(), "etcd (apt etcd-server: /usr/bin/etcd)")
    server = EtcdServer(nodes=1).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def etcd_cluster() -> Iterator[EtcdServer]:
    """A 3-member cluster for failover tests (module scoped: tests may kill members)."""
    require(etcd_available(), "etcd (apt etcd-server: /usr/bin/etcd)")
    server = EtcdServer(nodes=3).start()
    yield server
    server.stop()
