"""The shared coordination conformance kit against a real single-node etcd."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from waltz_coord_etcd.backend import EtcdBackend
from waltz_core.config import CoordinationConfig
from waltz_core.coordination import open_coordination
from waltz_core.coordination.base import CoordinationBackend
from waltz_core.runtime import Runtime
from waltz_core.testing.conformance.coordination import CoordinationConformance
from waltz_core.testing.servers import EtcdServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]  # a hang fails, never blocks CI


class TestEtcdConformance(CoordinationConformance):
    @pytest.fixture
    async def backend_factory(self, etcd_server: EtcdServer, runtime: Runtime) -> AsyncIterator:
        made: list[CoordinationBackend] = []

        async def make() -> CoordinationBackend:
            config = CoordinationConfig(name="etcd", connect=etcd_server.endpoints, session_timeout=3.0)
            backend = open_coordination(config, runtime.registries)
            await backend.start()
            made.append(backend)
            return backend

        yield make
        for backend in made:
            await backend.close()

    async def expire_session(self, backend: CoordinationBackend) -> None:
        # What the server does when a lease runs out: revoke it (its keys are deleted at once).
        assert isinstance(backend, EtcdBackend) and backend.lease_id is not None
        lease_id = backend.lease_id
        await backend._rpc("revoke (test)", lambda c: c.revoke_lease(lease_id))
