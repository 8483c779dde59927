"""A client connection as the server sees it: batched, non-blocking posting of messages.

Partitions never await a client's socket on their own paths: they *post* messages, and one
writer task per connection sends everything posted since its last write in a single
``send_many`` (one syscall for many feed records, across partitions). Feed tasks await
:meth:`ClientLink.wait_writable` so a slow client slows only its own feeds. On a link that
negotiated client protocol 3, the feed records posted between two writes, of every partition, go
in FeedDataBatch frames (each record names its partition).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable
from typing import Any

from ..errors import TransportError
from ..protocol.client import FEED_BATCH_VERSION, LIMITS_VERSION, encode_feed_batches
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE
from ..transport.channel import MessageChannel

log = logging.getLogger("waltz.server.link")
_ids = itertools.count(1)


class ClientLink:
    __slots__ = ("channel", "id", "_encode", "_buffer", "_queued", "_feed_batches", "_wakeup", "_writable", "_high",
                 "_low", "_writer", "_closed", "_inbound", "_inbound_high", "_inbound_low", "_readable", "readable", "_feed",
                 "refusals", "limits")

    def __init__(self, channel: MessageChannel, high_water: int = 4096, low_water: int = 1024,
                 inbound_high_water: int = 600, inbound_low_water: int = 300,
                 limits: tuple[int, int] = (DEFAULT_MAX_FRAME_SIZE, 4096)) -> None:
        self.channel = channel
        #: (max frame size, max locks per transaction) of the server: the answer to ServerLimitsRequest
        self.limits = limits
        self.id = next(_ids)
        self._encode = channel.family.encode
        self._buffer: list[bytes] = []
        #: FeedData payloads posted since the last write, of any partitions: one FeedDataBatch run at the write
        self._feed: list[bytes] = []
        #: messages in _buffer, each feed record of a batch counted (the high-water mark counts messages)
        self._queued = 0
        #: the client reads FeedDataBatch: feed records posted together go in one frame
        self._feed_batches = getattr(channel, "version", 0) >= FEED_BATCH_VERSION
        #: the client reads AppendRefused: an append the server will not take is answered, not dropped
        self.refusals = getattr(channel, "version", 0) >= LIMITS_VERSION
        self._wakeup = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._high = high_water
        self._low = low_water
        self._closed = False
        self._inbound = 0
        self._inbound_high = inbound_high_water
        self._inbound_low = inbound_low_water
        self._readable = asyncio.Event()
        self._readable.set()
        #: False while too many messages of this connection are queued in partitions (mirrors
        #: ``_readable``: a plain attribute, read once per message)
        self.readable = True
        self._writer = asyncio.get_running_loop().create_task(self._write_loop(), name=f"client-link-{self.id}-writer")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peer(self) -> str:
        return self.channel.conn.peer

    def post(self, msg: Any) -> None:
        """Queue one message for sending (never blocks)."""
        if self._closed:
            return
        if self._feed:
            self._flush_feed()
        self._buffer.append(self._encode(msg))
        self._queued += 1
        self._after_post()

    def post_many(self, msgs: Iterable[Any]) -> None:
        if self._closed:
            return
        if self._feed:
            self._flush_feed()
        enc = self._encode
        buffer = self._buffer
        before = len(buffer)
        buffer.extend(enc(m) for m in msgs)
        self._queued += len(buffer) - before
        self._after_post()

    def post_frames(self, frames: list[bytes]) -> None:
        """Queue FeedData payloads (feeds share one encoding of each commit across clients). To a
        client that reads FeedDataBatch they go at the next write, joined with the records of
        every other partition posted meanwhile: a commit of one transaction in each of 64
        partitions is 2 frames, not 64."""
        if self._closed or not frames:
            return
        if self._feed_batches:
            self._feed += frames
        else:
            self._buffer.extend(frames)
        self._queued += len(frames)
        self._after_post()

    def _flush_feed(self) -> None:
        """The feed records posted since the last write or message, as FeedDataBatch frames:
        before any other message (which must not overtake them) and at the write."""
        feed, self._feed = self._feed, []
        self._buffer.extend(encode_feed_batches(feed))

    def _after_post(self) -> None:
        self._wakeup.set()
        if self._queued >= self._high:
            self._writable.clear()

    # Inbound back pressure (Waltz design, "Back Pressure"): messages of this connection waiting in partition
    # queues are counted; above the high-water mark the reader stops reading this connection.
    def inbound_added(self) -> None:
        self._inbound += 1
        if self._inbound >= self._inbound_high:
            self._readable.clear()
            self.readable = False

    def inbound_done(self) -> None:
        self._inbound -= 1
        if self._inbound <= self._inbound_low and not self.readable:
            self._readable.set()
            self.readable = True

    async def wait_readable(self) -> None:
        """Wait while too many messages of this connection are queued in partitions."""
        if not self.readable:
            await self._readable.wait()

    @property
    def writable(self) -> bool:
        """False while this connection has too much unsent data (what wait_writable waits for)."""
        return self._writable.is_set() and not self._closed

    async def wait_writable(self) -> None:
        """Wait while this connection has too much unsent data (back pressure for feeds)."""
        if not self._writable.is_set():
            await self._writable.wait()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._buffer or self._feed:
                    if self._feed:
                        self._flush_feed()
                    frames, self._buffer = self._buffer, []
                    self._queued = 0
                    if len(self._buffer) < self._low:
                        self._writable.set()
                    await self.channel.conn.send_many(frames)
                self._writable.set()
        except TransportError as exc:
            log.debug("client %s: write failed: %s", self.peer, exc)
        except asyncio.CancelledError:
            pass
        finally:
            self._closed = True
            self._writable.set()  # never leave a feed waiting on a dead link

    async def close(self) -> None:
        self._closed = True
        self._writer.cancel()
        await asyncio.gather(self._writer, return_exceptions=True)
        await self.channel.close()
