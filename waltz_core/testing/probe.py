"""A minimal protocol-level writer/reader of one partition, for cluster tests and diagnostics.

It speaks the client protocol directly (no client library): finds the partition's server in the
coordination assignment, mounts from what it has read, appends, and decides the fate of its
appends the way the Waltz design says (a flush answered and the feed read up to its high-water mark:
whatever was sent before the flush and did not show up in the feed failed). It reconnects and
remounts across server and storage failures. The feed it reads is kept whole, so tests can check
gap-free ids and exactly-once commits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Self

from ..config import CoordinationConfig, TransportConfig
from ..coordination import open_coordination
from ..coordination.recipes import read_assignment
from ..errors import WaltzError
from ..protocol import CLIENT
from ..protocol import client as m
from ..protocol.wire import ReqId, crc32
from ..transport import MessageChannel, open_transport

log = logging.getLogger("waltz.testing.probe")


class PartitionProbe:
    def __init__(self, transport: TransportConfig, coordination: CoordinationConfig, partition_id: int,
                 client_id: int = 9_000) -> None:
        self.transport_config = transport
        self.coordination_config = coordination
        self.partition_id = partition_id
        self.client_id = client_id
        self.feed: list[tuple[int, ReqId, int]] = []  #: (transaction id, req id, header), gap-free from 0
        self._seq = itertools.count(1)
        self._connections = itertools.count(1)
        self._channel: MessageChannel | None = None
        self._generation = -1
        self._events: asyncio.Queue[Any] = asyncio.Queue()

    @property
    def high_water_mark(self) -> int:
        return len(self.feed) - 1

    async def __aenter__(self) -> Self:
        self.transport = open_transport(self.transport_config)
        self.coordination = open_coordination(self.coordination_config)
        await self.coordination.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()
        await self.coordination.close()
        await self.transport.aclose()

    async def _owner(self) -> tuple[str, int] | None:
        assignment, _ = await read_assignment(self.coordination, self.coordination_config.root)
        for p in assignment.partitions:
            if p.partition_id == self.partition_id and p.endpoint:
                return p.endpoint, p.generation
        return None

    async def connect(self, timeout: float = 60.0) -> None:
        """(Re)connect to the partition's owner and mount from our high-water mark."""
        deadline = time.monotonic() + timeout
        while True:
            if self._channel is not None:
                await self._channel.close()
                self._channel = None
            try:
                owner = await self._owner()
                if owner is not None:
                    endpoint, self._generation = owner
                    conn = await self.transport.connect(endpoint)
                    self._channel = await MessageChannel.open(conn, CLIENT, "waltz-probe")
                    q = self._req_id()
                    await self._channel.send(m.MountRequest(q, self.high_water_mark, next(self._connections)))
                    while True:
                        msg = await asyncio.wait_for(self._channel.recv(), 30)
                        if type(msg) is m.FeedData:
                            self._take(msg)
                        elif type(msg) is m.MountResponse and msg.req_id == q:
                            if msg.state is m.PartitionState.READY:
                                return
                            break
            except (WaltzError, TimeoutError, OSError) as exc:
                log.debug("probe connect: %s", exc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"partition {self.partition_id} did not mount within {timeout}s")
            await asyncio.sleep(0.1)

    def _req_id(self) -> ReqId:
        return ReqId(self.client_id, self._generation, self.partition_id, next(self._seq))

    def _take(self, msg: m.FeedData) -> None:
        if msg.transaction_id == len(self.feed):
            self.feed.append((msg.transaction_id, msg.req_id, msg.header))
        elif msg.transaction_id > len(self.feed):
            raise AssertionError(f"gap in the feed: got {msg.transaction_id}, expected {len(self.feed)}")

    async def write(self, payloads: list[bytes], timeout: float = 120.0, batch: int = 50) -> dict[bytes, int]:
        """Append every payload exactly once, retrying failed appends. Returns payload -> transaction id."""
        todo = list(payloads)
        committed: dict[bytes, int] = {}
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(todo)} payloads not committed within {timeout}s")
            if self._channel is None or self._channel.closed:
                await self.connect(max(1.0, deadline - time.monotonic()))
            sent: dict[ReqId, bytes] = {}
            try:
                assert self._channel is not None
                for data in todo[:batch]:
                    q = self._req_id()
                    sent[q] = data
                    await self._channel.send(m.AppendRequest(q, -1, (), (), (), 7, data, crc32(data)))
                fq = self._req_id()
                await self._channel.send(m.FlushRequest(fq))
                flushed_to: int | None = None
                while flushed_to is None or self.high_water_mark < flushed_to:
                    msg = await asyncio.wait_for(self._channel.recv(), 10)
                    if type(msg) is m.FeedData:
                        self._take(msg)
                        ours = sent.pop(msg.req_id, None)
                        if ours is not None:
                            committed[ours] = msg.transaction_id
                    elif type(msg) is m.FlushResponse and msg.req_id == fq:
                        flushed_to = msg.transaction_id
            except (WaltzError, TimeoutError, OSError) as exc:
                log.info("probe write interrupted (%s); reconnecting", exc)
                if self._channel is not None:
                    await self._channel.close()
                self._channel = None
                # Fates of `sent` are decided by the remount's feed: anything of ours in it committed.
                await self.connect(max(1.0, deadline - time.monotonic()))
                mine = {q: d for q, d in sent.items()}
                for txn, q, _ in self.feed:
                    ours = mine.pop(q, None)
                    if ours is not None:
                        committed[ours] = txn
            todo = [d for d in todo if d not in committed]
        return committed

    async def read_to(self, high_water_mark: int, timeout: float = 30.0) -> None:
        """Read the feed until it reaches ``high_water_mark``."""
        deadline = time.monotonic() + timeout
        while self.high_water_mark < high_water_mark:
            if self._channel is None or self._channel.closed:
                await self.connect(max(1.0, deadline - time.monotonic()))
            assert self._channel is not None
            msg = await asyncio.wait_for(self._channel.recv(), max(0.1, deadline - time.monotonic()))
            if type(msg) is m.FeedData:
                self._take(msg)
