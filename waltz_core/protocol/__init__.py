"""Sans-IO wire protocol: frozen message classes and pure encode/decode functions.

No sockets, no event loop, no clocks here. Three message families, each with its own protocol
id and versions: :mod:`.client` (client <-> server), :mod:`.storage` (server <-> storage node)
and :mod:`.admin` (storage admin port); :mod:`.framing` and :mod:`.handshake` are shared. Each
message class declares its wire layout once, on its fields; :mod:`.layout` derives every
family's codec from those declarations (a few hot messages add hand-written fast paths).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from . import admin, client, storage
from .wire import Record, RecordHeader, ReqId, SessionInfo, crc32


@attrs.frozen
class Family:
    """A message family: what a link speaks after the handshake."""

    name: str
    protocol: bytes
    versions: tuple[int, ...]
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes | memoryview], Any]
    messages: tuple[type, ...]


CLIENT = Family("client/server", client.PROTOCOL, client.VERSIONS, client.encode, client.decode, client.MESSAGES)
STORAGE = Family("storage", storage.PROTOCOL, storage.VERSIONS, storage.encode, storage.decode, storage.MESSAGES)
ADMIN = Family("storage admin", admin.PROTOCOL, admin.VERSIONS, admin.encode, admin.decode, admin.MESSAGES)
FAMILIES = (CLIENT, STORAGE, ADMIN)

__all__ = ["ADMIN", "CLIENT", "FAMILIES", "STORAGE", "Family", "Record", "RecordHeader", "ReqId", "SessionInfo",
           "admin", "client", "crc32", "storage"]
