"""The built-in ``memory`` transport: connections inside one process, for tests.

Listeners are found by address in a process-wide table (``memory:<n>`` addresses are handed
out for port 0). Each direction is a bounded :class:`asyncio.Queue`, so a slow reader applies
back pressure to the writer exactly as a socket buffer would. Everything runs on one event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import attrs

from ..errors import ConnectError, ConnectionClosedError, FrameTooLargeError, ProtocolError
from .base import ConnectionHandler

_CLOSED = object()  # sentinel queued to wake the reader on close
_listeners: dict[str, MemoryListener] = {}
_ports = itertools.count(1)


@attrs.frozen
class MemoryOptions:
    """Options of the memory transport (``[transport.memory]``)."""

    queue_frames: int = attrs.field(default=1024, metadata={"doc": "Frames buffered per direction before send waits."})


class MemoryConnection:
    def __init__(self, peer: str, inbox: asyncio.Queue[object], outbox: asyncio.Queue[object], max_frame_size: int) -> None:
        self._peer = peer
        self._inbox = inbox
        self._outbox = outbox
        self._max = max_frame_size
        self._closed = False
        self.other: MemoryConnection | None = None

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, frame: bytes) -> None:
        if self._closed:
            raise ConnectionClosedError(f"connection to {self._peer} is closed")
        if not frame:
            raise ProtocolError("empty frames are reserved for heartbeats")
        if len(frame) > self._max:
            raise FrameTooLargeError(f"frame of {len(frame)} bytes exceeds the maximum of {self._max}")
        await self._outbox.put(bytes(frame))
        if self._closed:  # closed while we waited for room
            raise ConnectionClosedError(f"connection to {self._peer} is closed")

    async def send_many(self, frames: Sequence[bytes]) -> None:
        for f in frames:
            await self.send(f)

    async def recv(self) -> bytes:
        item = await self._inbox.get()
        if item is _CLOSED:
            self._inbox.put_nowait(_CLOSED)  # every later recv sees the close too
            self._closed = True
            raise ConnectionClosedError(f"connection to {self._peer} was closed")
        return item  # type: ignore[return-value]

    def _mark_closed(self) -> None:
        if not self._closed:
            self._closed = True
            _force_put(self._inbox, _CLOSED)

    async def close(self) -> None:
        if self._closed and self.other is not None and self.other._closed:
            return
        self._mark_closed()
        if self.other is not None:
            # Frames already queued stay readable; the peer's recv raises once it reaches the sentinel.
            _force_put(self.other._inbox, _CLOSED)


def _force_put(q: asyncio.Queue[object], item: object) -> None:
    """Queue ``item`` even into a full queue (close must never wait on a slow reader)."""
    try:
        q.put_nowait(item)
    except asyncio.QueueFull:
        q._queue.append(item)  # type: ignore[attr-defined]  # bypass maxsize, then wake getters
        q._wakeup_next(q._getters)  # type: ignore[attr-defined]


class MemoryListener:
    def __init__(self, address: str, handler: ConnectionHandler, transport: MemoryTransport) -> None:
        self._address = address
        self._handler = handler
        self._transport = transport
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[MemoryConnection] = set()
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    def _accept(self, conn: MemoryConnection) -> None:
        self._conns.add(conn)
        task = asyncio.get_running_loop().create_task(self._run(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, conn: MemoryConnection) -> None:
        try:
            await self._handler(conn)
        finally:
            self._conns.discard(conn)
            await conn.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _listeners.pop(self._address, None)
        for conn in list(self._conns):
            await conn.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class MemoryTransport:
    name = "memory"

    def __init__(self, max_frame_size: int = 16 * 1024 * 1024, options: MemoryOptions | None = None) -> None:
        self.max_frame_size = max_frame_size
        self.options = options or MemoryOptions()

    async def connect(self, address: str) -> MemoryConnection:
        listener = _listeners.get(address)
        if listener is None:
            raise ConnectError(f"nothing listens on memory address {address!r}")
        n = self.options.queue_frames
        a_to_b: asyncio.Queue[object] = asyncio.Queue(n)
        b_to_a: asyncio.Queue[object] = asyncio.Queue(n)
        client = MemoryConnection(address, inbox=b_to_a, outbox=a_to_b, max_frame_size=self.max_frame_size)
        server = MemoryConnection(f"{address}-client", inbox=a_to_b, outbox=b_to_a, max_frame_size=listener._transport.max_frame_size)
        client.other, server.other = server, client
        listener._accept(server)
        return client

    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> MemoryListener:
        if port == 0:
            port = next(_ports) + 40000
            while f"{host}:{port}" in _listeners:
                port = next(_ports) + 40000
        address = f"{host}:{port}"
        if address in _listeners:
            raise ConnectError(f"memory address {address} is already in use")
        listener = MemoryListener(address, handler, self)
        _listeners[address] = listener
        return listener

    async def aclose(self) -> None:
        return None
