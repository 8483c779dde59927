"""Waltz TCP transport (reference): asyncio sockets, length-prefixed frames, heartbeats, back pressure."""

from __future__ import annotations

from .connection import TcpConnection
from .options import TcpOptions
from .transport import TcpListener, TcpTransport

__all__ = ["TcpConnection", "TcpListener", "TcpOptions", "TcpTransport"]
