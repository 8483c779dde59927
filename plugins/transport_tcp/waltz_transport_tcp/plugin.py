"""Entry-point plugin module of the TCP transport: registers ``tcp``."""

from __future__ import annotations

from typing import Any

from waltz_core.config import TransportConfig
from waltz_core.hookspecs import hookimpl

from .options import TcpOptions
from .transport import TcpTransport


def tcp_factory(config: TransportConfig, options: TcpOptions | None) -> TcpTransport:
    """Build the transport from ``[transport]`` and its validated ``[transport.tcp]`` options."""
    return TcpTransport(config.max_frame_size, options or TcpOptions(), connect_timeout=config.connect_timeout)


@hookimpl
def waltz_register_transports(registry: Any) -> None:
    registry.add(
        "tcp",
        tcp_factory,
        config_cls=TcpOptions,
        description="asyncio TCP, length-prefixed frames, heartbeats, back pressure (reference transport)",
        capabilities={"heartbeat", "raw-socket"},
    )
