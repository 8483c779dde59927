"""The built-in ``memory`` transport: connections inside one process, for tests.

Listeners are found by address in a process-wide table (``host:<n>`` addresses are handed out
for port 0). Each direction is a bounded :class:`_Pipe`, so a slow reader applies back pressure
to the writer exactly as a socket buffer would, and a close wakes every waiting sender and
receiver. Everything runs on one event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Sequence

import attrs

from ..errors import ConnectError, ConnectionClosedError, FrameTooLargeError, ProtocolError, TransportError
from .base import ConnectionHandler

log = logging.getLogger("waltz.transport.memory")

_listeners: dict[str, MemoryListener] = {}
_ports = itertools.count(1)


@attrs.frozen
class MemoryOptions:
    """Options of the memory transport (``[transport.memory]``)."""

    queue_frames: int = attrs.field(
        default=1024,
        validator=attrs.validators.ge(1),
        metadata={"doc": "Frames buffered per direction before send waits."},
    )


def _check_frame(frame: bytes, max_frame_size: int) -> None:
    n = len(frame)
    if n == 0:
        raise ProtocolError("empty frames are reserved for heartbeats")
    if n > max_frame_size:
        raise FrameTooLargeError(f"frame of {n} bytes exceeds the maximum of {max_frame_size}")


class _Pipe:
    """One direction of a connection: a bounded frame queue plus the tasks waiting on it."""

    __slots__ = ("frames", "capacity", "closed", "getter", "putters")

    def __init__(self, capacity: int) -> None:
        self.frames: deque[bytes] = deque()
        self.capacity = capacity
        self.closed = False  # no frame will be added any more; the reader drains, then sees the close
        self.getter: asyncio.Future[None] | None = None
        self.putters: deque[asyncio.Future[None]] = deque()

    def wake_getter(self) -> None:
        if self.getter is not None and not self.getter.done():
            self.getter.set_result(None)

    def wake_putter(self) -> None:
        while self.putters:
            fut = self.putters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def close(self) -> None:
        self.closed = True
        self.wake_getter()
        while self.putters:
            fut = self.putters.popleft()
            if not fut.done():
                fut.set_result(None)


class MemoryConnection:
    """One end of an in-process connection (see :class:`~waltz_core.transport.base.Connection`)."""

    def __init__(self, peer: str, inbox: _Pipe, outbox: _Pipe, max_frame_size: int) -> None:
        self._peer = peer
        self._inbox = inbox
        self._outbox = outbox
        self._max = max_frame_size
        self._closed = False
        self._error: TransportError | ProtocolError | None = None
        self.other: MemoryConnection | None = None

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def closed(self) -> bool:
        return self._closed

    async def _wait_for_room(self) -> None:
        out = self._outbox
        while len(out.frames) >= out.capacity and not self._closed:
            fut = asyncio.get_running_loop().create_future()
            out.putters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                # Pass our turn on, or a second waiting sender could sleep forever.
                if fut.done() and not fut.cancelled():
                    out.wake_putter()
                raise
        if self._closed:
            raise ConnectionClosedError(f"connection to {self._peer} is closed")

    async def send(self, frame: bytes) -> None:
        if self._closed:
            raise ConnectionClosedError(f"connection to {self._peer} is closed")
        _check_frame(frame, self._max)
        await self._wait_for_room()
        self._outbox.frames.append(bytes(frame))
        self._outbox.wake_getter()

    async def send_many(self, frames: Sequence[bytes]) -> None:
        """Validate the whole batch first (nothing is sent if one frame is invalid), then queue it."""
        if self._closed:
            raise ConnectionClosedError(f"connection to {self._peer} is closed")
        for f in frames:
            _check_frame(f, self._max)
        for f in frames:
            await self._wait_for_room()
            self._outbox.frames.append(bytes(f))
            self._outbox.wake_getter()

    async def recv(self) -> bytes:
        inbox = self._inbox
        while not inbox.frames:
            if inbox.closed:
                raise self._closed_error()
            if inbox.getter is not None:
                raise RuntimeError("recv() called while another task is already waiting in recv()")
            fut = asyncio.get_running_loop().create_future()
            inbox.getter = fut
            try:
                await fut
            finally:
                inbox.getter = None
        frame = inbox.frames.popleft()
        inbox.wake_putter()
        if len(frame) > self._max:
            # The peer runs with a larger maximum: treat it like an oversize frame announced on a wire.
            err = FrameTooLargeError(f"peer {self._peer} sent a frame of {len(frame)} bytes; the maximum is {self._max}")
            log.warning("closing connection to %s: %s", self._peer, err)
            self._shutdown(err)
            raise err
        return frame

    def _closed_error(self) -> TransportError | ProtocolError:
        err = self._error
        if err is None:
            return ConnectionClosedError(f"connection to {self._peer} was closed")
        return type(err)(str(err))  # a fresh instance: re-raising one object chains its tracebacks

    def _shutdown(self, error: TransportError | ProtocolError | None = None) -> None:
        if not self._closed:
            self._closed = True
            if error is not None:
                self._error = error
        if self.other is not None:
            self.other.mark_closed_by_peer()
        self._inbox.close()
        self._outbox.close()

    def mark_closed_by_peer(self) -> None:
        """Mark this end closed: the other end shut the connection down (called by its ``_shutdown``).

        Frames already queued for this end stay readable; the other end closes both pipes.
        """
        self._closed = True

    async def close(self) -> None:
        """Close both directions; frames already queued stay readable by the peer."""
        self._shutdown()


class MemoryListener:
    """A memory listener: runs ``handler(conn)`` in its own task per accepted connection."""

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

    @property
    def max_frame_size(self) -> int:
        """The maximum frame size of the listening transport: :meth:`MemoryTransport.connect` gives it
        to the accepted end of each connection."""
        return self._transport.max_frame_size

    def accept(self, conn: MemoryConnection) -> None:
        """Run the handler on ``conn``, this side's end of a new connection (from :meth:`MemoryTransport.connect`)."""
        self._conns.add(conn)
        task = asyncio.get_running_loop().create_task(self._run(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, conn: MemoryConnection) -> None:
        try:
            await self._handler(conn)
        except (TransportError, ProtocolError) as exc:
            log.debug("connection from %s ended: %r", conn.peer, exc)
        except Exception:
            log.exception("connection handler for %s failed", conn.peer)
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
    """In-process transport; all connections live on the calling event loop."""

    name = "memory"

    def __init__(self, max_frame_size: int = 16 * 1024 * 1024, options: MemoryOptions | None = None) -> None:
        self.max_frame_size = max_frame_size
        self.options = options or MemoryOptions()

    async def connect(self, address: str) -> MemoryConnection:
        listener = _listeners.get(address)
        if listener is None:
            raise ConnectError(f"nothing listens on memory address {address!r}")
        n = self.options.queue_frames
        a_to_b, b_to_a = _Pipe(n), _Pipe(n)
        client = MemoryConnection(address, inbox=b_to_a, outbox=a_to_b, max_frame_size=self.max_frame_size)
        server = MemoryConnection(f"{address}-client", inbox=a_to_b, outbox=b_to_a,
                                  max_frame_size=listener.max_frame_size)
        client.other, server.other = server, client
        listener.accept(server)
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
