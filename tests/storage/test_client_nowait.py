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


def _sent_types(client: StorageClient) -> list[str]:
    """Record the type of every message the client's pipeline sends from now on."""
    from waltz_core.protocol import storage as sm

    sent: list[str] = []
    pipeline = client._p
    send = pipeline.send_nowait

    def recording(seq: int, frame: bytes, callback):  # type: ignore[no-untyped-def]
        sent.append(type(sm.decode(frame)).__name__)
        send(seq, frame, callback)

    pipeline.send_nowait = recording  # type: ignore[method-assign]
    return sent


async def test_the_appends_of_one_loop_step_share_one_message(node: NodeHarness) -> None:
    """Storage protocol 4: appends made together go out as one StorageAppendManyRequest, each
    answered with its own result; a single append still goes alone; send_appends sends what is
    queued at once (the replicated store calls it after pumping its partitions)."""
    from waltz_core.errors import PartitionNotFoundError

    client = await node.client()
    sent = _sent_types(client)
    answers = [_append(client, 1, 0, RecordBatch.from_records(make_records(0, 4))),
               _append(client, 1, 1, RecordBatch.from_records(make_records(0, 2, partition_id=1))),
               _append(client, 1, 0, RecordBatch.from_records(make_records(9, 1))),  # a gap: refused alone
               _append(client, 1, 2, RecordBatch.from_records(make_records(0, 1, partition_id=2)))]  # not assigned
    client.send_appends()
    assert sent == ["StorageAppendManyRequest"]
    results = await asyncio.gather(*answers)
    assert results[:2] == [None, None]
    assert isinstance(results[2], OutOfOrderAppendError) and isinstance(results[3], PartitionNotFoundError)
    assert await _append(client, 1, 0, RecordBatch.from_records(make_records(4, 1))) is None  # from the loop callback
    assert sent == ["StorageAppendManyRequest", "StorageAppendRequest"]
    assert [await client.max_transaction_id(1, p) for p in (0, 1)] == [4, 1]


async def test_appends_made_by_answer_callbacks_go_out_together(node: NodeHarness) -> None:
    """Each answer's callbacks append the partitions' next batches (as the replicated store's
    streaming replicas do): they leave in one message when the callbacks are done."""
    client = await node.client()
    sent = _sent_types(client)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    rounds = {0: 0, 1: 0}

    def next_batch(partition_id: int) -> None:
        rounds[partition_id] += 1
        if rounds[partition_id] > 3:
            if all(r > 3 for r in rounds.values()) and not done.done():
                done.set_result(None)
            return
        start = (rounds[partition_id] - 1) * 5
        batch = RecordBatch.from_records(make_records(start, 5, partition_id=partition_id))
        client.append_nowait(1, partition_id, batch, lambda e, p=partition_id: e is None and next_batch(p))

    next_batch(0)
    next_batch(1)
    await asyncio.wait_for(done, 10)
    assert sent == ["StorageAppendManyRequest"] * 3
    assert [await client.max_transaction_id(1, p) for p in (0, 1)] == [14, 14]


async def test_a_version_3_node_gets_every_append_alone(node: NodeHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of the release before speaks storage protocol 3: no StorageAppendManyRequest for it."""
    import attrs

    from waltz_core.storage import node as node_module

    monkeypatch.setattr(node_module, "STORAGE", attrs.evolve(node_module.STORAGE, versions=(3,)))
    client = await node.client()
    assert client._p.channel.version == 3
    sent = _sent_types(client)
    answers = [_append(client, 1, p, RecordBatch.from_records(make_records(0, 3, partition_id=p))) for p in (0, 1)]
    assert await asyncio.gather(*answers) == [None, None]
    assert sent == ["StorageAppendRequest", "StorageAppendRequest"]


async def test_a_message_of_several_appends_stays_within_its_size(node: NodeHarness) -> None:
    """Appends beyond the byte limit of one message (MANY_APPENDS_MAX_BYTES, at most half the
    largest frame) go in the next message: none is larger than the limit plus its head."""
    client = await node.client()
    sent = _sent_types(client)
    from .conftest import make_record

    def batch(start: int, partition_id: int) -> RecordBatch:  # 40 records of 100 bytes: every batch as large
        return RecordBatch.from_records([make_record(t, b"x" * 100, partition_id) for t in range(start, start + 40)])

    batches = [batch(0, 0), batch(0, 1), batch(40, 0), batch(40, 1)]
    assert len({b.nbytes for b in batches}) == 1
    client._many_max_bytes = 2 * batches[0].nbytes  # two batches a message
    answers = [_append(client, 1, i % 2, b) for i, b in enumerate(batches)]
    assert await asyncio.gather(*answers) == [None] * 4
    assert sent == ["StorageAppendManyRequest", "StorageAppendManyRequest"]
    assert [await client.max_transaction_id(1, p) for p in (0, 1)] == [79, 79]


def test_an_answer_to_several_appends_is_checked_and_shared_out() -> None:
    """Each refused append gets its own error, the others None; a node that answers several
    appends with anything but an AppendManyResponse fails every one of them (a ProtocolError),
    never acknowledges them. Either way the client then sends what the callbacks appended."""
    from waltz_core.errors import ProtocolError
    from waltz_core.protocol import storage as sm
    from waltz_core.storage.client import _QueuedAppends

    class Client:
        address = "storage-1:7000"
        sent = 0

        def send_appends(self) -> None:
            self.sent += 1

    client = Client()
    got: list[WaltzError | None] = []
    answer = _QueuedAppends(client, [got.append] * 3).answer  # type: ignore[arg-type]
    answer(sm.AppendManyResponse(-1, 1, -1, ((1, StaleSessionError.code, "fenced"),)), None)
    assert got[0] is None and got[2] is None
    assert type(got[1]) is StaleSessionError and str(got[1]) == "fenced"
    got.clear()
    _QueuedAppends(client, [got.append] * 2).answer(sm.SuccessResponse(-1, 2, -1), None)  # type: ignore[arg-type]
    assert [type(e) for e in got] == [ProtocolError, ProtocolError]
    assert "storage-1:7000 answered 2 appends with a SuccessResponse" in str(got[0])
    assert client.sent == 2
