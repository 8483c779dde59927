"""Waltz ZeroMQ transport: DEALER/ROUTER with credit windows, heartbeats and optional CURVE."""

from __future__ import annotations

import importlib.metadata

from . import keys, wire
from .connection import ZmqConnection
from .keys import create_keypair
from .options import ZmqOptions
from .transport import ZmqListener, ZmqTransport, zmq_factory

try:
    __version__ = importlib.metadata.version("waltz-transport-zmq")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["ZmqConnection", "ZmqListener", "ZmqOptions", "ZmqTransport", "create_keypair", "keys", "wire", "zmq_factory"]
