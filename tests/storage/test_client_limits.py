"""The node's frame limit (storage protocol 5): a node answers the open with its
``transport.max_frame_size``, and a client whose own limit is larger sends it no append over it.
Sent, such a frame would make the node close the connection, and every partition's appends on
that connection would fail, at every retry."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from waltz_core.errors import StorageError, WaltzError
from waltz_core.protocol import ADMIN, STORAGE
from waltz_core.protocol import admin as am
from waltz_core.protocol import storage as sm
from waltz_core.protocol.wire import RecordBatch
from waltz_core.storage import node as node_module
from waltz_core.storage.client import StorageAdminClient, StorageClient
from waltz_core.transport.channel import MessageChannel
from waltz_core.transport.memory import MemoryTransport
from waltz_transport_tcp.transport import TcpTransport

from .conftest import NodeHarness, make_record, make_records

pytestmark = pytest.mark.timeout(30)

NODE_FRAME = 64 * 1024
CLIENT_FRAME = 1024 * 1024


@pytest.fixture
async def small_node(tmp_path: Path) -> AsyncIterator[NodeHarness]:
    """A node that takes frames of 64 KiB, on tcp."""
    h = NodeHarness(tmp_path / "storage", uuid.uuid4(), transport=TcpTransport(max_frame_size=NODE_FRAME))
    await h.start()
    await (await h.admin()).set_assignment([0], True)
    try:
        yield h
    finally:
        await h.stop()
        await h.transport.aclose()


@pytest.fixture
async def client_transport() -> AsyncIterator[TcpTransport]:
    t = TcpTransport(max_frame_size=CLIENT_FRAME)
    try:
        yield t
    finally:
        await t.aclose()


async def _connect(node: NodeHarness, transport: TcpTransport) -> StorageClient:
    client = await StorageClient.connect(transport, node.data_listener.address, node.cluster_key, 4)
    node.clients.append(client)
    return client


async def test_the_client_takes_the_nodes_smaller_limit_and_sends_no_append_over_it(
        small_node: NodeHarness, client_transport: TcpTransport) -> None:
    client = await _connect(small_node, client_transport)
    assert client.node_max_frame_size == NODE_FRAME
    assert client.max_frame_size == NODE_FRAME
    assert client.max_batch_bytes == NODE_FRAME - sm.APPEND_BATCH_HEADROOM
    await client.append(1, 0, make_records(0, 3))
    large = RecordBatch.from_records([make_record(3, bytes(NODE_FRAME))])
    with pytest.raises(StorageError, match=f"its transport.max_frame_size is {NODE_FRAME}"):
        await client.append(1, 0, large)
    answered: list[WaltzError | None] = []
    with pytest.raises(StorageError, match=f"over what storage {client.address} takes"):
        client.append_nowait(1, 0, large, answered.append)
    assert answered == []  # raised instead: the caller's replica leaves its session at once
    # Nothing was sent: the connection goes on, and the node has what it had.
    assert not client.closed
    done: asyncio.Future[WaltzError | None] = asyncio.get_running_loop().create_future()
    client.append_nowait(1, 0, RecordBatch.from_records(make_records(3, 2)), done.set_result)
    assert await done is None
    assert await client.max_transaction_id(1, 0) == 4


async def test_a_batch_at_the_nodes_limit_is_taken(small_node: NodeHarness, client_transport: TcpTransport) -> None:
    client = await _connect(small_node, client_transport)
    overhead = RecordBatch.from_records([make_record(0, b"")]).nbytes
    fits = RecordBatch.from_records([make_record(0, bytes(client.max_batch_bytes - overhead))])
    assert fits.nbytes == client.max_batch_bytes
    await client.append(1, 0, fits)  # the headroom covers the append around it: the node takes the frame
    assert await client.max_transaction_id(1, 0) == 0


async def test_a_node_of_version_4_answers_the_open_as_before_and_the_client_keeps_its_limit(
        small_node: NodeHarness, client_transport: TcpTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_module, "STORAGE", attrs.evolve(STORAGE, versions=(3, 4)))
    client = await _connect(small_node, client_transport)
    assert client._p.channel.version == 4
    assert client.node_max_frame_size is None and client.max_frame_size == CLIENT_FRAME
    await client.append(1, 0, make_records(0, 2))
    assert await client.max_transaction_id(1, 0) == 1


async def test_a_node_that_announces_an_impossible_limit_fails_the_connect(
        small_node: NodeHarness, client_transport: TcpTransport) -> None:
    assert small_node.node is not None
    small_node.node.max_frame_size = 1000
    with pytest.raises(WaltzError, match=r"announced a max_frame_size of 1000 bytes, below the smallest allowed \(1024\)"):
        await _connect(small_node, client_transport)


async def test_a_node_with_larger_frames_answers_reads_within_the_clients(tmp_path: Path) -> None:
    """A node that takes larger frames than its server answers record lists within half of the
    server's limit (told by LimitedOpenRequest), not half of its own: a list over the server's
    limit would close the connection, and every partition's requests on it would fail."""
    small_frame = 64 * 1024
    node_transport, client_transport = TcpTransport(max_frame_size=CLIENT_FRAME), TcpTransport(max_frame_size=small_frame)
    h = NodeHarness(tmp_path / "storage", uuid.uuid4(), transport=node_transport)
    await h.start()
    try:
        await (await h.admin()).set_assignment([0], True)
        client = await _connect(h, client_transport)
        assert client.node_max_frame_size == CLIENT_FRAME and client.max_frame_size == small_frame
        records = [make_record(t, bytes([t]) * 5000) for t in range(100)]  # 500 KB in all
        for start in range(0, 100, 10):
            await client.append(1, 0, records[start:start + 10])
        got: list = []
        while len(got) < 100:
            batch = await client.record_list(1, 0, len(got), 100)
            assert 0 < batch.nbytes <= small_frame // 2
            got.extend(batch)
        assert got == records and not client.closed
        headers = await client.record_header_list(1, 0, 0, 100)
        assert [hd.transaction_id for hd in headers] == list(range(100))
    finally:
        await h.stop()
        await node_transport.aclose()
        await client_transport.aclose()


async def test_an_open_that_announces_an_impossible_limit_is_refused(small_node: NodeHarness,
                                                                     client_transport: TcpTransport) -> None:
    conn = await client_transport.connect(small_node.data_listener.address)
    channel = await MessageChannel.open(conn, STORAGE, "test")
    try:
        await channel.send(sm.LimitedOpenRequest(-1, 1, -1, small_node.cluster_key, 4, 100))
        refused = await channel.recv()
        assert isinstance(refused, sm.FailureResponse) and "below the smallest allowed (1024)" in refused.message
        await channel.send(sm.MaxTransactionIdRequest(1, 2, 0))  # the connection is not open
        assert "send an OpenRequest" in (await channel.recv()).message
    finally:
        await channel.close()


async def test_a_node_with_larger_frames_exports_records_within_the_tools(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline recovery reads records through a node's admin port. A tool whose frames are
    smaller than the node's is told its limit in the open (admin protocol 3), and the node's
    exports stay within half of it: before, a list over the tool's limit closed the connection."""
    small_frame = 64 * 1024
    node_transport, tool_transport = TcpTransport(max_frame_size=CLIENT_FRAME), TcpTransport(max_frame_size=small_frame)
    h = NodeHarness(tmp_path / "storage", uuid.uuid4(), transport=node_transport)
    await h.start()
    try:
        await (await h.admin()).set_assignment([0], True)
        client = await _connect(h, node_transport)
        records = [make_record(t, bytes([t]) * 5000) for t in range(100)]  # 500 KB in all
        for start in range(0, 100, 10):
            await client.append(1, 0, records[start:start + 10])
        tool = await StorageAdminClient.connect(tool_transport, h.admin_listener.address, h.cluster_key, 4)
        h.clients.append(tool)
        assert tool._p.channel.version == am.LIMITS_VERSION
        got: list = []
        while len(got) < 100:
            part = await tool.record_list(0, len(got), 100)
            assert 0 < len(part) and sum(len(r.data) + 64 for r in part) <= small_frame // 2
            got.extend(part)
        assert got == records
        # A tool of the version before keeps the node's bound (half the node's limit) and its own limit.
        monkeypatch.setattr(node_module, "ADMIN", attrs.evolve(ADMIN, versions=(2,)))
        old = await StorageAdminClient.connect(node_transport, h.admin_listener.address, h.cluster_key, 4)
        h.clients.append(old)
        assert old._p.channel.version == 2
        assert list(await old.record_list(0, 0, 100)) == records
    finally:
        await h.stop()
        await node_transport.aclose()
        await tool_transport.aclose()


async def test_an_admin_open_that_announces_an_impossible_limit_is_refused(small_node: NodeHarness,
                                                                           client_transport: TcpTransport) -> None:
    conn = await client_transport.connect(small_node.admin_listener.address)
    channel = await MessageChannel.open(conn, ADMIN, "test")
    try:
        await channel.send(am.LimitedAdminOpenRequest(1, small_node.cluster_key, 4, 100))
        refused = await channel.recv()
        assert isinstance(refused, am.AdminFailureResponse) and "below the smallest allowed (1024)" in refused.message
        await channel.send(am.MetricsRequest(2))  # the connection is not open
        assert "send an AdminOpenRequest" in (await channel.recv()).message
    finally:
        await channel.close()


@pytest.mark.parametrize("kind", ["tcp", "memory"])  # tcp: replies sent at once; memory: through the writer task
async def test_an_answer_over_the_nodes_own_limit_fails_that_read_only(tmp_path: Path, kind: str) -> None:
    """A record appended while the node took larger frames (its ``transport.max_frame_size``
    lowered since) does not fit in one answer: that read fails with an error naming the limit, and
    the connection goes on. Before, the answer's error ended the node's replies on the connection
    for good, and every later request on it waited forever."""
    directory, key, small = tmp_path / "storage", uuid.uuid4(), 512 * 1024

    def transport(max_frame_size: int) -> Any:
        return TcpTransport(max_frame_size=max_frame_size) if kind == "tcp" else MemoryTransport(max_frame_size=max_frame_size)

    large = NodeHarness(directory, key, transport=transport(CLIENT_FRAME))
    await large.start()
    try:
        await (await large.admin()).set_assignment([0], True)
        client = await large.client()
        records = [make_record(0, b"a"), make_record(1, bytes(600 * 1024)), make_record(2, b"c")]
        for record in records:
            await client.append(1, 0, [record])
    finally:
        await large.stop()
        await large.transport.aclose()
    h = NodeHarness(directory, key, transport=transport(small))
    await h.start()
    try:
        client = await h.client()
        with pytest.raises(StorageError, match=f"exceeds the maximum of {small}"):
            await asyncio.wait_for(client.record(1, 0, 1), 10)
        assert await asyncio.wait_for(client.record(1, 0, 2), 10) == records[2]
        assert list(await client.record_list(1, 0, 0, 3)) == records[:1]  # a list stops before the record
        assert not client.closed
    finally:
        await h.stop()
        await h.transport.aclose()
