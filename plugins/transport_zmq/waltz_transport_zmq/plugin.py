"""Entry-point plugin module of the ZeroMQ transport: registers ``zmq`` (hook implementations only)."""

from __future__ import annotations

from typing import Any

from waltz_core.hookspecs import hookimpl

from .options import ZmqOptions
from .transport import zmq_factory


@hookimpl
def waltz_register_transports(registry: Any) -> None:
    registry.add(
        "zmq",
        zmq_factory,
        config_cls=ZmqOptions,
        description="ZeroMQ DEALER/ROUTER, credit windows, heartbeats, optional CURVE encryption",
        capabilities={"heartbeat"},
    )
