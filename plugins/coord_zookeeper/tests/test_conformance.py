"""The shared coordination conformance kit against a real standalone ZooKeeper."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from kazoo.client import KazooClient

from waltz_coord_zookeeper.backend import ZooKeeperBackend
from waltz_core.config import CoordinationConfig
from waltz_core.coordination import open_coordination
from waltz_core.coordination.base import CoordinationBackend
from waltz_core.runtime import Runtime
from waltz_core.testing.conformance.coordination import CoordinationConformance
from waltz_core.testing.servers import ZooKeeperServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]  # a hang fails, never blocks CI


def expire_zookeeper_session(backend: ZooKeeperBackend, connect: str) -> None:
    """Expire ``backend``'s session the way the server does: a second client attaches to the same
    session id and password, then closes it. Blocks (run it in a thread)."""
    session_id, password = backend.client.client_id
    thief = KazooClient(hosts=connect, client_id=(session_id, password), timeout=backend.session_timeout)
    try:
        thief.start(10)
    finally:
        thief.stop()
        thief.close()


class TestZooKeeperConformance(CoordinationConformance):
    @pytest.fixture
    async def backend_factory(self, zookeeper_server: ZooKeeperServer, runtime: Runtime) -> AsyncIterator:
        made: list[CoordinationBackend] = []

        async def make() -> CoordinationBackend:
            config = CoordinationConfig(name="zookeeper", connect=zookeeper_server.connect_string, session_timeout=4.0)
            backend = open_coordination(config, runtime.registries)
            await backend.start()
            made.append(backend)
            return backend

        self._connect = zookeeper_server.connect_string
        yield make
        for backend in made:
            await backend.close()

    async def expire_session(self, backend: CoordinationBackend) -> None:
        assert isinstance(backend, ZooKeeperBackend)
        await asyncio.to_thread(expire_zookeeper_session, backend, self._connect)
