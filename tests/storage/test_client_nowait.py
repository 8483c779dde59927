"""The storage client's appends that do not await (``append_nowait``), which the replicated store
streams with: answered by callback, refusals and connection failures included. Over tcp, whose
connections have ``send_nowait``, and over the memory transport, where the client sends from a
task instead."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from waltz_core.errors import ConnectionClosedError, OutOfOrderAppendError, StaleSessionError, WaltzError
from waltz_core.protocol.wire import RecordBatch
from waltz_core.storage.client import StorageClient
from waltz_transport_tcp.transport import TcpTransport

from .conftest import NodeHarness, make_records

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["tcp", "memory"])
async def node(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[NodeHarness]:
    transport = TcpTransport(max_frame_size=1024 * 1024) if request.param == "tcp" else None
    h = NodeHarness(tmp_path / "storage", uuid.uuid4(), transport=transport)
    await h.start()
    admin = await h.admin()
    await admin.set_assignment([0, 1], True)
    try:
        yield h
    finally:
        await h.stop()
        if transport is not None:
            await transport.aclose()


def _append(client: StorageClient, session_id: int, partition_id: int,
            batch: RecordBatch) -> asyncio.Future[WaltzError | None]:
    answered: asyncio.Future[WaltzError | None] = asyncio.get_running_loop().create_future()
    client.append_nowait(session_id, partition_id, batch, answered.set_result)
    return answered


async def test_appends_are_answered_by_callback_in_order(node: NodeHarness) -> None:
    client = await node.client()
    # tcp connections send without a task; the memory transport has no send_nowait
    assert (client._p._send_nowait is not None) is isinstance(node.transport, TcpTransport)
    first, second = (RecordBatch.from_records(make_records(0, 10)), RecordBatch.from_records(make_records(10, 5)))
    answers = [_append(client, 1, 0, first), _append(client, 1, 0, second),
               _append(client, 1, 1, RecordBatch.from_records(make_records(0, 3, partition_id=1)))]
    assert await asyncio.gather(*answers) == [None, None, None]
    assert await client.max_transaction_id(1, 0) == 14
    assert [r.transaction_id for r in await client.record_list(1, 0, 0, 100)] == list(range(15))
    assert await client.max_transaction_id(1, 1) == 2


async def test_a_refused_append_is_answered_with_its_error_and_the_connection_goes_on(node: NodeHarness) -> None:
    client = await node.client()
    assert await _append(client, 2, 0, RecordBatch.from_records(make_records(0, 5))) is None
    gap = await _append(client, 2, 0, RecordBatch.from_records(make_records(7, 2)))
    assert isinstance(gap, OutOfOrderAppendError)
    stale = await _append(client, 1, 0, RecordBatch.from_records(make_records(5, 2)))
    assert isinstance(stale, StaleSessionError)
    assert not client.closed
    assert await _append(client, 2, 0, RecordBatch.from_records(make_records(5, 2))) is None
    assert await client.max_transaction_id(2, 0) == 6


async def test_appends_outstanding_when_the_connection_fails_are_answered_with_the_failure(
        node: NodeHarness) -> None:
    client = await node.client()
    answers = [_append(client, 1, p, RecordBatch.from_records(make_records(0, 200, partition_id=p))) for p in (0, 1)]
    await node.stop()  # the node goes away with the appends outstanding (or just answered)
    results = await asyncio.wait_for(asyncio.gather(*answers), 10)
    assert all(r is None or isinstance(r, WaltzError) for r in results)
    while not client.closed:  # the reader notices the closed connection
        await asyncio.sleep(0.01)
    with pytest.raises(ConnectionClosedError):  # raised at once, the callback is not called
        client.append_nowait(1, 0, RecordBatch.from_records(make_records(200, 1)), lambda e: pytest.fail("called"))


async def test_closing_the_client_answers_what_is_outstanding(node: NodeHarness) -> None:
    client = await node.client()
    answers = [_append(client, 1, 0, RecordBatch.from_records(make_records(i * 50, 50))) for i in range(4)]
    await client.close()
    results = await asyncio.wait_for(asyncio.gather(*answers), 10)
    assert all(r is None or isinstance(r, ConnectionClosedError) for r in results)


async def test_a_callback_that_raises_is_logged_and_the_connection_goes_on(
        node: NodeHarness, caplog: pytest.LogCaptureFixture) -> None:
    """A bug in one answer's callback must not end the reader: every other request of the
    connection would wait for an answer that never comes."""
    client = await node.client()

    def broken(_error: WaltzError | None) -> None:
        raise RuntimeError("a bug in the callback")

    client.append_nowait(1, 0, RecordBatch.from_records(make_records(0, 2)), broken)
    assert await _append(client, 1, 0, RecordBatch.from_records(make_records(2, 2))) is None
    assert not client.closed
    assert await client.max_transaction_id(1, 0) == 3
    assert "a response callback failed" in caplog.text
