"""The coordination conformance kit against the built-in ``local`` backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.coordination import open_coordination
from waltz_core.coordination.base import CoordinationBackend
from waltz_core.coordination.local import LocalCoordination
from waltz_core.runtime import Runtime
from waltz_core.testing.conformance.coordination import BackendFactory, CoordinationConformance


class TestLocalConformance(CoordinationConformance):
    event_timeout = 10.0

    @pytest.fixture
    async def backend_factory(self, tmp_path: Path, runtime: Runtime) -> AsyncIterator[BackendFactory]:
        config = CoordinationConfig(name="local", connect=str(tmp_path / "coord"), session_timeout=1.5)
        made: list[CoordinationBackend] = []

        async def make() -> CoordinationBackend:
            backend = open_coordination(config, runtime.registries)
            await backend.start()
            made.append(backend)
            return backend

        yield make
        for backend in made:
            await backend.close()

    async def expire_session(self, backend: CoordinationBackend) -> None:
        assert isinstance(backend, LocalCoordination)
        await backend.force_expire()
