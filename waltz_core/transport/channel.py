"""A message channel: a transport connection plus the hello handshake and a message family.

This is where bytes become messages. Decoding errors surface as
:class:`~waltz_core.errors.ProtocolError`; the caller logs them and closes that connection
only, so a peer's bad bytes never take a process down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from ..errors import ConnectionClosedError, PeerTimeoutError
from ..protocol import Family
from ..protocol.handshake import Hello, decode_hello, encode_hello, negotiate
from .base import Connection


class MessageChannel:
    """Send and receive messages of one family over a connection."""

    __slots__ = ("conn", "family", "version", "peer_role", "_encode", "_decode")

    def __init__(self, conn: Connection, family: Family, version: int, peer_role: str) -> None:
        self.conn = conn
        self.family = family
        self.version = version
        self.peer_role = peer_role
        self._encode = family.encode
        self._decode = family.decode

    @classmethod
    async def open(cls, conn: Connection, family: Family, role: str, timeout: float = 10.0) -> MessageChannel:
        """Exchange hellos (both sides send first, then read) and agree on a version.

        The connection is closed when the handshake does not complete, for whatever reason
        (including the caller being cancelled): it belongs to nobody else yet."""
        local = Hello(family.protocol, family.versions, role)
        try:
            await conn.send(encode_hello(local))
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancellation that arrives
                # as the hello does, and the cancelled caller would go on with an open channel.
                async with asyncio.timeout(timeout):
                    frame = await conn.recv()
            except TimeoutError:
                raise PeerTimeoutError(f"no hello from {conn.peer} within {timeout}s") from None
            remote = decode_hello(frame)
            version = negotiate(local, remote)
        except BaseException:
            # Shielded: a second cancellation must not leave the connection half-closed.
            with contextlib.suppress(Exception):
                await asyncio.shield(conn.close())
            raise
        return cls(conn, family, version, remote.role)

    @property
    def closed(self) -> bool:
        return self.conn.closed

    async def send(self, msg: Any) -> None:
        await self.conn.send(self._encode(msg))

    async def send_many(self, msgs: Sequence[Any]) -> None:
        enc = self._encode
        await self.conn.send_many([enc(m) for m in msgs])

    async def recv(self) -> Any:
        """The next message; ProtocolError if the peer sent bytes that do not decode."""
        return self._decode(await self.conn.recv())

    async def close(self) -> None:
        await self.conn.close()

    def __aiter__(self) -> MessageChannel:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.recv()
        except ConnectionClosedError:
            raise StopAsyncIteration from None
