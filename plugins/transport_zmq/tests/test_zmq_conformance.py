"""The zmq transport passes the transport conformance kit unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from waltz_core.testing.conformance.transport import TransportConformance

HEARTBEAT_INTERVAL = 0.1
HEARTBEAT_TIMEOUT = 0.6


class TestZmqTransport(TransportConformance):
    backend_name = "zmq"
    capabilities = frozenset({"heartbeat"})
    idle_timeout = HEARTBEAT_TIMEOUT

    @pytest.fixture
    def transport_options(self) -> dict[str, Any]:
        return {"heartbeat_interval": HEARTBEAT_INTERVAL, "heartbeat_timeout": HEARTBEAT_TIMEOUT}
