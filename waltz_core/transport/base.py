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

    Optionally it has a boolean ``encrypted`` attribute (tcp: True with TLS); a transport without
    it reports security itself (zmq logs its own plaintext warning). See :func:`is_plaintext`.
    """

    name: str

    async def connect(self, address: str) -> Connection:
        """Connect to ``address`` (``host:port``)."""

    async def listen(self, host: str, port: int, handler: ConnectionHandler) -> Listener:
        """Bind ``host:port`` (port 0 = any free port) and serve connections with ``handler``."""

    async def aclose(self) -> None:
        """Release transport-wide resources (contexts, thread pools); idempotent."""


def is_plaintext(transport: object) -> bool:
    """True when the transport says its links are not encrypted (``encrypted is False``).

    Processes log a development-mode warning then; a transport that does not say is not guessed at.
    """
    return getattr(transport, "encrypted", None) is False
