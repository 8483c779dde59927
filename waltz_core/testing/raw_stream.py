"""A raw client-protocol stream connection, for tests of a server or of the mock cluster.

It sends exactly the messages a test writes (no client library, no retries), numbers their
request ids, and keeps what came back: every feed record (a protocol-3 ``FeedDataBatch`` record
by record) and the classes of the messages received, so a test can check which form the server
chose. The rules of a session (remounts, failover) are :class:`~.probe.PartitionProbe`'s.
"""

from __future__ import annotations

from typing import Any

from ..protocol import client as m
from ..protocol.wire import ReqId, crc32
from ..timeouts import wait_for
from ..transport import MessageChannel


class RawStream:
    """One raw stream connection of client ``client_id`` to the server of ``partition``."""

    def __init__(self, channel: MessageChannel, client_id: int, generation: int, partition: int = 0) -> None:
        self.ch = channel
        self.client_id = client_id
        self.generation = generation
        self.partition = partition
        self.seq = 0
        self.feed: list[m.FeedData] = []  #: every feed record read, in order
        self.seen: set[type] = set()  #: the message classes received

    def q(self, generation: int | None = None) -> ReqId:
        """The next request id (of ``generation``, default the partition's)."""
        self.seq += 1
        return ReqId(self.client_id, self.generation if generation is None else generation, self.partition, self.seq)

    async def until(self, kind: type, req_id: ReqId | None = None, timeout: float = 10.0) -> Any:
        """Read until a message of ``kind`` (with ``req_id``, if given) arrives and return it; a
        feed batch answers ``kind=FeedData`` with its last record. ``TimeoutError`` after
        ``timeout`` seconds without a message."""
        while True:
            msg = await wait_for(self.ch.recv(), timeout)
            self.seen.add(type(msg))
            if type(msg) is m.FeedData:
                self.feed.append(msg)
            elif type(msg) is m.FeedDataBatch:  # protocol 3: the feed records of a commit in one message
                self.feed.extend(msg.records)
                if kind is m.FeedData:
                    return msg.records[-1]
            if type(msg) is kind and (req_id is None or getattr(msg, "req_id", None) == req_id):
                return msg

    async def mount(self, hwm: int = -1, seq_num: int = 1) -> m.MountResponse:
        q = self.q()
        await self.ch.send(m.MountRequest(q, hwm, seq_num))
        return await self.until(m.MountResponse, q)  # type: ignore[no-any-return]

    async def append(self, data: bytes, hwm: int = -1, write: tuple[int, ...] = (), read: tuple[int, ...] = (),
                     append: tuple[int, ...] = (), generation: int | None = None) -> ReqId:
        """Send an append (not awaiting its commit); its request id."""
        q = self.q(generation)
        await self.ch.send(m.AppendRequest(q, hwm, write, read, append, 0, data, crc32(data)))
        return q

    async def flush(self) -> int:
        """Flush, then read the feed up to the flushed high-water mark, which it returns (the
        response may overtake feed records, so a client completes a flush only once its feed got
        there, as the Waltz design says)."""
        q = self.q()
        await self.ch.send(m.FlushRequest(q))
        hwm: int = (await self.until(m.FlushResponse, q)).transaction_id
        while self.feed_hwm < hwm:
            await self.until(m.FeedData)
        return hwm

    @property
    def feed_hwm(self) -> int:
        """The last transaction id read from the feed (-1: none)."""
        return self.feed[-1].transaction_id if self.feed else -1
