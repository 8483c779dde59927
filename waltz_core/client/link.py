"""The client's connections to one server (Waltz design, "Client-Server Interactions").

Two connections per server, as the Waltz design says: the *stream* connection carries mounts, appends,
flushes and the feed (ordered), the *RPC* connection carries transaction data and high-water
mark requests (answers matched by ReqId, any order), so a large data fetch never delays the feed.

The stream side is a "network client" that is replaced, never repaired: on any error it is
closed and a new one (a higher sequence number) connects and re-mounts its partitions. Messages
are *posted* (never awaited) and written by one writer task, so the order in which the event
loop posts them is the order the server reads them; posts while disconnected are dropped (the
appends among them fail at the next mount).

:class:`Links` holds one client's links, one per server endpoint, created on first use: the
stream side for the partitions bound to that server, the RPC side for anyone asking.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import ClientClosedError, ConnectionClosedError, ProtocolError, TransportError, WaltzError
from ..protocol import CLIENT
from ..protocol.client import (
    LIMITS_VERSION,
    TRANSACTION_FRAME_HEADROOM,
    ServerLimitsRequest,
    ServerLimitsResponse,
    unpack_feed_batch,
    unpack_feed_data,
    unpack_lock_failure,
)
from ..protocol.wire import ReqId
from ..timeouts import wait_for
from ..transport import MessageChannel
from ..transport.base import Transport

log = logging.getLogger("waltz.client.link")

#: ``on_feed(link, (client id, generation, partition id, seq num, transaction id, header))``: one
#: feed record; returns an awaitable when the reader must wait (the partition's feed queue is full)
FeedHandler = Callable[["ServerLink", tuple[int, int, int, int, int, int]], Awaitable[None] | None]
#: ``on_lock_failure(link, (client id, generation, partition id, seq num, transaction id))``: one
#: LockFailure, without a message object
LockFailureHandler = Callable[["ServerLink", tuple[int, int, int, int, int]], None]
#: ``on_message(link, message)``: any other stream message (a plain call: nothing there waits)
MessageHandler = Callable[["ServerLink", Any], None]


class ServerLink:
    """Stream + RPC connections to one server endpoint. Runs on the client's event loop."""

    def __init__(self, endpoint: str, transport: Transport, role: str, *, connect_timeout: float,
                 reconnect_delay: float, next_net_seq: Callable[[], int],
                 on_connected: Callable[[ServerLink], None],
                 on_message: MessageHandler,
                 on_feed: FeedHandler,
                 on_lock_failure: LockFailureHandler,
                 on_lost: Callable[[ServerLink], None]) -> None:
        self.endpoint = endpoint
        self.partitions: set[int] = set()
        self.net_seq = 0  #: sequence number of the current stream network client
        #: the most data + locks (4 bytes each) an append may carry to the connected server, from
        #: its ServerLimitsResponse (protocol 4); None until it answered, or for an older server
        self.max_append_body: int | None = None
        self._transport = transport
        self._role = role
        self._connect_timeout = connect_timeout
        self._reconnect_delay = reconnect_delay
        self._next_net_seq = next_net_seq
        self._on_connected = on_connected
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_feed = on_feed
        self._on_lock_failure = on_lock_failure
        self._encode = CLIENT.encode
        self._stream: MessageChannel | None = None
        self._out: list[bytes] = []
        self._wakeup = asyncio.Event()
        self._stream_task: asyncio.Task[None] | None = None
        self._rpc: MessageChannel | None = None
        self._rpc_lock = asyncio.Lock()
        self._rpc_reader: asyncio.Task[None] | None = None
        self._rpc_waiters: dict[ReqId, asyncio.Future[Any]] = {}
        self._rpc_calls = 0  #: RPCs under way (connecting included): a link is not retired under them
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._stream is not None

    @property
    def idle(self) -> bool:
        """No partition of the client is bound to this endpoint and no RPC is under way."""
        return not self.partitions and not self._rpc_calls

    # ------------------------------------------------------------------------------ stream

    def ensure_stream(self) -> None:
        """Start the stream network client (idempotent)."""
        if self._stream_task is None and not self._closed:
            self._stream_task = asyncio.get_running_loop().create_task(self._run_stream(),
                                                                       name=f"waltz-client-stream-{self.endpoint}")

    def post(self, msg: Any) -> bool:
        """Queue a stream message; False (dropped) while disconnected."""
        if self._stream is None:
            return False
        self._out.append(self._encode(msg))
        self._wakeup.set()
        return True

    def post_frame(self, payload: bytes) -> bool:
        """Queue an already-encoded stream message; False (dropped) while disconnected."""
        if self._stream is None:
            return False
        self._out.append(payload)
        self._wakeup.set()
        return True

    async def _connect(self) -> MessageChannel:
        # timeouts.wait_for: a close() that cancels as the connect completes is not lost (3.11)
        conn = await wait_for(self._transport.connect(self.endpoint), self._connect_timeout)
        return await MessageChannel.open(conn, CLIENT, self._role, timeout=self._connect_timeout)

    async def _run_stream(self) -> None:
        while not self._closed:
            try:
                channel = await self._connect()
            except (WaltzError, TimeoutError, OSError) as exc:
                log.info("stream connection to %s failed: %s; retrying in %.1fs", self.endpoint, exc, self._reconnect_delay)
                await asyncio.sleep(self._reconnect_delay)
                continue
            if self._closed:  # closed while connecting: the connection is nobody's
                await channel.close()
                return
            self.net_seq = self._next_net_seq()
            self._stream = channel
            self._out = []
            self.max_append_body = None
            if channel.version >= LIMITS_VERSION:  # first: the answer comes before any mount's
                self._out.append(self._encode(ServerLimitsRequest(ReqId(0, 0, 0, 0))))
            writer = asyncio.get_running_loop().create_task(self._write_loop(channel))
            try:
                self._on_connected(self)
                recv, decode = channel.conn.recv, channel.family.decode
                on_feed, on_message, on_lock_failure = self._on_feed, self._on_message, self._on_lock_failure
                while True:
                    frame = await recv()
                    # Feed records are most of the stream: their fields go to on_feed without
                    # message objects; it returns an awaitable only when its queue is full.
                    fields = unpack_feed_data(frame)
                    if fields is not None:
                        waiting = on_feed(self, fields)
                        if waiting is not None:
                            await waiting
                        continue
                    batch = unpack_feed_batch(frame)  # protocol 3: a commit's feed records in one frame
                    if batch is not None:
                        for fields in batch:
                            waiting = on_feed(self, fields)
                            if waiting is not None:
                                await waiting
                        continue
                    lock_failure = unpack_lock_failure(frame)  # the next most frequent: no objects either
                    if lock_failure is not None:
                        on_lock_failure(self, lock_failure)
                        continue
                    msg = decode(frame)
                    if type(msg) is ServerLimitsResponse:
                        self._learn_limits(msg)
                    else:
                        on_message(self, msg)
            except ConnectionClosedError:
                log.info("stream connection to %s closed", self.endpoint)
            except (ProtocolError, TransportError) as exc:
                log.warning("stream connection to %s failed: %s", self.endpoint, exc)
            finally:
                self._stream = None
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
                await channel.close()
                if not self._closed:
                    self._on_lost(self)

    def _learn_limits(self, msg: ServerLimitsResponse) -> None:
        self.max_append_body = max(0, msg.max_frame_size - TRANSACTION_FRAME_HEADROOM)
        log.debug("stream connection to %s: the server takes frames of %d bytes, %d locks per transaction",
                  self.endpoint, msg.max_frame_size, msg.max_locks_per_transaction)

    async def _write_loop(self, channel: MessageChannel) -> None:
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._out:
                    frames, self._out = self._out, []
                    await channel.conn.send_many(frames)
        except TransportError as exc:
            log.info("stream write to %s failed: %s", self.endpoint, exc)
            await channel.close()
        except ProtocolError as exc:  # a frame that cannot be sent: without the writer the link is mute
            log.warning("stream write to %s failed: %s; reconnecting", self.endpoint, exc)
            await channel.close()

    # --------------------------------------------------------------------------------- rpc

    async def rpc(self, msg: Any, timeout: float) -> Any:
        """Send an RPC request and wait for the response with the same ReqId.

        Raises TransportError (connection failed or lost), TimeoutError, ClientClosedError.
        """
        if self._closed:
            raise ClientClosedError("the client is closed")
        self._rpc_calls += 1
        try:
            channel = await self._rpc_channel()
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._rpc_waiters[msg.req_id] = fut
            try:
                await channel.send(msg)
                return await wait_for(fut, timeout)
            finally:
                self._rpc_waiters.pop(msg.req_id, None)
        finally:
            self._rpc_calls -= 1

    async def rpc_version(self) -> int:
        """The protocol version negotiated on the RPC connection (opened if needed): what the
        server understands. Raises like :meth:`rpc`."""
        if self._closed:
            raise ClientClosedError("the client is closed")
        self._rpc_calls += 1
        try:
            return (await self._rpc_channel()).version
        finally:
            self._rpc_calls -= 1

    async def _rpc_channel(self) -> MessageChannel:
        async with self._rpc_lock:
            if self._rpc is None or self._rpc.closed:
                try:
                    channel = await self._connect()
                except TimeoutError as exc:
                    raise ConnectionClosedError(f"RPC connection to {self.endpoint} timed out") from exc
                if self._closed:  # closed while connecting: close() did not see this channel
                    await channel.close()
                    raise ClientClosedError("the client is closed")
                self._rpc = channel
                self._rpc_reader = asyncio.get_running_loop().create_task(self._read_rpc(channel))
            return self._rpc

    async def _read_rpc(self, channel: MessageChannel) -> None:
        error: WaltzError = ConnectionClosedError(f"RPC connection to {self.endpoint} closed")
        try:
            while True:
                msg = await channel.recv()
                fut = self._rpc_waiters.get(msg.req_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except ConnectionClosedError:
            pass
        except (ProtocolError, TransportError) as exc:
            log.warning("RPC connection to %s failed: %s", self.endpoint, exc)
            error = ConnectionClosedError(f"RPC connection to {self.endpoint} failed: {exc}")
        finally:
            if self._rpc is channel:
                self._rpc = None
            await channel.close()
            for fut in list(self._rpc_waiters.values()):
                if not fut.done():
                    fut.set_exception(type(error)(str(error)))

    # ------------------------------------------------------------------------------- close

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._stream_task, self._rpc_reader) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
        if self._rpc is not None:
            await self._rpc.close()
            self._rpc = None
        for fut in self._rpc_waiters.values():
            if not fut.done():
                fut.set_exception(ClientClosedError("the client is closed"))


class Links:
    """The :class:`ServerLink` of each server endpoint of one client, created on first use.

    Every stream of every link reports to the same handlers (the client's stream side); network
    client sequence numbers come from one counter, so a newer stream always has a higher one.
    """

    def __init__(self, transport: Transport, role: str, *, connect_timeout: float, reconnect_delay: float,
                 on_connected: Callable[[ServerLink], None],
                 on_message: MessageHandler, on_feed: FeedHandler, on_lock_failure: LockFailureHandler,
                 on_lost: Callable[[ServerLink], None]) -> None:
        self._transport = transport
        self._role = role
        self._connect_timeout = connect_timeout
        self._reconnect_delay = reconnect_delay
        self._on_connected = on_connected
        self._on_message = on_message
        self._on_feed = on_feed
        self._on_lock_failure = on_lock_failure
        self._on_lost = on_lost
        self._net_seq = itertools.count(1)
        self._links: dict[str, ServerLink] = {}
        self._retiring: set[asyncio.Task[None]] = set()  #: closes of retired links under way

    def get(self, endpoint: str) -> ServerLink:
        """The link to ``endpoint`` (made, not yet connected, on first use)."""
        link = self._links.get(endpoint)
        if link is None:
            link = self._links[endpoint] = ServerLink(
                endpoint, self._transport, self._role, connect_timeout=self._connect_timeout,
                reconnect_delay=self._reconnect_delay, next_net_seq=self._next_net_seq,
                on_connected=self._on_connected, on_message=self._on_message, on_feed=self._on_feed,
                on_lock_failure=self._on_lock_failure, on_lost=self._on_lost)
        return link

    def _next_net_seq(self) -> int:
        return next(self._net_seq)

    def retire_if_idle(self, link: ServerLink) -> None:
        """Close ``link`` and forget its endpoint if it is :attr:`~ServerLink.idle` (event loop).

        Called once the client's last partition on an endpoint moved elsewhere. Kept, the link
        would hold its connections to a server that no longer serves this client, or, for an
        endpoint that is gone (a server replaced on a new address), try to connect again every
        ``reconnect_delay`` for as long as the client runs, one such link per address it ever
        used. A partition bound to the endpoint again gets a new link."""
        if not link.idle or self._links.get(link.endpoint) is not link:
            return
        del self._links[link.endpoint]
        log.info("no partition of this client is on %s any more: closing its connections", link.endpoint)
        self._retiring.add(task := asyncio.get_running_loop().create_task(link.close()))
        task.add_done_callback(self._retiring.discard)

    @property
    def endpoints(self) -> list[str]:
        """The endpoints this client keeps links to."""
        return list(self._links)

    async def close(self) -> None:
        links = list(self._links.values())
        self._links.clear()
        for link in links:
            await link.close()
        await asyncio.gather(*self._retiring, return_exceptions=True)
