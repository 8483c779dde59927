"""The built-in memory transport passes the transport conformance kit (tests that need real
sockets or heartbeats are skipped by capability)."""

from __future__ import annotations

from waltz_core.testing.conformance.transport import TransportConformance


class TestMemoryTransport(TransportConformance):
    backend_name = "memory"
