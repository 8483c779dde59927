"""A minimal protocol-level writer/reader of one partition, for cluster tests and diagnostics.

It speaks the client protocol directly (no client library): finds the partition's server in the
coordination assignment, mounts from what it has read, appends, and reconnects and remounts
across server and storage failures. The rules of the session - what a mount answer means, when
an append committed or failed - are the client library's own,
:class:`~waltz_core.protocol.session.Session`: an append is committed when it shows up in the
feed, failed once a flush was answered and the feed reached the answer (or a mount was answered
READY) without it. The feed it reads is kept whole, so tests can check gap-free ids and
exactly-once commits; a gap raises AssertionError.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Self

import attrs

from ..config import CoordinationConfig, TransportConfig
from ..coordination import open_coordination
from ..coordination.base import CoordinationBackend
from ..coordination.recipes import read_assignment
from ..errors import ConnectionClosedError, ProtocolError, WaltzError
from ..plugins import Registries
from ..protocol import CLIENT
from ..protocol import client as m
from ..protocol.session import RemountLater, Session, SessionState
from ..protocol.wire import ReqId, crc32
from ..retry import RetryPolicy
from ..runtime import Runtime
from ..timeouts import wait_for
from ..transport import MessageChannel, open_transport
from ..transport.base import Transport

log = logging.getLogger("waltz.testing.probe")

CONNECT_RETRY = RetryPolicy(initial=0.05, maximum=0.5)  #: between connect attempts; deadline: connect's timeout


class PartitionProbe:
    def __init__(self, transport: TransportConfig, coordination: CoordinationConfig, partition_id: int,
                 client_id: int = 9_000, registries: Registries | None = None) -> None:
        self.transport_config = transport
        self.coordination_config = coordination
        self.partition_id = partition_id
        self.client_id = client_id
        self.registries = registries  #: the process's backends (built with Runtime.load() when None)
        self.feed: list[tuple[int, ReqId, int]] = []  #: (transaction id, req id, header), gap-free from 0
        self.transport: Transport
        self.coordination: CoordinationBackend
        self._session: Session[bytes] = Session(client_id, partition_id)  # appends carry their payload
        self._committed: dict[bytes, int] = {}  # payload -> transaction id, as the feed showed them (write())
        self._connections = 0
        self._channel: MessageChannel | None = None

    @property
    def high_water_mark(self) -> int:
        return len(self.feed) - 1

    async def __aenter__(self) -> Self:
        registries = self.registries or Runtime.load().registries
        self.transport = open_transport(self.transport_config, registries)
        self.coordination = open_coordination(self.coordination_config, registries)
        await self.coordination.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()
        await self.coordination.close()
        await self.transport.aclose()

    async def _owner(self) -> tuple[str, int] | None:
        assignment, _ = await read_assignment(self.coordination, self.coordination_config.root)
        for p in assignment.partitions:
            if p.partition_id == self.partition_id and p.endpoint:
                return p.endpoint, p.generation
        return None

    async def _close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def connect(self, timeout: float = 60.0) -> None:
        """(Re)connect to the partition's owner and mount from our high-water mark. The mount
        decides every append still pending: committed if its feed shows it, failed otherwise."""
        for delay in attrs.evolve(CONNECT_RETRY, deadline=timeout).delays():
            await self._close()
            try:
                if await self._mount():
                    return
            except (WaltzError, TimeoutError, OSError) as exc:
                log.debug("probe connect: %s", exc)
            await asyncio.sleep(delay)
        raise TimeoutError(f"partition {self.partition_id} did not mount within {timeout}s")

    async def _mount(self) -> bool:
        owner = await self._owner()
        if owner is None:
            return False
        endpoint, generation = owner
        session = self._session
        session.bind(generation)
        conn = await self.transport.connect(endpoint)
        self._channel = channel = await MessageChannel.open(conn, CLIENT, "waltz-probe")
        self._connections += 1
        await channel.send(session.mount(self._connections))
        while session.state is SessionState.MOUNTING:
            await self._receive(await wait_for(channel.recv(), 30))
        return session.state is SessionState.READY  # NOT_READY, CLIENT_AHEAD: try again

    async def _receive(self, msg: object) -> None:
        """One message from the server, through the session."""
        if isinstance(msg, m.FeedData):
            self._take(msg)
            return
        if isinstance(msg, m.FeedDataBatch):  # client protocol 3: a commit's feed records in one message
            for record in msg.records:
                self._take(record)
            return
        if isinstance(self._session.receive(msg), RemountLater) and self._session.state is not SessionState.MOUNTING:
            await self._close()  # the feed was suspended: mount again
            raise ConnectionClosedError(f"partition {self.partition_id}: the server suspended the feed")

    def _take(self, msg: m.FeedData) -> None:
        q, tid = msg.req_id, msg.transaction_id
        try:
            entry = self._session.on_feed(q.client_id, q.seq_num, tid)
        except ProtocolError as exc:
            raise AssertionError(f"gap in the feed: {exc}") from None
        if tid == len(self.feed):
            self.feed.append((tid, q, msg.header))
            self._session.hwm = tid
        if entry is not None:
            self._committed[entry.item] = tid

    async def write(self, payloads: list[bytes], timeout: float = 120.0, batch: int = 50) -> dict[bytes, int]:
        """Append every payload exactly once, retrying failed appends. Returns payload -> transaction id."""
        todo = list(payloads)
        committed: dict[bytes, int] = {}
        self._committed = committed  # what the feed shows of this call's appends
        deadline = time.monotonic() + timeout
        session = self._session
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(todo)} payloads not committed within {timeout}s")
            if self._channel is None or self._channel.closed:
                await self.connect(max(1.0, deadline - time.monotonic()))
            try:
                channel = self._channel
                assert channel is not None
                for data in todo[:batch]:
                    q = session.req_id(session.append(data, 1, time.monotonic()))
                    await channel.send(m.AppendRequest(q, -1, (), (), (), 7, data, crc32(data)))
                flush = session.flush()
                await channel.send(flush)
                while not session.flush_done(flush.req_id.seq_num):  # answered, and the feed reached it
                    await self._receive(await wait_for(channel.recv(), 10))
            except (WaltzError, TimeoutError, OSError) as exc:
                log.info("probe write interrupted (%s); reconnecting", exc)
                await self._close()
                await self.connect(max(1.0, deadline - time.monotonic()))  # its READY decides what was sent
            session.take_failed()  # failed appends are simply sent again
            todo = [d for d in todo if d not in committed]
        return {d: committed[d] for d in payloads}

    async def read_to(self, high_water_mark: int, timeout: float = 30.0) -> None:
        """Read the feed until it reaches ``high_water_mark``."""
        deadline = time.monotonic() + timeout
        while self.high_water_mark < high_water_mark:
            if self._channel is None or self._channel.closed:
                await self.connect(max(1.0, deadline - time.monotonic()))
            assert self._channel is not None
            try:
                await self._receive(await wait_for(self._channel.recv(), max(0.1, deadline - time.monotonic())))
            except ConnectionClosedError:
                if time.monotonic() > deadline:
                    raise
