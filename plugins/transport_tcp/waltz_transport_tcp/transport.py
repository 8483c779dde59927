"""The ``tcp`` transport: connect and listen on asyncio sockets carrying length-prefixed frames.

With TLS options (:class:`TcpOptions` ``tls_*``) the same frames travel inside TLS: asyncio's SSL
transport below :class:`TcpConnection`, contexts from :mod:`.tls` built once per transport.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

from waltz_core.errors import ConfigError, ConnectError, ProtocolError, TransportError
from waltz_core.transport.base import ConnectionHandler

from .connection import TcpConnection, format_address
from .options import TcpOptions
from .tls import certificate_expiry, client_context, describe_tls_error, server_context

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

    def __init__(self, handler: ConnectionHandler, options: TcpOptions, max_frame_size: int,
                 ssl_context: ssl.SSLContext | None = None, handshake_timeout: float = 5.0) -> None:
        self._handler = handler
        self._ssl = ssl_context
        self._handshake_timeout = handshake_timeout
        self._options = options
        self._max = max_frame_size
        self._server: asyncio.Server | None = None
        self._address = "?"
        self._conns: set[TcpConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()  #: closes of connections accepted as the listener closed
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    def _protocol(self) -> TcpConnection:
        return TcpConnection(self._options, self._max, on_made=self._accepted, tls=self._ssl is not None)

    def _accepted(self, conn: TcpConnection) -> None:
        if self._closed:  # accepted in the instant the listener closed
            task = asyncio.get_running_loop().create_task(conn.close())
            self._closing.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(self._closing.discard)
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

    async def start(self, host: str, port: int) -> None:
        """Bind ``host:port`` and start serving; ConnectError when it cannot. Called by :meth:`TcpTransport.listen`."""
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._protocol, host, port, reuse_address=True, start_serving=False, ssl=self._ssl,
                ssl_handshake_timeout=self._handshake_timeout if self._ssl is not None else None)
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
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
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
        # Built now so a bad certificate path fails at start-up (ConfigError), not at the first connect.
        self._server_ssl = server_context(self.options)
        self._client_ssl = client_context(self.options)

    @property
    def encrypted(self) -> bool:
        """True when this transport's links use TLS (processes warn about plaintext when False)."""
        return self.options.tls_enabled

    @property
    def authenticates_clients(self) -> bool:
        """True when listeners admit only clients with a certificate of ``tls_ca`` (mutual TLS)."""
        return self._server_ssl is not None and self._server_ssl.verify_mode == ssl.CERT_REQUIRED

    def certificate_expiry(self) -> dict[str, float]:
        """When the certificates of ``tls_cert`` and ``tls_ca`` expire (epoch seconds; see
        :func:`waltz_core.transport.base.certificate_expiry`)."""
        return certificate_expiry(self.options) if self.options.tls_enabled else {}

    async def connect(self, address: str) -> TcpConnection:
        """Connect to ``host:port``; ConnectError when refused, unreachable or too slow."""
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        tls = self._client_ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: TcpConnection(self.options, self.max_frame_size, tls=tls is not None, outbound=True), host, port,
                    ssl=tls, server_hostname=(self.options.tls_server_name or host) if tls is not None else None)
                # asyncio calls connection_made before create_connection returns; uvloop calls it
                # soon after. Either way the connection is usable only once it was made.
                await conn.made()
        except TimeoutError as exc:
            raise ConnectError(f"cannot connect to {address}: no answer within {self.connect_timeout}s") from exc
        except ssl.SSLError as exc:
            raise ConnectError(f"cannot connect to {address}: TLS handshake failed: {describe_tls_error(exc)}") from exc
        except ConnectionResetError as exc:
            detail = " during the TLS handshake (does the server use TLS?)" if tls is not None else ""
            raise ConnectError(f"cannot connect to {address}: connection reset{detail}: {exc}") from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {address}: {exc}") from exc
        return conn

    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> TcpListener:
        """Bind ``host:port`` (0 = a free port, reported by ``listener.address``) and serve."""
        if self.options.tls_enabled and self._server_ssl is None:
            raise ConfigError("tcp transport: TLS is on but tls_cert is not set, so it cannot listen with TLS")
        listener = TcpListener(handler, self.options, self.max_frame_size, self._server_ssl, self.connect_timeout)
        await listener.start(host, port)
        return listener

    async def aclose(self) -> None:
        """Nothing transport-wide to release: connections and listeners are closed by their owners."""
        return None
