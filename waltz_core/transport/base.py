"""The transport seam: frame-oriented async connections and listeners.

A transport moves opaque frames (``bytes``, never empty) between two processes, in order, whole
or not at all. It knows nothing about messages: the core encodes them
(:mod:`waltz_core.protocol`) and :class:`~waltz_core.transport.channel.MessageChannel` adds the
handshake. All methods run on the caller's asyncio event loop.

Error contract (every implementation translates its library's exceptions at this boundary,
``raise ... from exc``):

* :class:`~waltz_core.errors.ConnectError` - ``connect`` could not reach a listener;
* :class:`~waltz_core.errors.ConnectionClosedError` - the connection was closed by either side;
  raised by ``recv`` once every frame received before the close has been returned, and by
  ``send`` after a close;
* :class:`~waltz_core.errors.PeerTimeoutError` - the peer stopped sending (not even heartbeats)
  for longer than the transport's idle timeout;
* :class:`~waltz_core.errors.FrameTooLargeError` - a frame above ``max_frame_size`` was announced
  by the peer: ``recv`` raises it and the connection is closed (frames of earlier reads are
  returned first).
  Passed to ``send``/``send_many`` it is raised before anything is written (a batch is all or
  nothing) and the connection stays usable; so is :class:`~waltz_core.errors.ProtocolError` for
  an empty frame (zero length is reserved for heartbeats).

Once a connection failed or was closed, ``send`` raises ConnectionClosedError (its message says
why) and ``recv`` returns the frames that arrived before, then raises the reason. The kit in
:mod:`waltz_core.testing.conformance.transport` checks all of this for every backend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Connection(Protocol):
    """One established link."""

    @property
    def peer(self) -> str:
        """The remote address, for logs."""

    @property
    def closed(self) -> bool:
        """True once either side closed the connection or it failed."""

    async def send(self, frame: bytes) -> None:
        """Queue one frame. Waits while the outgoing buffer is above its limit (back pressure)."""

    async def send_many(self, frames: Sequence[bytes]) -> None:
        """Queue several frames with one write where the transport can (batching)."""

    async def recv(self) -> bytes:
        """The next frame. Raises ConnectionClosedError after the peer closed and all frames are read."""

    async def close(self) -> None:
        """Close both directions; idempotent. Frames already queued are flushed when possible."""


ConnectionHandler = Callable[[Connection], Awaitable[None]]


@runtime_checkable
class Listener(Protocol):
    """A bound server endpoint. Each accepted connection runs ``handler(conn)`` in its own task."""

    @property
    def address(self) -> str:
        """The bound ``host:port`` (with the real port when 0 was asked for)."""

    async def close(self) -> None:
        """Stop accepting and close every connection it accepted; idempotent."""


@runtime_checkable
class Transport(Protocol):
    """What a transport backend's factory returns.

    Optionally it has two boolean attributes that the secure-by-default rule reads
    (:func:`check_plaintext_allowed`): ``encrypted`` (tcp: TLS is on; zmq: CURVE is on) and
    ``authenticates_clients`` (its listeners admit only clients with credentials: mutual TLS, a
    CURVE allow-list). A transport without them is not guessed at: it reports security itself.
    It may also have ``certificate_expiry() -> Mapping[str, float]`` (when each of its certificates
    expires; :mod:`waltz_core.transport.expiry`).

    Addresses are opaque to the core: it passes them to ``connect`` as the transport's listeners
    reported them. A transport whose addresses are not ``host:port`` also has a method
    ``listen_address(host, port) -> str`` (see :func:`listen_address`).
    """

    name: str

    async def connect(self, address: str) -> Connection:
        """Connect to ``address`` (``host:port``)."""

    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> Listener:
        """Bind ``host:port`` (port 0 = any free port) and serve connections with ``handler``."""

    async def aclose(self) -> None:
        """Release transport-wide resources (contexts, thread pools); idempotent."""


def listen_address(transport: object, host: str, port: int) -> str:
    """The address peers connect to for a listener of ``transport`` bound to ``host`` and a fixed
    ``port`` (what a cluster registers before its processes start).

    Addresses belong to the transport: one with a format of its own (``unix:/path``) says how with
    a ``listen_address(host, port)`` method; the others use ``host:port`` (``[v6]:port``).
    """
    method = getattr(transport, "listen_address", None)
    if method is not None:
        return str(method(host, port))
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback one (127.0.0.0/8, ::1, ``localhost``).

    The wildcard (``0.0.0.0``, ``::``, ``""``) and a name that does not resolve are not loopback.
    """
    import ipaddress
    import socket

    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_plaintext_allowed(transport: object, host: str, insecure: bool, key: str, *,
                            admin: bool = False) -> None:
    """The rule of ``waltz server start`` / ``waltz storage start`` (CockroachDB's model): a process
    listens in plaintext only on loopback, or when the configuration says ``insecure`` explicitly.

    ``admin``: the listener also serves the storage admin port (truncate, recover, assign), so off
    loopback it must authenticate its clients too (mutual TLS, a CURVE allow-list), not only encrypt.
    ``key`` names the setting with the address (``storage.host``) for the error.
    """
    if insecure or is_loopback(host):
        return
    from ..errors import ConfigError

    name = getattr(transport, "name", "the")
    if is_plaintext(transport):
        raise ConfigError(
            f"{key} {host!r} is not a loopback address and the {name} transport is not encrypted: configure its "
            f"TLS ([transport.tcp] tls_cert, tls_key, tls_ca) or CURVE ([transport.zmq]), or allow plaintext "
            f"explicitly with --insecure ([security] insecure = true); see docs/security.md")
    if admin and getattr(transport, "authenticates_clients", None) is False:
        raise ConfigError(
            f"{key} {host!r} is not a loopback address and the {name} transport does not authenticate its clients, "
            f"so the admin port would obey anyone who can reach it: require client certificates ([transport.tcp] "
            f"tls_ca with tls_verify_clients = true) or a CURVE allow-list ([transport.zmq] curve_allowed_client_keys "
            f"or curve_allowed_clients_dir), or allow it explicitly with --insecure ([security] insecure = true); "
            f"see docs/security.md")


def is_plaintext(transport: object) -> bool:
    """True when the transport says its links are not encrypted (``encrypted is False``).

    Processes log a development-mode warning then; a transport that does not say is not guessed at.
    """
    return getattr(transport, "encrypted", None) is False
