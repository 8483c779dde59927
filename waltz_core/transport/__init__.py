"""Transports: the frame-oriented seam (:mod:`.base`), the in-memory built-in and the message channel."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import TransportConfig, backend_options
from .base import (
    Connection,
    ConnectionHandler,
    Listener,
    Transport,
    check_plaintext_allowed,
    is_loopback,
    is_plaintext,
    listen_address,
)
from .channel import MessageChannel

if TYPE_CHECKING:
    from ..plugins import Registries


def open_transport(config: TransportConfig, registries: Registries) -> Transport:
    """Resolve ``config.name`` in ``registries`` (the process's runtime's) once and build the
    transport with its validated ``[transport.<name>]`` options."""
    info = registries.transport.get(config.name)
    return info.factory(config, backend_options(info.config_cls, config, "transport"))


__all__ = ["Connection", "ConnectionHandler", "Listener", "MessageChannel", "Transport", "check_plaintext_allowed",
           "is_loopback", "is_plaintext", "listen_address",
           "open_transport"]
