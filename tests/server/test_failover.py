"""Fail-over when a storage host vanishes (packets dropped, no reset), without network namespaces.

A :class:`VanishingTransport` wraps the memory transport: once an address vanished, connects to
it never complete and open connections to it go silent in both directions - what a pulled cable
looks like. Checked: requests have a deadline; the server's one view of a storage node remembers
the failure, so callers neither wait nor open connections of their own; one connect attempt is
shared by every caller; recovery goes on with the replicas that answer. The end-to-end version
with real hosts is tests/reliability/test_multihost.py.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

from waltz_core.coordination.metadata import UNRESOLVED, ReplicaState
from waltz_core.errors import RequestTimeoutError
from waltz_core.server.glue import StorageConnector
from waltz_core.server.recovery import Recovery
from waltz_core.storage.client import StorageAdminClient
from waltz_core.storage.node import StorageNode
from waltz_core.storage.segmented import SegmentedLayout
from waltz_core.testing.fake_storage import FakeReplica, connector
from waltz_core.transport.memory import MemoryTransport

pytestmark = pytest.mark.timeout(60)

KEY = uuid.UUID(int=42)


class _SilentConnection:
    """A connection that goes silent (both ways) once its address vanished."""

    def __init__(self, conn: Any, address: str, transport: VanishingTransport) -> None:
        self._conn, self._address, self._transport = conn, address, transport

    @property
    def peer(self) -> str:
        return self._conn.peer

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def _gone(self) -> bool:
        return self._address in self._transport.vanished

    async def send(self, frame: bytes) -> None:
        if not self._gone():
            await self._conn.send(frame)

    async def send_many(self, frames: Sequence[bytes]) -> None:
        if not self._gone():
            await self._conn.send_many(frames)

    async def recv(self) -> bytes:
        frame = await self._conn.recv()
        while self._gone():
            await asyncio.sleep(3600)  # the answer is lost on the way
        return frame

    async def close(self) -> None:
        await self._conn.close()


class VanishingTransport:
    name = "vanishing"

    def __init__(self) -> None:
        self.inner = MemoryTransport(max_frame_size=1024 * 1024)
        self.vanished: set[str] = set()
        self.connects: Counter[str] = Counter()

    async def connect(self, address: str) -> _SilentConnection:
        self.connects[address] += 1
        if address in self.vanished:
            await asyncio.sleep(3600)  # SYNs dropped: only the caller's timeout ends this
        return _SilentConnection(await self.inner.connect(address), address, self)

    async def listen(self, host: str, port: int, handler: Any) -> Any:
        return await self.inner.listen(host, port, handler)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
async def storage(tmp_path: Path) -> AsyncIterator[tuple[VanishingTransport, str]]:
    transport = VanishingTransport()
    node = StorageNode(SegmentedLayout(tmp_path), KEY, 4, max_frame_size=transport.inner.max_frame_size)
    await node.start()
    listener = await transport.listen("storage", 0, node.serve_data)
    admin_listener = await transport.listen("storage-admin", 0, node.serve_admin)
    admin = await StorageAdminClient.connect(transport.inner, admin_listener.address, KEY, 4)
    await admin.set_assignment([0], True)
    await admin.close()
    try:
        yield transport, listener.address
    finally:
        await listener.close()
        await admin_listener.close()
        await node.close()


def returns_without_waiting(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` one step: it must finish without suspending (no I/O, no wait); its result."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the call suspended: it waited for something")


async def eventually(check: Any, timeout: float = 20.0) -> None:
    """Poll ``check()`` (a bool, or an awaitable of one) until it is true."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_a_request_past_its_deadline_fails_the_connection_and_marks_the_node_down(storage) -> None:  # type: ignore[no-untyped-def]
    transport, address = storage
    conn = StorageConnector(transport, KEY, 4, "test", connect_timeout=0.3, request_timeout=0.3, retry_interval=0.1)
    try:
        client = await conn(address)
        assert client is not None
        assert await client.max_transaction_id(0, 0) == -1
        transport.vanished.add(address)
        with pytest.raises(RequestTimeoutError, match=r"no answer to a request within 0\.3s"):
            await client.max_transaction_id(0, 0)
        reachable, down_for, error = conn.health()[address]
        assert not reachable and down_for is not None and "no answer" in error
        # Every partition now learns it from the view, at once: no connect, no wait.
        assert returns_without_waiting(conn(address)) is None
        # The background loop keeps trying; the node answers again once it is back.
        await eventually(lambda: transport.connects[address] >= 3)
        transport.vanished.discard(address)
        await eventually(lambda: _reachable(conn, address))
        assert conn.health()[address][0]
    finally:
        await conn.close()


async def _reachable(conn: StorageConnector, address: str) -> bool:
    return await conn(address) is not None


async def test_callers_share_one_connect_attempt_and_the_failure_is_remembered(storage) -> None:  # type: ignore[no-untyped-def]
    transport, address = storage
    transport.vanished.add(address)
    conn = StorageConnector(transport, KEY, 4, "test", connect_timeout=0.3, request_timeout=0.3, retry_interval=60.0)
    try:
        results = await asyncio.gather(*(conn(address) for _ in range(64)))
        assert results == [None] * 64
        assert transport.connects[address] == 1, "64 partitions asking made more than one connect attempt"
        assert returns_without_waiting(conn(address)) is None
        assert not conn.health()[address][0]
    finally:
        await conn.close()


async def test_a_node_out_of_the_replica_assignment_is_not_tried_again_once_down(storage) -> None:  # type: ignore[no-untyped-def]
    """A decommissioned storage node (its partitions moved, the node stopped): the connector
    stops its reconnect loop and forgets it, instead of trying it (and showing it unreachable)
    for as long as the server runs. A node still in the assignment is tried as before."""
    transport, address = storage
    conn = StorageConnector(transport, KEY, 4, "test", connect_timeout=0.3, request_timeout=0.3, retry_interval=0.05)
    try:
        client = await conn(address)
        assert client is not None
        conn.keep_only(["other:1"])  # the partitions moved off it: its live connection stays
        assert conn.health()[address][0] and not client.closed
        transport.vanished.add(address)  # then the node is shut down
        with pytest.raises(RequestTimeoutError):
            await client.max_transaction_id(0, 0)
        await eventually(lambda: address not in conn.health(), timeout=5)
        tries = transport.connects[address]
        await asyncio.sleep(0.5)  # 10 reconnect intervals
        assert transport.connects[address] == tries, "a node out of the assignment was tried again"
        # A node that is down and in the assignment keeps being tried; taken out, it stops.
        conn.keep_only([address])
        assert await conn(address) is None
        await eventually(lambda: transport.connects[address] >= tries + 3, timeout=5)
        conn.keep_only([])
        await eventually(lambda: address not in conn.health(), timeout=5)  # once an attempt under way ends
        tries = transport.connects[address]
        await asyncio.sleep(0.5)
        assert transport.connects[address] == tries
    finally:
        await conn.close()


async def test_a_cancelled_caller_does_not_cancel_the_shared_attempt(storage) -> None:  # type: ignore[no-untyped-def]
    transport, address = storage
    conn = StorageConnector(transport, KEY, 4, "test", connect_timeout=5.0)
    try:
        first = asyncio.ensure_future(conn(address))
        second = asyncio.ensure_future(conn(address))
        await asyncio.sleep(0)
        first.cancel()
        assert await second is not None
        assert transport.connects[address] == 1
    finally:
        await conn.close()


async def test_recovery_goes_on_with_a_quorum_while_a_replica_hangs() -> None:
    eps = ["s1:1", "s2:1", "s3:1"]
    replicas = {ep: FakeReplica(ep) for ep in eps}
    replicas["s3:1"].delay = 3600.0  # its host vanished: every request hangs
    states = {ep: ReplicaState(-1, UNRESOLVED) for ep in eps}
    result = await asyncio.wait_for(Recovery(0, 0, eps, states, connector(replicas)).run(), 30)
    assert result.clean == {"s1:1", "s2:1"}
    assert "s3:1" not in result.lagging
    assert result.replica_states["s1:1"] == ReplicaState(0, UNRESOLVED)


async def test_recovery_goes_on_with_a_quorum_while_a_connect_hangs() -> None:
    eps = ["s1:1", "s2:1", "s3:1"]
    replicas = {ep: FakeReplica(ep) for ep in eps}
    base = connector(replicas)

    async def connect(endpoint: str) -> FakeReplica | None:
        if endpoint == "s2:1":
            await asyncio.sleep(3600)  # first contact with a vanished host
        return await base(endpoint)

    result = await asyncio.wait_for(Recovery(0, 0, eps, {}, connect).run(), 30)
    assert result.clean == {"s1:1", "s3:1"}


async def test_recovery_waits_for_the_third_replica_when_two_cannot_decide() -> None:
    # s1 holds 0..4, s2 holds 0..2, s3 hangs: candidate 4 has one vote and the hanging replica
    # could be its second, so the vote is undecidable until s2 caught up from s1 (recovery copies
    # it); only then is it decided at 4 without s3.
    from waltz_core.protocol.wire import Record, ReqId, crc32

    eps = ["s1:1", "s2:1", "s3:1"]
    replicas = {ep: FakeReplica(ep) for ep in eps}
    recs = [Record(t, ReqId(1, 0, 0, t), 0, b"x", crc32(b"x")) for t in range(5)]
    for r in replicas.values():
        await r.set_low_water_mark(0, 0, -1)  # all three were engaged in session 0
    await replicas["s1:1"].append(0, 0, recs)
    await replicas["s2:1"].append(0, 0, recs[:3])
    replicas["s3:1"].delay = 3600.0
    states = {ep: ReplicaState(0, UNRESOLVED) for ep in eps}
    result = await asyncio.wait_for(Recovery(0, 1, eps, states, connector(replicas)).run(), 30)
    assert result.high_water_mark == 4
    assert [r.transaction_id for r in replicas["s2:1"].log(0)] == [0, 1, 2, 3, 4]
