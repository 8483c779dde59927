"""The tcp transport passes the transport conformance kit, plus TCP-specific checks."""

from __future__ import annotations

from typing import Any

import pytest

from waltz_core.testing.conformance.transport import TransportConformance

HEARTBEAT_INTERVAL = 0.1
IDLE_TIMEOUT = 0.6


class TestTcpTransport(TransportConformance):
    backend_name = "tcp"
    capabilities = frozenset({"heartbeat", "raw-socket", "send-nowait"})
    idle_timeout = IDLE_TIMEOUT

    @pytest.fixture
    def transport_options(self) -> dict[str, Any]:
        return {"heartbeat_interval": HEARTBEAT_INTERVAL, "idle_timeout": IDLE_TIMEOUT}
