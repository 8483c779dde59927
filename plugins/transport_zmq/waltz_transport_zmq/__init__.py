"""Waltz ZeroMQ transport: DEALER/ROUTER with credit windows, heartbeats and optional CURVE."""

from __future__ import annotations

from .connection import ZmqConnection
from . import keys, wire
from .keys import create_keypair
from .options import ZmqOptions
from .transport import ZmqListener, ZmqTransport, zmq_factory

__version__ = "0.1.0"

__all__ = ["ZmqConnection", "ZmqListener", "ZmqOptions", "ZmqTransport", "create_keypair", "keys", "wire", "zmq_factory"]
