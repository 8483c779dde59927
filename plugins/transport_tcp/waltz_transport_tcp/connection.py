"""One framed TCP connection: an :class:`asyncio.BufferedProtocol` plus the Connection API.

Bytes read from the socket go through the sans-IO :class:`~waltz_core.protocol.framing.FrameDecoder`
into a bounded deque; when the deque holds too many frames or bytes the socket stops being read
until :meth:`TcpConnection.recv` drains it, so a slow consumer pushes back on its peer instead of
buffering without bound. Small frames sent during one event-loop iteration are gathered and go to
the asyncio transport in one write at its end (frames of several partitions to one storage node
share a syscall); ``send`` waits only while the transport's buffer is above its high-water mark. A timer per connection writes heartbeats when the
connection is idle and fails it with :class:`~waltz_core.errors.PeerTimeoutError` when nothing
arrived for the idle timeout. Every method runs on the event loop that made the connection.
With TLS the protocol sits above asyncio's SSL transport (``tls=True``): the same code, and a peer
ending the link with a TLS alert is reported as such.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import cast

from waltz_core.errors import (
    ConnectionClosedError,
    FrameTooLargeError,
    PeerTimeoutError,
    ProtocolError,
    TransportError,
)
from waltz_core.protocol.framing import HEARTBEAT, LENGTH, FrameDecoder, encode_frames
from waltz_core.timeouts import wait_for

from .options import TcpOptions
from .tls import describe_tls_error, looks_like_tls

log = logging.getLogger("waltz.transport.tcp")

#: Frames up to this size are gathered with their length prefix and written once per event-loop
#: iteration; larger ones are written as prefix + payload so a multi-megabyte payload is not
#: copied once more.
_COPY_LIMIT = 64 * 1024
#: Gathered bytes that are written at once, without waiting for the end of the iteration.
_GATHER_LIMIT = 256 * 1024


def format_address(sockaddr: object) -> str:
    """``host:port`` (``[host]:port`` for IPv6) from a socket address tuple."""
    if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
        host, port = sockaddr[0], sockaddr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(sockaddr)


class TcpConnection(asyncio.BufferedProtocol):
    """A framed TCP connection (see :class:`waltz_core.transport.base.Connection`).

    Created by the event loop as the protocol of a socket; ``on_made`` is called once the socket
    is connected (the listener starts its handler there) and ``on_lost`` once it is gone.
    """

    def __init__(
        self,
        options: TcpOptions,
        max_frame_size: int,
        on_made: Callable[[TcpConnection], None] | None = None,
        on_lost: Callable[[TcpConnection], None] | None = None,
        tls: bool = False,
        outbound: bool = False,
    ) -> None:
        self._opts = options
        self._tls = tls
        self._outbound = outbound
        self._first_bytes = True
        self._max = max_frame_size
        self._on_made = on_made
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._decoder = FrameDecoder(max_frame_size)
        self._read_buffer = memoryview(bytearray(options.read_chunk_size))
        self._frames: deque[bytes] = deque()
        self._queued_bytes = 0
        self._reading_paused = False
        self._recv_waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        #: small frames sent in this event-loop iteration (prefix, payload, ...), written together
        #: by _write_gathered at its end: one syscall (and one wake-up of the peer) for all the
        #: frames that callbacks of one iteration send on this connection
        self._gathered: list[bytes] = []
        self._gathered_bytes = 0
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._error: TransportError | ProtocolError | None = None
        self._lost: asyncio.Future[None] = self._loop.create_future()
        self._made: asyncio.Future[None] = self._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._rx_activity = False
        self._tx_activity = False
        self._last_rx = 0.0
        self._tick_due = 0.0
        hb, idle = options.heartbeat_interval, options.idle_timeout
        self._tick_interval = hb if hb > 0 else idle / 4

    # ------------------------------------------------------------------------ Connection API
    @property
    def peer(self) -> str:
        return self._peer

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, frame: bytes) -> None:
        """Write one frame; waits only while the write buffer is above its high-water mark."""
        self.send_nowait(frame)
        if self._write_paused:
            await self._drain()

    def send_nowait(self, frame: bytes) -> None:
        """:meth:`send` without waiting for room: for a caller that bounds what it has in flight."""
        if self._closed:
            raise self._send_error()
        n = len(frame)
        if n == 0:
            raise ProtocolError("empty frames are reserved for heartbeats")
        if n > self._max:
            raise FrameTooLargeError(f"frame of {n} bytes exceeds the maximum of {self._max}")
        transport = self._transport
        assert transport is not None
        if n <= _COPY_LIMIT:
            gathered = self._gathered
            if not gathered:
                self._loop.call_soon(self._write_gathered)
            gathered += (LENGTH.pack(n), frame)
            self._gathered_bytes += n
            if self._gathered_bytes >= _GATHER_LIMIT:
                self._write_gathered()
        else:
            self._write_gathered()  # what was sent before goes first
            transport.write(LENGTH.pack(n))
            transport.write(frame)
        self._tx_activity = True

    async def send_many(self, frames: Sequence[bytes]) -> None:
        """Write a batch with one ``write`` call; nothing is written if one frame is invalid."""
        if self._closed:
            raise self._send_error()
        if not frames:
            return
        data = encode_frames(frames, self._max)  # validates every frame before anything is written
        assert self._transport is not None
        self._write_gathered()  # what was sent before goes first
        self._transport.write(data)
        self._tx_activity = True
        if self._write_paused:
            await self._drain()

    async def recv(self) -> bytes:
        """The next frame; after a close or failure, the error once every queued frame was returned.

        Cancelling a waiting ``recv`` loses no frame. One task at a time may call it.
        """
        frames = self._frames
        while not frames:
            if self._closed:
                raise self._closed_error()
            if self._recv_waiter is not None:
                raise RuntimeError("recv() called while another task is already waiting in recv()")
            waiter = self._loop.create_future()
            self._recv_waiter = waiter
            try:
                await waiter
            finally:
                self._recv_waiter = None
        frame = frames.popleft()
        self._queued_bytes -= len(frame)
        if self._reading_paused and not self._closed:
            opts = self._opts
            if len(frames) <= opts.read_queue_frames // 2 and self._queued_bytes <= opts.read_queue_bytes // 2:
                self._reading_paused = False
                assert self._transport is not None
                self._transport.resume_reading()
        return frame

    async def made(self) -> None:
        """Return once the socket is connected (``connection_made`` ran); raise if it was lost first."""
        if not self._made.done():
            await asyncio.wait({self._made, self._lost}, return_when=asyncio.FIRST_COMPLETED)
        if self._transport is None:
            raise self._closed_error()

    async def close(self) -> None:
        """Flush what is queued, then close; idempotent.

        Waits at most ``close_timeout`` for the flush (a peer that reads nothing cannot hold a
        close forever), then aborts. Frames received before the close stay readable.
        """
        transport = self._transport
        if transport is None:
            return
        if not self._closed:
            self._write_gathered()
            self._closed = True
            self._error = ConnectionClosedError(f"connection to {self._peer} was closed locally")
            self._stop_timer()
            self._wake_all()
            transport.close()
        if not self._lost.done():
            try:
                await wait_for(asyncio.shield(self._lost), self._opts.close_timeout)
            except TimeoutError:
                log.warning("connection to %s: unsent data not flushed within %ss, aborting",
                            self._peer, self._opts.close_timeout)
                transport.abort()
                await asyncio.shield(self._lost)

    # ------------------------------------------------------------------------ protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # No isinstance check: uvloop's transports implement the interface without subclassing it.
        self._transport = tr = cast(asyncio.Transport, transport)
        self._peer = format_address(transport.get_extra_info("peername"))
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1 if self._opts.nodelay else 0)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1 if self._opts.keepalive else 0)
            except OSError as exc:  # e.g. a socket type without these options; the link still works
                log.debug("connection to %s: cannot set socket options: %s", self._peer, exc)
        tr.set_write_buffer_limits(high=self._opts.write_buffer_high, low=self._opts.write_buffer_low)
        self._made.set_result(None)
        if self._tick_interval > 0:
            self._last_rx = self._loop.time()
            self._schedule_tick()
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self._rx_activity = True
        if self._first_bytes:
            self._first_bytes = False
            if not self._tls and looks_like_tls(self._read_buffer[:nbytes]):
                err = ProtocolError(f"peer {self._peer} speaks TLS but this tcp connection is plaintext "
                                    f"(set tls_cert / tls_ca in [transport.tcp])")
                log.warning("closing connection to %s: %s", self._peer, err)
                self._fail(err)
                return
        try:
            frames = self._decoder.feed(self._read_buffer[:nbytes])
        except ProtocolError as exc:
            log.warning("closing connection to %s: %s", self._peer, exc)
            self._fail(exc)
            return
        if not frames:
            return
        self._frames.extend(frames)
        self._queued_bytes += sum(map(len, frames))
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        pending = self._decoder.error
        if pending is not None:  # an oversize prefix after these frames: they stay readable, then recv raises
            log.warning("closing connection to %s: %s", self._peer, pending)
            self._fail(pending)
            return
        if not self._reading_paused and (
            len(self._frames) >= self._opts.read_queue_frames or self._queued_bytes >= self._opts.read_queue_bytes
        ):
            self._reading_paused = True
            assert self._transport is not None
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        if self._decoder.buffered:
            log.debug("connection to %s: peer closed in the middle of a frame (%d bytes dropped)",
                      self._peer, self._decoder.buffered)
        return False  # let the transport close; queued frames stay readable

    def connection_lost(self, exc: Exception | None) -> None:
        if self._error is None:
            if isinstance(exc, ssl.SSLError):
                # E.g. a mutual-TLS server refusing our certificate (TLS 1.3 tells the client after its handshake).
                self._error = ConnectionClosedError(f"TLS connection to {self._peer} failed: "
                                                    f"{describe_tls_error(exc)}")
            elif self._outbound and self._first_bytes and (exc is None or isinstance(exc, ConnectionResetError)):
                # Closed (or reset) before a single byte: the usual face of a TLS refusal (asyncio does not
                # surface the alert), so the message says what to check instead of just "closed".
                detail = f" ({exc})" if exc is not None else ""
                hint = (f"TLS connection to {self._peer} was closed by the peer before any data{detail}: the server "
                        "refused our TLS credentials (mutual TLS needs a client certificate signed by its tls_ca)"
                        if self._tls else
                        f"connection to {self._peer} was closed by the peer before any data{detail} "
                        "(a server that requires TLS closes plaintext clients: check [transport.tcp] tls_*)")
                self._error = ConnectionClosedError(hint)
            else:
                detail = f": {exc}" if exc is not None else ""
                self._error = ConnectionClosedError(f"connection to {self._peer} was closed by the peer{detail}")
        self._closed = True
        self._stop_timer()
        self._wake_all()
        if not self._lost.done():
            self._lost.set_result(None)
        if self._on_lost is not None:
            self._on_lost(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------------------ internals
    def _write_gathered(self) -> None:
        """Write the frames gathered since the last write, in one ``transport.write``."""
        gathered = self._gathered
        if not gathered:
            return
        data = b"".join(gathered)
        gathered.clear()
        self._gathered_bytes = 0
        transport = self._transport
        if not self._closed and transport is not None and not transport.is_closing():
            transport.write(data)

    async def _drain(self) -> None:
        while self._write_paused and not self._closed:
            fut = self._loop.create_future()
            self._drain_waiters.append(fut)
            await fut
        if self._closed:
            raise self._send_error()

    def _closed_error(self) -> TransportError | ProtocolError:
        err = self._error or ConnectionClosedError(f"connection to {self._peer} is closed")
        return type(err)(str(err))  # a fresh instance: re-raising one object chains its tracebacks

    def _send_error(self) -> ConnectionClosedError:
        """Sending on a closed connection is always ConnectionClosedError; the message says why."""
        err = self._error
        if err is None or isinstance(err, ConnectionClosedError):
            return ConnectionClosedError(str(err) if err else f"connection to {self._peer} is closed")
        return ConnectionClosedError(f"connection to {self._peer} is closed: {err}")

    def _wake_all(self) -> None:
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, error: TransportError | ProtocolError) -> None:
        """Close at once (no flush) because of ``error``, which ``recv`` raises after queued frames."""
        if self._closed:
            return
        self._error = error
        self._closed = True
        self._gathered.clear()
        self._stop_timer()
        self._wake_all()
        assert self._transport is not None
        self._transport.abort()

    def _tick(self) -> None:
        """Timer callback: detect a silent peer, write a heartbeat when we were silent."""
        self._timer = None
        if self._closed:
            return
        now = self._loop.time()
        opts = self._opts
        lateness = now - self._tick_due
        if lateness > self._tick_interval:
            # Our own event loop was stalled: silence we could not observe is no evidence against the peer.
            self._last_rx += lateness
        # While we stopped reading ourselves, silence says nothing about the peer.
        if self._rx_activity or self._reading_paused:
            self._rx_activity = False
            self._last_rx = now
        elif opts.idle_timeout and now - self._last_rx >= opts.idle_timeout:
            err = PeerTimeoutError(f"nothing received from {self._peer} for {now - self._last_rx:.2f}s "
                                   f"(idle timeout {opts.idle_timeout}s)")
            log.warning("closing connection to %s: %s", self._peer, err)
            self._fail(err)
            return
        if opts.heartbeat_interval and not self._tx_activity and not self._write_paused:
            assert self._transport is not None
            self._transport.write(HEARTBEAT)
        self._tx_activity = False
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        self._tick_due = self._loop.time() + self._tick_interval
        self._timer = self._loop.call_at(self._tick_due, self._tick)
