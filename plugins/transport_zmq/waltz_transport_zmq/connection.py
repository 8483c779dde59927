"""One logical zmq link: credit-window flow control, heartbeats and the close handshake.

The same class serves both ends. What differs is how its messages reach the socket
(:class:`PeerSender`: a DEALER of its own on the client side, the listener's shared ROUTER
plus the peer's routing id on the server side) and who feeds it received messages (the
client's reader task, or the listener's dispatcher). Everything runs on one event loop.

Flow control: the receiver grants a window (frames, bytes) in its HELLO/WELCOME and returns
credit with cumulative ACKs as its *application* consumes frames (every quarter window, or at
once after a PROBE from a sender that ran dry). So a reader that stops reading stops its peer's
sends, while the socket underneath - possibly a ROUTER shared by many peers - keeps being read.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import attrs
import zmq
import zmq.asyncio

from waltz_core.errors import (
    ConnectionClosedError,
    FrameTooLargeError,
    PeerTimeoutError,
    ProtocolError,
    TransportError,
)
from waltz_core.retry import RetryPolicy

from . import wire
from .options import ZmqOptions

T = TypeVar("T")


def settled(result: Awaitable[T]) -> asyncio.Future[T]:
    """A ``DONTWAIT`` call's result, a Future settled at once (pyzmq's hints say only Awaitable)."""
    return cast("asyncio.Future[T]", result)

log = logging.getLogger("waltz.transport.zmq")

#: Frames packed into one DATA message by send_many (bounded so one message stays modest).
_BATCH_FRAMES = 512
#: A send refused at the high-water mark: retried after 0.5 ms doubling to 20 ms (jittered: the
#: peers that share a full ROUTER do not all retry on the same tick).
_HWM_BACKOFF = RetryPolicy(initial=0.0005, maximum=0.02)

EndError = TransportError | ProtocolError


class PeerGoneError(Exception):
    """The socket cannot reach the peer any more (unknown routing id, closed socket)."""


@attrs.define(slots=True)
class LinkStats:
    """Counters for tests and diagnostics (not synchronised: one event loop)."""

    frames_sent: int = 0
    frames_received: int = 0
    credit_waits: int = 0  # sends that waited for the peer's window
    hwm_retries: int = 0  # sends ZeroMQ refused at the high-water mark and we retried


class PeerSender:
    """Puts multipart messages on a socket for one peer, never letting ZeroMQ drop them.

    ``prefix`` is ``[]`` for a DEALER and ``[routing_id]`` for the ROUTER. Sends are always
    non-blocking (``DONTWAIT``); ``EAGAIN`` (high-water mark reached; with ROUTER_MANDATORY the
    ROUTER reports it instead of dropping) is retried after a short back-off, so only this peer
    waits. ``EHOSTUNREACH`` (ROUTER: peer gone) and a closed socket raise :class:`PeerGoneError`.
    """

    __slots__ = ("_sock", "_prefix", "stats")

    def __init__(self, sock: zmq.asyncio.Socket, prefix: list[bytes], stats: LinkStats) -> None:
        self._sock = sock
        self._prefix = prefix
        self.stats = stats

    def try_send(self, parts: list[Any]) -> bool:
        """Send now if ZeroMQ has room; False at the high-water mark. Never waits."""
        if self._sock.closed:
            raise PeerGoneError("socket closed")
        fut = settled(self._sock.send_multipart(self._prefix + parts, flags=zmq.DONTWAIT, copy=False))
        exc = fut.exception()  # DONTWAIT sends resolve at once
        if exc is None:
            return True
        if isinstance(exc, zmq.Again):
            return False
        if isinstance(exc, zmq.ZMQError) and exc.errno in (errno.EHOSTUNREACH, zmq.ENOTSOCK, zmq.ETERM):
            raise PeerGoneError(str(exc)) from exc
        raise exc

    async def send(self, parts: list[Any]) -> None:
        """Send, waiting (with back-off) while ZeroMQ is at its high-water mark for this peer."""
        if self.try_send(parts):
            return  # the common case: no backoff state is made
        for delay in _HWM_BACKOFF.delays():  # endless: the peer going away raises PeerGoneError
            self.stats.hwm_retries += 1
            await asyncio.sleep(delay)
            if self.try_send(parts):
                return


class ZmqConnection:
    """One end of a zmq link (see :class:`waltz_core.transport.base.Connection`).

    Built by the transport after the HELLO/WELCOME exchange; ``peer_window`` is what the other
    side granted. ``on_teardown`` releases the socket resources (client) or the routing entry
    (listener) once the link is over.
    """

    def __init__(self, peer: str, sender: PeerSender, options: ZmqOptions, max_frame_size: int,
                 peer_window: tuple[int, int], on_teardown: Callable[[ZmqConnection], None]) -> None:
        self._peer = peer
        self._sender = sender
        self._opts = options
        self._max = max_frame_size
        self._on_teardown = on_teardown
        self.stats = sender.stats
        self._loop = asyncio.get_running_loop()
        # State: _closed = no more sends; _end = what recv raises once the inbox is empty.
        self._closed = False
        self._end: EndError | None = None
        self._torn_down = False
        self._close_started = False
        self._close_finished = asyncio.Event()
        self._close_acked = asyncio.Event()
        # Receive side.
        self._inbox: deque[bytes] = deque()
        self._inbox_bytes = 0
        self._recv_waiter: asyncio.Future[None] | None = None
        self._received = 0  # frames received (the next DATA seq we expect)
        self._consumed = 0
        self._consumed_bytes = 0
        self._acked = 0  # consumption we already reported to the peer
        self._acked_bytes = 0
        self._peer_starved = False
        # Send side.
        self._peer_window_frames, self._peer_window_bytes = peer_window
        self._sent = 0
        self._sent_bytes = 0
        self._credit = 0  # peer's cumulative consumption, from its ACKs
        self._credit_bytes = 0
        self._room_waiter: asyncio.Future[None] | None = None
        self._probe_outstanding = False
        self._send_lock = asyncio.Lock()
        # Liveness.
        now = self._loop.time()
        self._last_recv = now
        self._last_send = now
        self._heartbeat: asyncio.Task[None] | None = None
        if options.heartbeat_interval or options.heartbeat_timeout:
            self._heartbeat = self._loop.create_task(self._heartbeat_loop(), name=f"waltz-zmq-heartbeat {peer}")

    # ------------------------------------------------------------------------------ public API
    @property
    def peer(self) -> str:
        return self._peer

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self, frame: bytes) -> None:
        n = len(frame)
        if n == 0:
            raise ProtocolError("empty frames are not allowed")
        if n > self._max:
            raise FrameTooLargeError(f"frame of {n} bytes exceeds the maximum of {self._max}")

    async def send(self, frame: bytes) -> None:
        """Send one frame; waits while the peer's window is full. ConnectionClosedError once closed."""
        if self._closed:
            raise self._send_closed_error()
        self._check(frame)
        if not isinstance(frame, bytes):
            frame = bytes(frame)  # zero-copy sends keep a reference: it must be immutable
        async with self._send_lock:
            await self._wait_for_room(len(frame))
            await self._put([wire.encode_data(self._sent), frame], 1, len(frame))

    async def send_many(self, frames: Sequence[bytes]) -> None:
        """Send frames in as few DATA messages as the window allows; a bad batch sends nothing."""
        if self._closed:
            raise self._send_closed_error()
        for f in frames:
            self._check(f)
        batch = [f if isinstance(f, bytes) else bytes(f) for f in frames]
        async with self._send_lock:
            i = 0
            while i < len(batch):
                await self._wait_for_room(len(batch[i]))
                # Take as many following frames as the window has room for.
                room_frames = self._peer_window_frames - (self._sent - self._credit)
                room_bytes = self._peer_window_bytes - (self._sent_bytes - self._credit_bytes)
                j, nbytes = i, 0
                while j < len(batch) and j - i < min(room_frames, _BATCH_FRAMES):
                    size = len(batch[j])
                    if j > i and nbytes >= room_bytes:
                        break
                    nbytes += size
                    j += 1
                await self._put([wire.encode_data(self._sent), *batch[i:j]], j - i, nbytes)
                i = j

    async def recv(self) -> bytes:
        """The next frame; after the link ended, ConnectionClosedError (or why it failed)."""
        while not self._inbox:
            if self._end is not None:
                raise type(self._end)(str(self._end))  # fresh: re-raising one object chains tracebacks
            waiter = self._loop.create_future()
            self._recv_waiter = waiter
            try:
                await waiter
            finally:
                self._recv_waiter = None
        frame = self._inbox.popleft()
        n = len(frame)
        self._inbox_bytes -= n
        self._consumed += 1
        self._consumed_bytes += n
        if (self._peer_starved or self._consumed - self._acked >= self._opts.window_frames // 4 + 1
                or self._consumed_bytes - self._acked_bytes >= self._opts.window_bytes // 4 + 1):
            self._send_ack()
        return frame

    async def close(self) -> None:
        """Close; frames already sent reach the peer before its ConnectionClosedError. Idempotent.

        Sends CLOSE and waits (at most ``close_timeout``) for the peer's CLOSE_ACK, which the peer
        sends after it received everything before the CLOSE; then releases the socket (LINGER 0).
        """
        if self._close_started:
            await self._close_finished.wait()  # a second caller waits for the first close
            return
        self._close_started = True
        try:
            await self._close_handshake()
        finally:
            self._teardown()
            self._close_finished.set()

    async def _close_handshake(self) -> None:
        if self._end is None:
            self._closed = True
            self._end = ConnectionClosedError(f"connection to {self._peer} was closed locally")
            self._discard_inbox()
            self._wake_all()
            try:
                async with asyncio.timeout(self._opts.close_timeout):
                    async with self._send_lock:
                        await self._sender.send([wire.encode_close(wire.CloseReason.NORMAL)])
                    await self._close_acked.wait()
            except TimeoutError:
                log.debug("peer %s did not confirm the close within %.1fs", self._peer, self._opts.close_timeout)
            except PeerGoneError:
                pass

    # ------------------------------------------------------------------------------ sending
    def _send_closed_error(self) -> ConnectionClosedError:
        return ConnectionClosedError(f"connection to {self._peer} is closed")

    def _fits(self, size: int) -> bool:
        in_flight = self._sent - self._credit
        if in_flight >= self._peer_window_frames:
            return False
        # A frame may start while the window is not yet full (so frames larger than the window
        # can be sent): in flight stays below window_bytes + max_frame_size.
        return self._sent_bytes - self._credit_bytes < self._peer_window_bytes

    async def _wait_for_room(self, size: int) -> None:
        while not self._fits(size):
            if self._closed:
                raise self._send_closed_error()
            self.stats.credit_waits += 1
            if not self._probe_outstanding:
                self._probe_outstanding = True
                self._send_control(wire.PROBE_MSG)
            waiter = self._loop.create_future()
            self._room_waiter = waiter
            try:
                await waiter
            finally:
                self._room_waiter = None
        if self._closed:
            raise self._send_closed_error()

    async def _put(self, parts: list[Any], frames: int, nbytes: int) -> None:
        try:
            await self._sender.send(parts)
        except PeerGoneError as exc:
            self._fail(ConnectionClosedError(f"connection to {self._peer} was lost: {exc}"), notify=False)
            raise self._send_closed_error() from exc
        self._sent += frames
        self._sent_bytes += nbytes
        self.stats.frames_sent += frames
        self._last_send = self._loop.time()

    def _send_control(self, header: bytes) -> None:
        """Send a control message without waiting; at the high-water mark, in a task."""
        try:
            if self._sender.try_send([header]):
                self._last_send = self._loop.time()
                return
        except PeerGoneError:
            return
        task = self._loop.create_task(self._send_control_later(header))
        task.add_done_callback(_consume_result)

    async def _send_control_later(self, header: bytes) -> None:
        try:
            await self._sender.send([header])
            self._last_send = self._loop.time()
        except PeerGoneError:
            pass

    def _send_ack(self) -> None:
        if self._closed:
            return
        self._peer_starved = False
        self._acked, self._acked_bytes = self._consumed, self._consumed_bytes
        self._send_control(wire.encode_ack(self._consumed, self._consumed_bytes))

    # ------------------------------------------------------------------------------ receiving
    def on_message(self, parts: list[bytes]) -> None:
        """Handle one message from the peer (called by the reader/dispatcher; never raises)."""
        self._last_recv = self._loop.time()
        if self._torn_down:
            return
        header = parts[0]
        kind = header[0] if header else -1
        try:
            if kind == wire.DATA:
                self._on_data(header, parts)
            elif kind == wire.ACK:
                frames, nbytes = wire.decode_ack(header)
                if frames > self._sent or nbytes > self._sent_bytes:
                    raise ProtocolError("peer acknowledged frames that were never sent")
                self._credit = max(self._credit, frames)
                self._credit_bytes = max(self._credit_bytes, nbytes)
                self._probe_outstanding = False
                _wake(self._room_waiter)
            elif kind == wire.PROBE:
                if self._consumed > self._acked:
                    self._send_ack()
                else:
                    self._peer_starved = True
            elif kind == wire.PING:
                pass
            elif kind == wire.CLOSE:
                reason = wire.decode_close(header)
                self._send_control(wire.CLOSE_ACK_MSG)
                self._close_acked.set()  # nothing more will come; no need to wait for an ack
                self._end_by_peer(reason)
            elif kind == wire.CLOSE_ACK:
                self._close_acked.set()
            else:
                raise ProtocolError(f"unexpected message kind {kind} from {self._peer}")
        except ProtocolError as exc:
            log.warning("closing connection to %s: %s", self._peer, exc)
            reason = (wire.CloseReason.FRAME_TOO_LARGE if isinstance(exc, FrameTooLargeError)
                      else wire.CloseReason.PROTOCOL_ERROR)
            self._fail(exc, reason=reason)

    def _on_data(self, header: bytes, parts: list[bytes]) -> None:
        seq = wire.decode_data(header)
        if seq != self._received:
            raise ProtocolError(f"expected frame {self._received} but got {seq}: frames were lost")
        frames = parts[1:]
        if not frames:
            raise ProtocolError("DATA message without frames")
        if self._closed:
            self._received += len(frames)  # we are closing: the application will not read them
            return
        for frame in frames:
            n = len(frame)
            if n == 0:
                raise ProtocolError("peer sent an empty frame")
            if n > self._max:
                raise FrameTooLargeError(f"peer {self._peer} sent a frame of {n} bytes; the maximum is {self._max}")
            self._inbox.append(frame)
            self._inbox_bytes += n
            self._received += 1
        self.stats.frames_received += len(frames)
        if (len(self._inbox) > self._opts.window_frames
                or self._inbox_bytes > self._opts.window_bytes + self._max):
            raise ProtocolError(f"peer {self._peer} overran its window")
        _wake(self._recv_waiter)

    def on_lost(self, why: str) -> None:
        """The socket lost the peer (client: DEALER disconnected). Frames read so far stay readable."""
        if self._end is None:
            self._fail(ConnectionClosedError(f"connection to {self._peer} was lost: {why}"), notify=False)

    # ------------------------------------------------------------------------------ ending
    def _end_by_peer(self, reason: wire.CloseReason) -> None:
        if self._end is None:
            if reason is wire.CloseReason.NORMAL:
                text = f"connection closed by {self._peer}"
            else:
                text = f"connection closed by {self._peer}: {reason.describe()}"
            self._end = ConnectionClosedError(text)
        self._closed = True
        self._wake_all()

    def _fail(self, error: EndError, *, notify: bool = True,
              reason: wire.CloseReason = wire.CloseReason.PROTOCOL_ERROR) -> None:
        """End the link because of ``error`` (recv raises it after the frames read so far)."""
        if self._end is not None and self._closed:
            return
        self._end = error
        self._closed = True
        self._close_acked.set()
        if notify:
            self._send_control(wire.encode_close(reason))
        self._wake_all()

    def _discard_inbox(self) -> None:
        self._inbox.clear()
        self._inbox_bytes = 0

    def _wake_all(self) -> None:
        _wake(self._recv_waiter)
        _wake(self._room_waiter)

    def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        self._closed = True
        if self._end is None:
            self._end = ConnectionClosedError(f"connection to {self._peer} was closed")
        self._wake_all()
        if self._heartbeat is not None and self._heartbeat is not asyncio.current_task():
            self._heartbeat.cancel()
        self._on_teardown(self)

    # ------------------------------------------------------------------------------ heartbeats
    async def _heartbeat_loop(self) -> None:
        interval, timeout = self._opts.heartbeat_interval, self._opts.heartbeat_timeout
        tick = min(t for t in (interval, timeout / 4) if t > 0)
        while not self._closed:
            due = self._loop.time() + tick
            await asyncio.sleep(tick)
            now = self._loop.time()
            lateness = now - due
            if lateness > tick:
                # Our own event loop was stalled (GC pause, slow callback): silence we could not
                # observe is no evidence against the peer.
                self._last_recv += lateness
            if timeout and now - self._last_recv > timeout:
                error = PeerTimeoutError(f"no message from {self._peer} for {now - self._last_recv:.1f}s")
                log.warning("closing connection to %s: %s", self._peer, error)
                self._fail(error, reason=wire.CloseReason.TIMEOUT)
                return
            if interval and now - self._last_send >= interval:
                self._send_control(wire.PING_MSG)


def _wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _consume_result(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("control message not sent: %r", task.exception())
