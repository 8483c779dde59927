"""Transports: the frame-oriented seam (:mod:`.base`), the in-memory built-in and the message channel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


def open_transport(config: TransportConfig, registries: Registries | None = None) -> Transport:
    """Resolve ``config.name`` once and build the transport with its validated options."""
    from ..plugins import default_registries

    regs = registries or default_registries()
    info = regs.resolve("transport", config.name)
    options: Any = backend_options(info.config_cls, config, "transport")
    return info.factory(config, options)  # type: ignore[no-any-return]


__all__ = ["Connection", "ConnectionHandler", "Listener", "MessageChannel", "Transport", "check_plaintext_allowed",
           "is_loopback", "is_plaintext", "listen_address",
           "open_transport"]
