"""The ``tcp`` transport: connect and listen on asyncio sockets carrying length-prefixed frames."""

from __future__ import annotations

import asyncio
import logging

from waltz_core.errors import ConnectError, ProtocolError, TransportError
from waltz_core.transport.base import ConnectionHandler

from .connection import TcpConnection, format_address
from .options import TcpOptions

log = logging.getLogger("waltz.transport.tcp")


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6host]:port`` -> (host, port); ConnectError when malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConnectError(f"invalid tcp address {address!r}: expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


class TcpListener:
    """A bound TCP server; each accepted connection runs ``handler(conn)`` in its own task."""

    def __init__(self, handler: ConnectionHandler, options: TcpOptions, max_frame_size: int) -> None:
        self._handler = handler
        self._options = options
        self._max = max_frame_size
        self._server: asyncio.Server | None = None
        self._address = "?"
        self._conns: set[TcpConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    def _protocol(self) -> TcpConnection:
        return TcpConnection(self._options, self._max, on_made=self._accepted)

    def _accepted(self, conn: TcpConnection) -> None:
        if self._closed:  # accepted in the instant the listener closed
            asyncio.get_running_loop().create_task(conn.close())
            return
        self._conns.add(conn)
        task = asyncio.get_running_loop().create_task(self._run(conn), name=f"waltz-tcp-handler {conn.peer}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, conn: TcpConnection) -> None:
        try:
            await self._handler(conn)
        except (TransportError, ProtocolError) as exc:
            # The connection already logged protocol violations and timeouts with the peer address.
            log.debug("connection from %s ended: %r", conn.peer, exc)
        except Exception:
            log.exception("connection handler for %s failed", conn.peer)
        finally:
            self._conns.discard(conn)
            await conn.close()

    async def _start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(self._protocol, host, port, reuse_address=True, start_serving=False)
        except OSError as exc:
            raise ConnectError(f"cannot listen on {host}:{port}: {exc}") from exc
        self._address = format_address(self._server.sockets[0].getsockname())
        await self._server.start_serving()

    async def close(self) -> None:
        """Stop accepting, close every accepted connection and wait for their handlers; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        if self._conns:
            await asyncio.gather(*(c.close() for c in list(self._conns)), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


class TcpTransport:
    """Frames over TCP (see :class:`waltz_core.transport.base.Transport`)."""

    name = "tcp"

    def __init__(self, max_frame_size: int = 16 * 1024 * 1024, options: TcpOptions | None = None,
                 connect_timeout: float = 5.0) -> None:
        self.max_frame_size = max_frame_size
        self.options = options or TcpOptions()
        self.connect_timeout = connect_timeout

    async def connect(self, address: str) -> TcpConnection:
        """Connect to ``host:port``; ConnectError when refused, unreachable or too slow."""
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: TcpConnection(self.options, self.max_frame_size), host, port)
        except TimeoutError as exc:
            raise ConnectError(f"cannot connect to {address}: no answer within {self.connect_timeout}s") from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {address}: {exc}") from exc
        return conn

    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> TcpListener:
        """Bind ``host:port`` (0 = a free port, reported by ``listener.address``) and serve."""
        listener = TcpListener(handler, self.options, self.max_frame_size)
        await listener._start(host, port)
        return listener

    async def aclose(self) -> None:
        """Nothing transport-wide to release: connections and listeners are closed by their owners."""
        return None
