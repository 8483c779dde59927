"""MessageChannel.open: a handshake that does not complete never leaves its connection open."""

from __future__ import annotations

import asyncio

import pytest

from waltz_core.config import TransportConfig
from waltz_core.errors import HandshakeError, PeerTimeoutError
from waltz_core.protocol import CLIENT, STORAGE
from waltz_core.protocol.handshake import Hello, encode_hello
from waltz_core.runtime import Runtime
from waltz_core.transport import Connection, MessageChannel, open_transport


async def _open_against(peer: object, **open_args: object) -> tuple[Connection, asyncio.Task[MessageChannel]]:
    """Connect over the memory transport to a listener running ``peer`` and start a handshake."""
    transport = open_transport(TransportConfig(name="memory"), Runtime.load(autoload=False).registries)
    listener = await transport.listen("127.0.0.1", 0, peer)  # type: ignore[arg-type]
    conn = await transport.connect(listener.address)
    task = asyncio.create_task(MessageChannel.open(conn, CLIENT, "test", **open_args))  # type: ignore[arg-type]
    return conn, task


async def _silent(conn: Connection) -> None:
    await asyncio.Event().wait()


async def test_cancelled_handshake_closes_the_connection() -> None:
    conn, task = await _open_against(_silent)
    await asyncio.sleep(0.05)  # the hello is sent; the peer never answers
    assert not conn.closed
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert conn.closed


async def test_silent_peer_times_out_and_closes_the_connection() -> None:
    conn, task = await _open_against(_silent, timeout=0.2)
    with pytest.raises(PeerTimeoutError):
        await task
    assert conn.closed


async def test_peer_of_another_protocol_is_refused_and_closed() -> None:
    async def storage_node(peer: Connection) -> None:
        await peer.send(encode_hello(Hello(STORAGE.protocol, STORAGE.versions, "storage-node")))
        await asyncio.Event().wait()

    conn, task = await _open_against(storage_node)
    with pytest.raises(HandshakeError):
        await task
    assert conn.closed
