"""The ``zmq`` transport: Waltz frames over ZeroMQ DEALER/ROUTER (pyzmq, ``zmq.asyncio``).

Pattern. A listener binds one ROUTER socket; every ``connect`` opens its own DEALER. Waltz links
are full-duplex, unsolicited in both directions (feeds push, several requests in flight), which
rules out REQ/REP's lock-step; PUSH/PULL and PUB/SUB are one-way. DEALER/ROUTER is ZeroMQ's
asynchronous pair: the ROUTER prefixes each message with the sender's routing id, so the listener
demultiplexes peers by routing id into one :class:`~.connection.ZmqConnection` each (one
``handler(conn)`` task per peer, started by the peer's HELLO) and addresses replies with it.
A DEALER per logical connection keeps each client link's ordering, window and close independent.

ZeroMQ hides what a frame transport must expose, so this module adds it back:

* **Connection and failure**: ``connect`` sends HELLO and waits for WELCOME. A socket monitor on
  the DEALER turns a refused TCP connect (``CONNECT_RETRIED``), a failed CURVE handshake
  (``HANDSHAKE_FAILED_AUTH``/``_PROTOCOL``/``_NO_DETAIL``) or a disconnect into a prompt
  :class:`~waltz_core.errors.ConnectError`; otherwise ``connect_timeout`` bounds the wait.
  After the link is up, a DEALER disconnect ends it (ZeroMQ would reconnect silently and lose
  what was in flight); frames carry a sequence number so any gap is detected, never delivered.
* **Dead peers**: PING heartbeats both ways when idle; silence for ``heartbeat_timeout`` raises
  :class:`~waltz_core.errors.PeerTimeoutError`. A peer that closes sends CLOSE, so ``recv``
  raises ConnectionClosedError promptly, after every frame sent before the CLOSE.
* **No silent drops**: the ROUTER runs with ``ROUTER_MANDATORY`` (at the high-water mark a send
  fails with EAGAIN, retried with back-off for that peer only; an unknown peer fails with
  EHOSTUNREACH instead of vanishing), and every direction has a credit window
  (see :mod:`.connection`) so ``send`` waits when the peer's application does not read.
* **LINGER 0** on every socket, so closing never blocks and the context terminates at once;
  the close handshake (CLOSE / CLOSE_ACK, bounded by ``close_timeout``) is what flushes.
* **Oversize frames** are refused on send; on receive they close that link only.
  ``ZMQ_MAXMSGSIZE`` (max frame + 64 KiB) makes libzmq drop a peer announcing anything larger
  before it is buffered. Malformed messages close that peer only; the listener carries on.
* **CURVE** (optional, see :mod:`.keys`): the ROUTER is a CURVE server and a ZAP handler
  (``zmq.auth.asyncio.AsyncioAuthenticator``) admits only allowed client public keys. Without
  CURVE the transport logs a warning: traffic is then plaintext and unauthenticated.

The wire format is documented in :mod:`.wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
import zmq.auth
import zmq.auth.asyncio
from zmq.utils.monitor import parse_monitor_message

from waltz_core.config import TransportConfig
from waltz_core.errors import ConnectError, ProtocolError, TransportError
from waltz_core.timeouts import cancel_and_wait
from waltz_core.transport.base import ConnectionHandler

from . import keys, wire
from .connection import LinkStats, PeerSender, ZmqConnection, settled
from .options import ZmqOptions

log = logging.getLogger("waltz.transport.zmq")

#: ZAP domain of Waltz listeners (the authenticator answers for this domain only).
ZAP_DOMAIN = "waltz"
_MAXMSG_SLACK = 64 * 1024
_DRAIN_BATCH = 256
_MONITOR_EVENTS = (zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_PROTOCOL_ERRORS = {
    getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000001):
        "security mechanism mismatch (CURVE on one side only?)",
}


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6host]:port`` -> (host, port); ConnectError when malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConnectError(f"invalid zmq address {address!r}: expected host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


async def _read_loop(sock: zmq.asyncio.Socket, handle: Callable[[list[bytes]], None]) -> None:
    """Feed every message of ``sock`` to ``handle``, draining bursts without re-awaiting each one."""
    while True:
        handle(await sock.recv_multipart())
        for _ in range(_DRAIN_BATCH):
            fut = settled(sock.recv_multipart(flags=zmq.DONTWAIT))
            exc = fut.exception()
            if exc is not None:
                if isinstance(exc, zmq.Again):
                    break
                raise exc
            handle(fut.result())


class _AllowedClients:
    """ZAP credentials provider: the configured public keys plus the directory's, re-read each time."""

    def __init__(self, keys_z85: list[str], directory: str) -> None:
        self._static = {k.encode("ascii") for k in keys_z85}
        self._directory = directory

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._static:
            return True
        if self._directory:
            try:
                allowed = key in keys.load_public_keys_dir(self._directory)
            except Exception:  # an unreadable file must not crash the ZAP handler
                log.exception("cannot read allowed CURVE client keys from %s", self._directory)
                return False
            if allowed:
                return True
        log.warning("refused a CURVE client with public key %s", key.decode("ascii", "replace"))
        return False


class ZmqListener:
    """A bound ROUTER; each peer that sends HELLO gets a connection and a ``handler(conn)`` task."""

    def __init__(self, transport: ZmqTransport, router: zmq.asyncio.Socket, address: str,
                 handler: ConnectionHandler) -> None:
        self._transport = transport
        self._router = router
        self._address = address
        self._handler = handler
        self._opts = transport.options
        self._conns: dict[bytes, ZmqConnection] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"waltz-zmq-listener {address}")

    @property
    def address(self) -> str:
        return self._address

    async def _read(self) -> None:
        try:
            await _read_loop(self._router, self._dispatch)
        except zmq.ZMQError as exc:
            if not self._closed:
                log.error("listener %s stopped reading: %s", self._address, exc)

    def _dispatch(self, parts: list[bytes]) -> None:
        try:
            self._dispatch_one(parts)
        except Exception:  # a peer's bytes must never stop the listener
            log.exception("listener %s: failed to handle a message", self._address)

    def _reply(self, rid: bytes, header: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):
            settled(self._router.send_multipart([rid, header], flags=zmq.DONTWAIT)).exception()

    def _dispatch_one(self, parts: list[bytes]) -> None:
        rid = parts[0]
        if len(parts) < 2 or not parts[1]:
            log.warning("listener %s: malformed message from peer %s; closing it", self._address, rid.hex())
            self._reply(rid, wire.encode_close(wire.CloseReason.PROTOCOL_ERROR))
            return
        body = parts[1:]
        kind = body[0][0]
        conn = self._conns.get(rid)
        if conn is not None:
            if kind == wire.HELLO:
                conn.on_message([b"\xff"])  # a second HELLO: protocol error on that link
            else:
                conn.on_message(body)
            return
        if kind == wire.HELLO:
            self._accept(rid, body[0])
        elif kind not in (wire.CLOSE, wire.CLOSE_ACK, wire.PING, wire.ACK, wire.PROBE):
            # A peer we do not know (we restarted, or it never said HELLO) tells us nothing useful.
            log.info("listener %s: message from unknown peer %s; telling it to close", self._address, rid.hex())
            self._reply(rid, wire.encode_close(wire.CloseReason.UNKNOWN_CONNECTION))

    def _accept(self, rid: bytes, header: bytes) -> None:
        if self._closed:
            self._reply(rid, wire.encode_close(wire.CloseReason.LISTENER_CLOSED))
            return
        try:
            window = wire.decode_open(header)
        except ProtocolError as exc:
            log.warning("listener %s: bad HELLO from %s: %s", self._address, rid.hex(), exc)
            self._reply(rid, wire.encode_close(wire.CloseReason.PROTOCOL_ERROR))
            return
        sender = PeerSender(self._router, [rid], LinkStats())
        try:
            if not sender.try_send([wire.encode_open(wire.WELCOME, self._opts.window_frames,
                                                     self._opts.window_bytes)]):
                log.warning("listener %s: cannot answer %s (high-water mark)", self._address, rid.hex())
                return
        except Exception as exc:  # noqa: BLE001 - whatever the send met, the peer is dropped
            log.info("listener %s: peer %s left before WELCOME: %s", self._address, rid.hex(), exc)
            return
        conn = ZmqConnection(f"{self._address}/{rid.hex()}", sender, self._opts, self._transport.max_frame_size,
                             window, on_teardown=lambda c: self._forget(rid, c))
        self._conns[rid] = conn
        task = asyncio.get_running_loop().create_task(self._run(conn), name=f"waltz-zmq-handler {conn.peer}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget(self, rid: bytes, conn: ZmqConnection) -> None:
        if self._conns.get(rid) is conn:
            del self._conns[rid]

    async def _run(self, conn: ZmqConnection) -> None:
        try:
            await self._handler(conn)
        except (TransportError, ProtocolError) as exc:
            log.debug("connection from %s ended: %r", conn.peer, exc)
        except Exception:
            log.exception("connection handler for %s failed", conn.peer)
        finally:
            await conn.close()

    async def close(self) -> None:
        """Close every accepted connection (telling the peers), stop the handlers, unbind; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._conns:
            await asyncio.gather(*(c.close() for c in list(self._conns.values())), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await cancel_and_wait(self._reader)
        self._router.close(linger=0)
        self._transport.forget_listener(self)


class _ClientLink:
    """The sockets and tasks behind one client connection (DEALER, its monitor, the reader)."""

    def __init__(self, dealer: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        self.dealer = dealer
        self.monitor = monitor
        self.conn: ZmqConnection | None = None
        self.welcome: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self.tasks: list[asyncio.Task[None]] = []
        self.early: list[list[bytes]] = []  # after WELCOME, before the connection object exists

    def attach(self, conn: ZmqConnection) -> None:
        self.conn = conn
        early, self.early = self.early, []
        for parts in early:
            conn.on_message(parts)

    def on_message(self, parts: list[bytes]) -> None:
        if self.conn is not None:
            self.conn.on_message(parts)
            return
        if self.welcome.done():
            self.early.append(parts)
            return
        header = parts[0] if parts else b""
        try:
            if header[:1] == bytes([wire.WELCOME]):
                self.welcome.set_result(wire.decode_open(header))
            elif header[:1] == bytes([wire.CLOSE]):
                reason = wire.decode_close(header)
                self.welcome.set_exception(ConnectError(f"the listener refused the connection: {reason.describe()}"))
            else:
                raise ProtocolError(f"unexpected message kind {header[:1]!r} before WELCOME")
        except ProtocolError as exc:
            self.welcome.set_exception(ConnectError(f"bad answer to HELLO: {exc}"))

    def on_event(self, event: int, value: int) -> None:
        if self.conn is not None:
            if event == zmq.EVENT_DISCONNECTED:
                self.drain()
                self.conn.on_lost("disconnected")
            return
        if self.welcome.done():
            return
        if event == zmq.EVENT_CONNECT_RETRIED:
            error = ConnectError("connection refused")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            error = ConnectError(f"the server refused our CURVE credentials (ZAP status {value})")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = _PROTOCOL_ERRORS.get(value, f"ZMTP protocol error 0x{value:x}")
            error = ConnectError(f"security handshake failed: {why}")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            error = ConnectError("security handshake failed (CURVE on one side only, or a wrong server public key?)")
        elif event == zmq.EVENT_DISCONNECTED:
            error = ConnectError("disconnected during the handshake (wrong server key or not a Waltz zmq listener?)")
        else:
            return
        self.welcome.set_exception(error)

    def drain(self) -> None:
        """Hand every message already queued in the DEALER to the connection (before a disconnect)."""
        while not self.dealer.closed:
            fut = settled(self.dealer.recv_multipart(flags=zmq.DONTWAIT))
            if fut.exception() is not None:
                return
            self.on_message(fut.result())

    async def read(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await _read_loop(self.dealer, self.on_message)

    async def watch(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            while True:
                event = parse_monitor_message(await self.monitor.recv_multipart())
                self.on_event(event["event"], event["value"])

    def teardown(self) -> None:
        if not self.welcome.done():
            self.welcome.cancel()
        elif not self.welcome.cancelled():
            self.welcome.exception()  # seen: a failure the connect did not wait for is not logged as lost
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        if not self.dealer.closed:
            with contextlib.suppress(zmq.ZMQError):
                self.dealer.disable_monitor()
            self.dealer.close(linger=0)
        self.monitor.close(linger=0)


class ZmqTransport:
    """Frames over ZeroMQ DEALER/ROUTER (see :class:`waltz_core.transport.base.Transport`).

    One ``zmq.asyncio.Context`` (and, with CURVE, one ZAP authenticator) per transport; all
    methods run on the caller's event loop. ``aclose`` closes what is still open and terminates
    the context without blocking (every socket has LINGER 0).
    """

    name = "zmq"

    def __init__(self, max_frame_size: int = 16 * 1024 * 1024, options: ZmqOptions | None = None,
                 connect_timeout: float = 5.0) -> None:
        self.max_frame_size = max_frame_size
        self.options = options or ZmqOptions()
        self.connect_timeout = connect_timeout
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self._listeners: set[ZmqListener] = set()
        self._clients: set[ZmqConnection] = set()
        self._closed = False
        self._warned_plaintext = False
        self._client_curve = self._load_client_curve()
        self._server_secret = (keys.load_secret_keypair(self.options.curve_server_secret_key_file)[1]
                               if self.options.curve_server_secret_key_file else None)

    @property
    def encrypted(self) -> bool:
        """True when this transport's listeners use CURVE (a server secret key is configured): the
        rule of ``waltz server start`` and ``waltz storage start`` is about listening in plaintext."""
        return self._server_secret is not None

    @property
    def authenticates_clients(self) -> bool:
        """True when CURVE listeners admit only allowed client keys (an allow-list or directory)."""
        return self.encrypted and bool(self.options.curve_allowed_client_keys or self.options.curve_allowed_clients_dir)

    # ------------------------------------------------------------------------------ helpers
    def _context(self) -> zmq.asyncio.Context:
        if self._closed:
            raise ConnectError("the zmq transport is closed")
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    def _load_client_curve(self) -> tuple[bytes, bytes, bytes] | None:
        """(server public, client public, client secret) or None without CURVE."""
        opts = self.options
        if not opts.curve_server_public_key_file:
            return None
        server_public = keys.load_keypair(opts.curve_server_public_key_file)[0]
        if opts.curve_client_secret_key_file:
            client_public, client_secret = keys.load_secret_keypair(opts.curve_client_secret_key_file)
        else:
            client_public, client_secret = zmq.curve_keypair()  # encrypts; cannot pass an allow-list
        return server_public, client_public, client_secret

    def _warn_plaintext(self, what: str) -> None:
        if not self._warned_plaintext:
            self._warned_plaintext = True
            log.warning("zmq transport %s without CURVE: traffic is plaintext and unauthenticated", what)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._context().socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.options.send_hwm)
        sock.setsockopt(zmq.RCVHWM, self.options.recv_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_size + _MAXMSG_SLACK)
        return sock

    def _start_authenticator(self) -> None:
        if self._auth is not None:
            return
        opts = self.options
        auth = zmq.auth.asyncio.AsyncioAuthenticator(self._context(), log=logging.getLogger("waltz.transport.zmq.zap"))
        auth.start()
        if opts.curve_allowed_client_keys or opts.curve_allowed_clients_dir:
            if opts.curve_allowed_clients_dir and not os.path.isdir(opts.curve_allowed_clients_dir):
                auth.stop()
                raise ConnectError(f"curve_allowed_clients_dir {opts.curve_allowed_clients_dir!r} is not a directory")
            provider = _AllowedClients(list(opts.curve_allowed_client_keys), opts.curve_allowed_clients_dir)
            auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=provider)
        else:
            log.warning("zmq transport: CURVE listener accepts any client key (no allowed keys configured)")
            auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
        self._auth = auth

    # ------------------------------------------------------------------------------ Transport API
    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> ZmqListener:
        """Bind a ROUTER on ``host:port`` (0 = a free port, reported by ``listener.address``)."""
        router = self._socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if ":" in host:
                router.setsockopt(zmq.IPV6, 1)
            if self._server_secret is not None:
                self._start_authenticator()
                router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
                router.setsockopt(zmq.CURVE_SERVER, 1)
                router.setsockopt(zmq.CURVE_SECRETKEY, self._server_secret)
            else:
                self._warn_plaintext("listens")
            router.bind(_endpoint(host, port or "*"))
            endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            router.close(linger=0)
            raise ConnectError(f"cannot listen on {host}:{port}: {exc}") from exc
        except BaseException:
            router.close(linger=0)
            raise
        bound_port = endpoint.rsplit(":", 1)[1]
        address = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
        listener = ZmqListener(self, router, address, handler)
        self._listeners.add(listener)
        return listener

    async def connect(self, address: str) -> ZmqConnection:
        """Open a DEALER to ``host:port`` and exchange HELLO/WELCOME.

        ConnectError when the address is malformed, the connection is refused, the CURVE
        handshake fails (credentials refused, mechanism mismatch) or nothing answers within
        ``connect_timeout``.
        """
        host, port = parse_address(address)
        dealer = self._socket(zmq.DEALER)
        monitor: zmq.asyncio.Socket | None = None
        try:
            if ":" in host:
                dealer.setsockopt(zmq.IPV6, 1)
            if self._client_curve is not None:
                server_public, client_public, client_secret = self._client_curve
                dealer.setsockopt(zmq.CURVE_SERVERKEY, server_public)
                dealer.setsockopt(zmq.CURVE_PUBLICKEY, client_public)
                dealer.setsockopt(zmq.CURVE_SECRETKEY, client_secret)
            else:
                self._warn_plaintext("connects")
            monitor = dealer.get_monitor_socket(_MONITOR_EVENTS)
            monitor.setsockopt(zmq.LINGER, 0)
            dealer.connect(_endpoint(host, port))
        except zmq.ZMQError as exc:
            if monitor is not None:
                monitor.close(linger=0)
            dealer.close(linger=0)
            raise ConnectError(f"cannot connect to {address}: {exc}") from exc
        link = _ClientLink(dealer, monitor)
        loop = asyncio.get_running_loop()
        link.tasks = [loop.create_task(link.read(), name=f"waltz-zmq-reader {address}"),
                      loop.create_task(link.watch(), name=f"waltz-zmq-monitor {address}")]
        try:
            sender = PeerSender(dealer, [], LinkStats())
            async with asyncio.timeout(self.connect_timeout):
                window = await self._hello(sender, link)
        except TimeoutError as exc:
            link.teardown()
            raise ConnectError(f"cannot connect to {address}: no answer within {self.connect_timeout}s") from exc
        except ConnectError as exc:
            link.teardown()
            raise ConnectError(f"cannot connect to {address}: {exc}") from None
        except BaseException:
            link.teardown()
            raise

        def teardown(conn: ZmqConnection) -> None:
            link.teardown()
            self._clients.discard(conn)

        conn = ZmqConnection(address, sender, self.options, self.max_frame_size, window, on_teardown=teardown)
        link.attach(conn)
        self._clients.add(conn)
        return conn

    async def _hello(self, sender: PeerSender, link: _ClientLink) -> tuple[int, int]:
        """Send HELLO and wait for WELCOME; a handshake failure reported by the monitor ends the
        wait even while HELLO is still waiting to be queued: a handshake that fails before the
        HELLO is queued (the zmq I/O thread can get there first on a busy machine) leaves the
        DEALER without a pipe, so the send would retry until the connect timeout."""
        opts = self.options
        sending = asyncio.ensure_future(sender.send([wire.encode_open(wire.HELLO, opts.window_frames,
                                                                      opts.window_bytes)]))
        try:
            await asyncio.wait((sending, link.welcome), return_when=asyncio.FIRST_COMPLETED)
            if not link.welcome.done():
                sending.result()  # sent (or failed to): the answer decides
            return await link.welcome
        finally:
            if not sending.done():
                sending.cancel()

    def forget_listener(self, listener: ZmqListener) -> None:
        """Stop tracking ``listener`` for :meth:`aclose`; called by :meth:`ZmqListener.close` once it is closed."""
        self._listeners.discard(listener)

    async def aclose(self) -> None:
        """Close listeners and client connections still open, stop ZAP, terminate the context."""
        if self._closed:
            return
        self._closed = True
        pending: list[Awaitable[None]] = [listener.close() for listener in list(self._listeners)]
        pending += [conn.close() for conn in list(self._clients)]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None


def zmq_factory(config: TransportConfig, options: ZmqOptions | None) -> ZmqTransport:
    """Build the transport from ``[transport]`` and its validated ``[transport.zmq]`` options."""
    return ZmqTransport(config.max_frame_size, options or ZmqOptions(), connect_timeout=config.connect_timeout)


__all__ = ["ZmqListener", "ZmqTransport", "parse_address", "zmq_factory"]
