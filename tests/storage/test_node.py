"""The storage node over the memory transport: the ten requests, fencing, admin, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from waltz_core.errors import (
    ChecksumError,
    ClusterKeyMismatchError,
    ConnectionClosedError,
    FrameTooLargeError,
    HandshakeError,
    OutOfOrderAppendError,
    PartitionNotFoundError,
    ProtocolError,
    StaleSessionError,
    StorageError,
)
from waltz_core.protocol import STORAGE
from waltz_core.protocol import storage as sm
from waltz_core.protocol.wire import Record, RecordBatch, RecordHeader, SessionInfo
from waltz_core.storage.node import StorageNode, _Item
from waltz_core.testing import require
from waltz_core.testing.conformance.coordination import eventually
from waltz_core.testing.faults import small_filesystem, small_filesystems_available
from waltz_core.transport.channel import MessageChannel

from .conftest import NodeHarness, io_thread_blocked, make_record, make_records


async def _ready(h: NodeHarness, *partitions: int) -> None:
    admin = await h.admin()
    await admin.set_assignment(list(partitions or (0,)), True)


@contextlib.asynccontextmanager
async def _started_node(tmp_path: Path, cluster_key: uuid.UUID, *ready: int,
                        **node_options: Any) -> AsyncIterator[tuple[NodeHarness, StorageNode]]:
    """A node started with ``node_options`` and the ``ready`` partitions assigned; stopped at the end."""
    h = NodeHarness(tmp_path, cluster_key, node_options=node_options)
    node = await h.start()
    try:
        await _ready(h, *ready)
        yield h, node
    finally:
        await h.stop()


async def test_the_ten_requests(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    c = await harness.client()
    assert await c.last_session_info(1, 0) == SessionInfo(-1, -1, -1)
    await c.set_low_water_mark(1, 0, -1)
    assert await c.max_transaction_id(1, 0) == -1
    recs = make_records(0, 30)
    await c.append(1, 0, recs[:10])
    await c.append(1, 0, recs[10:])
    assert await c.max_transaction_id(1, 0) == 29
    assert await c.record(1, 0, 12) == recs[12]
    assert await c.record(1, 0, 30) is None
    assert await c.record_header(1, 0, 5) == RecordHeader(5, recs[5].req_id, recs[5].header)
    assert await c.record_header(1, 0, 99) is None
    assert await c.record_list(1, 0, 25, 100) == tuple(recs[25:])
    assert [h.transaction_id for h in await c.record_header_list(1, 0, 3, 4)] == [3, 4, 5, 6]
    await c.truncate(1, 0, 19)
    assert await c.max_transaction_id(1, 0) == 19
    await c.set_low_water_mark(2, 0, 25)  # new session; storage behind the cluster: local lwm 19
    assert await c.last_session_info(2, 0) == SessionInfo(2, 25, 19)


async def test_session_fencing_higher_wins_lower_rejected_from_then_on(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    old = await harness.client()
    new = await harness.client()
    await old.append(5, 0, make_records(0, 2))
    await new.last_session_info(6, 0)  # a new session's recovery fences session 5
    with pytest.raises(StaleSessionError, match="session 5 is fenced by the newer session 6"):
        await old.append(5, 0, make_records(2, 1))
    with pytest.raises(StaleSessionError):
        await old.record(5, 0, 0)
    await new.append(6, 0, make_records(2, 1))
    assert await new.max_transaction_id(6, 0) == 2


async def test_fencing_survives_restart_through_the_control_file(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    c = await harness.client()
    await c.set_low_water_mark(9, 0, -1)
    await harness.restart()
    c = await harness.client()
    with pytest.raises(StaleSessionError):
        await c.max_transaction_id(8, 0)
    assert await c.max_transaction_id(9, 0) == -1


async def test_bad_requests_get_clear_failures_and_the_node_keeps_serving(harness: NodeHarness) -> None:
    await _ready(harness, 0, 1)
    good = await harness.client()
    bad = await harness.client()
    await good.append(1, 1, make_records(0, 3, 1))
    with pytest.raises(OutOfOrderAppendError, match=r"transaction out of order.*has id 5, the next id must be 0"):
        await bad.append(1, 0, make_records(5, 1))
    with pytest.raises(PartitionNotFoundError, match="partition 2 is not assigned"):
        await bad.max_transaction_id(1, 2)
    with pytest.raises(PartitionNotFoundError, match="partition 99 does not exist"):
        await bad.max_transaction_id(1, 99)
    corrupt = make_record(0)
    corrupt = Record(0, corrupt.req_id, corrupt.header, corrupt.data, corrupt.checksum ^ 1)
    with pytest.raises(ChecksumError, match="data checksum"):
        await bad.append(1, 0, [corrupt])
    with pytest.raises(StorageError, match="max_records must not be negative"):
        await bad.record_list(1, 0, 0, -1)
    with pytest.raises(ClusterKeyMismatchError, match="does not match"):
        await harness.client(cluster_key=uuid.uuid4())
    with pytest.raises(ClusterKeyMismatchError, match="3 partitions requested"):
        await harness.client(num_partitions=3)
    # The same connection still works after its refusals, and so does the other one.
    await bad.append(1, 0, make_records(0, 2))
    assert await bad.max_transaction_id(1, 0) == 1
    assert await good.max_transaction_id(1, 1) == 2


async def test_requests_before_open_are_refused(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    conn = await harness.transport.connect(harness.data_listener.address)
    ch = await MessageChannel.open(conn, STORAGE, "test")
    await ch.send(sm.MaxTransactionIdRequest(1, 7, 0))
    resp = await ch.recv()
    assert isinstance(resp, sm.FailureResponse) and resp.seq_num == 7
    assert "send an OpenRequest" in resp.message
    await ch.close()


async def test_undecodable_bytes_close_only_that_connection(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    other = await harness.client()
    conn = await harness.transport.connect(harness.data_listener.address)
    ch = await MessageChannel.open(conn, STORAGE, "test")
    await conn.send(b"\x63" + b"garbage" * 5)
    resp = await ch.recv()
    assert isinstance(resp, sm.FailureResponse) and resp.seq_num == -1
    assert resp.error_code == ProtocolError.code and "unknown message type" in resp.message
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(ch.recv(), 2)
    assert await other.max_transaction_id(1, 0) == -1


async def test_wrong_protocol_is_refused_at_handshake(harness: NodeHarness) -> None:
    from waltz_core.protocol import ADMIN

    conn = await harness.transport.connect(harness.data_listener.address)
    with pytest.raises(HandshakeError, match="speaks the storage protocol, this endpoint speaks storage admin"):
        await MessageChannel.open(conn, ADMIN, "confused")


async def test_oversize_frame_is_refused_and_other_requests_continue(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    c = await harness.client()
    huge = make_record(0, b"x" * (2 * 1024 * 1024))  # above the 1 MiB max frame
    with pytest.raises(StorageError, match=r"its transport\.max_frame_size is 1048576"):
        await c.append(1, 0, [huge])  # the client knows the node's limit (protocol 5): nothing is sent
    with pytest.raises(FrameTooLargeError, match="exceeds the maximum"):  # past that check: the transport's
        await c._p.request(9, sm.StorageAppendRequest(1, 9, 0, [huge]))
    await c.append(1, 0, make_records(0, 1))
    assert await c.max_transaction_id(1, 0) == 0


async def test_offline_flag_semantics(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    admin = await harness.admin()
    c = await harness.client()
    await c.set_low_water_mark(3, 0, -1)
    with pytest.raises(StorageError, match="offline recovery requests need it made unavailable"):
        await c.max_transaction_id(3, 0, offline=True)
    await admin.set_availability([0], False)
    with pytest.raises(PartitionNotFoundError, match="not available"):
        await c.max_transaction_id(3, 0)
    with pytest.raises(StaleSessionError, match="stored session is 3"):
        await c.append(4, 0, make_records(0, 1), offline=True)
    await c.append(3, 0, make_records(0, 2), offline=True)
    assert await c.max_transaction_id(3, 0, offline=True) == 1
    assert await admin.record_list(0, 0, 10) == tuple(make_records(0, 2))
    assert await admin.assigned_partition_status() == {0: False}
    await admin.set_availability([0], True)
    assert await c.max_transaction_id(3, 0) == 1


async def test_admin_assignment_and_deletion(harness: NodeHarness) -> None:
    admin = await harness.admin()
    c = await harness.client()
    await admin.set_assignment([2, 3], True)
    assert await admin.assigned_partition_status() == {2: True, 3: True}
    await c.append(1, 2, make_records(0, 4, 2))
    await c.set_low_water_mark(1, 2, 3)
    assert await admin.last_session_info(2) == SessionInfo(1, 3, 3)
    await admin.set_assignment([2], False)
    with pytest.raises(PartitionNotFoundError):
        await c.max_transaction_id(1, 2)
    await admin.set_assignment([2], True)  # files kept: the data is back
    assert await c.max_transaction_id(1, 2) == 3
    await admin.set_assignment([2], False, delete_storage_files=True)
    assert not (harness.directory / "2").exists()
    await admin.set_assignment([2], True)
    assert await c.max_transaction_id(1, 2) == -1
    with pytest.raises(PartitionNotFoundError):
        await admin.set_availability([0], True)
    metrics = json.loads(await admin.metrics_json())
    appended = {tuple(sorted(r["labels"].items())): r["value"] for r in metrics["waltz_storage_appended_records"]}
    assert appended[(("partition", "2"),)] == 4


async def test_group_commit_batches_concurrent_appends(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    c = await harness.client()
    await asyncio.gather(*(c.append(1, 0, [make_record(t)]) for t in range(60)))
    assert await c.record_list(1, 0, 0, 100) == tuple(make_records(0, 60))
    node = harness.node
    assert node is not None
    batches = node.metrics.counter("storage_append_batches", labels={"partition": "0"}).value
    assert batches < 60, "concurrent appends must share fdatasyncs"


async def test_back_pressure_bounded_partition_queue(tmp_path, cluster_key) -> None:
    # io_threads=2: partitions 0 and 1 on their own threads
    async with _started_node(tmp_path, cluster_key, 0, io_threads=2) as (h, node):
        worker = node.workers[0]
        c = await h.client()
        async with io_thread_blocked(worker):  # requests pile up in the partition's bounded queue
            tasks = [asyncio.ensure_future(c.append(1, 0, [make_record(t)])) for t in range(node.queue_size + 20)]
            await asyncio.sleep(0.2)
            assert worker.queue.qsize() == node.queue_size  # full: the connection is no longer read
            other = await h.client()
            await _ready(h, 1)  # partition 1 (on the other I/O thread) progresses while partition 0 is stuck
            await other.append(1, 1, make_records(0, 1, 1))
        await asyncio.gather(*tasks)
        assert await c.max_transaction_id(1, 0) == node.queue_size + 19


@pytest.mark.parametrize("io_threads", [0, 1, 3, 4])
async def test_a_queue_of_one_under_many_connections_loses_no_wake_up(tmp_path, cluster_key, io_threads: int) -> None:
    # Appends pipelined 5 deep on each of 4 connections (one per partition) into queues of one:
    # most puts wait for their I/O thread to take the queue, and the threads serve 4, 2 or 1
    # partitions each (0: the rounds run on the event loop). A wake-up missed between the loop and a thread (a queue or a doorbell)
    # would hang an append (and time the test out).
    async with _started_node(tmp_path, cluster_key, 0, 1, 2, 3, queue_size=1, io_threads=io_threads) as (h, _):
        clients = [await h.client() for _ in range(4)]
        per_partition, depth = 60, 5

        async def writer(pid: int) -> None:
            c = clients[pid]
            for t in range(0, per_partition, depth):  # sent in order on one connection: queued in order
                await asyncio.gather(*(c.append(1, pid, make_records(x, 1, pid)) for x in range(t, t + depth)))

        await asyncio.wait_for(asyncio.gather(*(writer(pid) for pid in range(4))), 60)
        for pid in range(4):
            assert await clients[0].record_list(1, pid, 0, 100) == tuple(make_records(0, per_partition, pid))


async def test_a_bug_in_a_batch_fails_its_requests_and_the_partition_goes_on(harness: NodeHarness,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    await _ready(harness, 0)
    node = harness.node
    assert node is not None
    worker = node.workers[0]
    c = await harness.client()
    await c.append(1, 0, make_records(0, 1))
    real = worker._process
    calls = 0

    def broken_once(items, out):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return real(items, out)

    monkeypatch.setattr(worker, "_process", broken_once)
    with pytest.raises(StorageError, match="internal error: RuntimeError"):
        await c.append(1, 0, make_records(1, 1))
    await c.append(1, 0, make_records(1, 1))  # the thread survived and serves the partition
    assert await c.record_list(1, 0, 0, 10) == tuple(make_records(0, 2))


async def test_a_round_of_file_work_held_too_long_makes_the_node_not_ready(
        tmp_path, cluster_key, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow or hung disk holds an I/O thread inside one round: /readyz says which thread and
    for how long, the gauge storage_io_round_seconds grows, and both clear when the round ends."""
    from waltz_core.storage import node as node_module

    monkeypatch.setattr(node_module, "IO_ROUND_STALL_NOT_READY", 0.2)
    async with _started_node(tmp_path, cluster_key, 0, io_threads=1) as (_h, node):
        assert node.healthy()[0] is True
        async with io_thread_blocked(node.workers[0]):
            await asyncio.sleep(0.3)
            ready, details = node.healthy()
            assert ready is False
            [reason] = details["reasons"]
            assert reason.startswith("storage-io-0 has been in one round of file work for "), reason
            assert "(a slow or hung disk?)" in reason
            gauge = [line for line in node.metrics.render_prometheus().splitlines()
                     if line.startswith('waltz_storage_io_round_seconds{thread="0"}')]
            assert len(gauge) == 1 and float(gauge[0].split()[1]) > 0.2, gauge
        assert node.healthy() == (True, {"partitions": node.num_partitions, "broken_partitions": {}, "reasons": []})
        assert 'waltz_storage_io_round_seconds{thread="0"} 0' in node.metrics.render_prometheus()


@pytest.mark.parametrize("io_threads", [0, 1])
async def test_close_answers_or_drops_queued_work_without_hanging(tmp_path, cluster_key, io_threads: int) -> None:
    h = NodeHarness(tmp_path, cluster_key, node_options={"io_threads": io_threads})
    await h.start()
    await _ready(h, 0, 1)
    c = await h.client()
    tasks = [asyncio.ensure_future(c.append(1, pid, make_records(t, 1, pid))) for pid in (0, 1) for t in range(30)]
    await asyncio.sleep(0)
    node = h.node
    assert node is not None
    await asyncio.wait_for(node.close(), 10)  # queued appends are written or refused, the threads end
    assert not any(io.running for io in node.io_threads)
    await asyncio.gather(*tasks, return_exceptions=True)
    h.node = None
    await h.stop()


async def test_restart_keeps_every_acknowledged_record(harness: NodeHarness) -> None:
    await _ready(harness, 0, 1)
    c = await harness.client()
    recs = make_records(0, 200)
    for i in range(0, 200, 17):
        await c.append(1, 0, recs[i : i + 17])
    await harness.restart()
    c = await harness.client()
    got: list[Record] = []
    while len(got) < 200:
        got.extend(await c.record_list(1, 0, len(got), 64))
    assert got == recs
    assert harness.node is not None and harness.node.repairs == []


async def test_responses_are_not_protocol_requests(harness: NodeHarness) -> None:
    conn = await harness.transport.connect(harness.data_listener.address)
    ch = await MessageChannel.open(conn, STORAGE, "test")
    await ch.send(sm.SuccessResponse(1, 4, 0))
    resp = await ch.recv()
    assert isinstance(resp, sm.FailureResponse) and resp.seq_num == 4
    assert resp.error_code == ProtocolError.code
    await ch.close()


async def test_one_io_thread_writes_every_partition_of_a_round_before_it_syncs_any(tmp_path, cluster_key) -> None:
    """Appends of three partitions queued while their I/O thread is busy are one round: each
    partition's batch is written, then each is synced, and none is answered before its sync
    (without the node journal: with it, tests/storage/test_journal.py)."""
    async with _started_node(tmp_path, cluster_key, 0, 1, 2, io_threads=1, journal=False) as (h, node):
        calls: list[str] = []
        for worker in node.workers[:3]:
            store = worker.store
            assert store is not None
            write, sync = store.write_validated, store.sync_written  # type: ignore[attr-defined]

            def recording_write(data, offsets, pid=worker.partition_id, write=write):  # type: ignore[no-untyped-def]
                calls.append(f"write {pid}")
                write(data, offsets)

            def recording_sync(pid=worker.partition_id, sync=sync):  # type: ignore[no-untyped-def]
                calls.append(f"sync {pid}")
                sync()

            store.write_validated = recording_write  # type: ignore[attr-defined]
            store.sync_written = recording_sync  # type: ignore[attr-defined]
        c = await h.client()
        async with io_thread_blocked(node.workers[0]):
            appends = [asyncio.ensure_future(c.append(1, pid, make_records(0, 2, pid))) for pid in (0, 1, 2)]
            await asyncio.sleep(0.1)
            assert not any(a.done() for a in appends)
        await asyncio.gather(*appends)
        writes = [i for i, call in enumerate(calls) if call.startswith("write")]
        syncs = [i for i, call in enumerate(calls) if call.startswith("sync")]
        assert sorted(calls) == ["sync 0", "sync 1", "sync 2", "write 0", "write 1", "write 2"], calls
        assert max(writes) < min(syncs), calls
        for pid in (0, 1, 2):
            assert await c.record_list(1, pid, 0, 10) == tuple(make_records(0, 2, pid))


@pytest.mark.parametrize("journal", [False, True], ids=["own-fdatasync", "node-journal"])
async def test_a_partition_that_rings_again_within_a_round_is_synced_before_its_next_items(tmp_path, cluster_key,
                                                                                          journal: bool) -> None:
    """A partition on the doorbell twice in one round (it rang again while the thread worked): the
    append written at its first turn is made durable before its next items run, here a read."""
    async with _started_node(tmp_path, cluster_key, 0, io_threads=1, journal=journal) as (_, node):
        worker = node.workers[0]
        store = worker.store
        assert store is not None
        calls: list[str] = []
        write, sync, read = store.write_validated, store.sync_written, store.read_batch  # type: ignore[attr-defined]
        store.write_validated = lambda *a, **k: (calls.append("write"), write(*a, **k))[1]  # type: ignore[attr-defined]
        store.sync_written = lambda: (calls.append("sync"), sync())[1]  # type: ignore[attr-defined]
        node_journal = node.io_threads[0].journal
        assert (node_journal is not None) == journal
        if node_journal is not None:
            append_to_journal = node_journal.append
            node_journal.append = lambda entries: (calls.append("sync"), append_to_journal(entries))[1]  # type: ignore[method-assign]
        store.read_batch = lambda *a: (calls.append("read"), read(*a))[1]  # type: ignore[method-assign]
        answers: list[object] = []
        batch = RecordBatch.from_records(make_records(0, 3))
        append = _Item(sm.StorageAppendRequest(1, 1, 0, batch), answers.append)
        listing = _Item(sm.RecordListRequest(1, 2, 0, 0, 10), answers.append)
        real_run = worker.run

        def run_then_queue_the_read(items, replies):  # type: ignore[no-untyped-def]
            group = real_run(items, replies)
            if listing not in items:
                worker.queue.put_nowait(listing)  # queued, and rung again, while the thread works
            return group

        worker.run = run_then_queue_the_read  # type: ignore[method-assign]
        assert worker.queue.put_nowait(append)
        replies, stop = await asyncio.get_running_loop().run_in_executor(
            None, worker.io.run_round, [worker, worker])
        assert not stop
        assert calls == ["write", "sync", "read"]
        responses = [response for _reply, response in replies]
        assert [type(r).__name__ for r in responses] == ["SuccessResponse", "RecordListResponse"]
        assert responses[1].records == tuple(make_records(0, 3))


async def test_appends_of_several_partitions_in_one_message_get_one_answer(harness: NodeHarness) -> None:
    """Storage protocol 4: each append of a StorageAppendManyRequest is handled as if it had
    come alone (fencing, order, checksums); one AppendManyResponse lists the refused ones by
    index, and every other one is durable."""
    await _ready(harness, 0, 1, 2)
    conn = await harness.transport.connect(harness.data_listener.address)
    ch = await MessageChannel.open(conn, attrs.evolve(STORAGE, versions=(3, 4)), "test")
    assert ch.version == 4
    await ch.send(sm.StorageAppendManyRequest(-1, 3, -1, ()))  # before the open request
    refused = await ch.recv()
    assert isinstance(refused, sm.FailureResponse) and refused.seq_num == 3 and "send an OpenRequest" in refused.message
    await ch.send(sm.OpenRequest(-1, -1, -1, harness.cluster_key, 4))
    assert isinstance(await ch.recv(), sm.SuccessResponse)

    def batch(start: int, count: int, partition_id: int) -> RecordBatch:
        return RecordBatch.from_records(make_records(start, count, partition_id))

    await ch.send(sm.StorageAppendManyRequest(-1, 5, -1, (
        sm.StorageAppendRequest(2, 0, 0, batch(0, 10, 0)),
        sm.StorageAppendRequest(2, 1, 1, batch(0, 3, 1)),
        sm.StorageAppendRequest(2, 2, 0, batch(10, 5, 0)),  # the same partition again: after the first
        sm.StorageAppendRequest(2, 3, 2, batch(4, 1, 2)),  # out of order: partition 2 is empty
        sm.StorageAppendRequest(2, 4, 3, batch(0, 1, 3)),  # not assigned
        sm.StorageAppendRequest(2, 5, 9, batch(0, 1, 9)),  # no such partition
    )))
    answer = await asyncio.wait_for(ch.recv(), 10)
    assert isinstance(answer, sm.AppendManyResponse) and answer.seq_num == 5
    assert [(index, code) for index, code, _ in answer.failures] == [
        (3, OutOfOrderAppendError.code), (4, PartitionNotFoundError.code), (5, PartitionNotFoundError.code)]
    assert "partition 2: transaction out of order" in answer.failures[0][2]
    await ch.send(sm.StorageAppendManyRequest(-1, 6, -1, (sm.StorageAppendRequest(1, 0, 1, batch(3, 1, 1)),)))
    stale = await asyncio.wait_for(ch.recv(), 10)  # session 1 is fenced by 2 on partition 1
    assert [(index, code) for index, code, _ in stale.failures] == [(0, StaleSessionError.code)]
    await ch.send(sm.StorageAppendManyRequest(-1, 7, -1, ()))
    assert await asyncio.wait_for(ch.recv(), 10) == sm.AppendManyResponse(-1, 7, -1)
    await ch.close()
    client = await harness.client()
    assert [await client.max_transaction_id(2, p) for p in (0, 1, 2)] == [14, 2, -1]
    assert [r.transaction_id for r in await client.record_list(2, 0, 0, 100)] == list(range(15))


def test_a_failed_write_leaves_the_buffer_it_wrote_free_to_change() -> None:
    """A full disk's ENOSPC comes out of pwrite_all as itself: the traceback it carries must not
    keep the written bytearray (a store's batches gathered in memory) exported, or clearing it
    while the failure is handled raises BufferError in its place (seen: the node journal then
    failed with 'Existing exports of data: object cannot be re-sized')."""
    from waltz_core.storage.files import pwrite_all

    gathered = bytearray(b"records" * 100)
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as failure:
            pwrite_all(fd, gathered, 0)
        assert failure.value.errno == errno.ENOSPC
        gathered.clear()  # while the failure (and its traceback) is still held
    finally:
        os.close(fd)
    assert gathered == bytearray()


@pytest.mark.parametrize("journal", [False, True])
async def test_a_full_disk_fails_appends_with_the_reason_and_they_go_on_once_space_is_freed(
        tmp_path: Path, cluster_key: uuid.UUID, journal: bool) -> None:
    """On a real full filesystem: the append that does not fit is refused with ENOSPC's text,
    /readyz says why, the free-bytes gauge shows it; once space is freed the next append is
    written, without a restart, and every acknowledged record reads back."""
    require(small_filesystems_available(), "root and mount (a tmpfs of a fixed size: a real full disk)")
    with small_filesystem(tmp_path / "small", 4 << 20) as disk:
        async with _started_node(disk.path / "node", cluster_key, 0, journal=journal) as (h, node):
            c = await h.client()
            first = 0
            disk.fill(leave=200 * 1024)
            big = [make_record(t, bytes(20_000)) for t in range(10_000)]
            with pytest.raises(StorageError, match="No space left on device"):
                while True:  # batches of 20 KB, larger than what a store gathers in memory
                    await c.append(1, 0, big[first:first + 1])
                    first += 1
            ready, details = node.healthy()
            assert not ready and any("No space left on device" in r for r in details["reasons"]), details
            free = float(next(line.split()[1] for line in node.metrics.render_prometheus().splitlines()
                              if line.startswith("waltz_storage_filesystem_free_bytes ")))
            assert free < 200 * 1024, free
            disk.free()
            assert await c.max_transaction_id(1, 0) == first - 1
            await c.append(1, 0, big[first:first + 2])
            assert node.healthy() == (True, {"partitions": node.num_partitions, "broken_partitions": {},
                                             "reasons": []})
            assert list(await c.record_list(1, 0, 0, first + 2)) == big[: first + 2]


async def test_a_partition_whose_files_cannot_be_opened_is_not_ready_and_opens_at_a_later_request(
        tmp_path: Path, cluster_key: uuid.UUID, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError while opening a partition's files (a full disk during a repair, a file it may
    not open) is the machine's, not the data's: the node says so (/readyz, the gauge), answers
    its requests with the reason and tries again at a request, at most once per
    OPEN_RETRY_INTERVAL, instead of leaving the partition without a store until a restart."""
    from waltz_core.storage import node as node_module

    monkeypatch.setattr(node_module, "OPEN_RETRY_INTERVAL", 0.2)
    async with _started_node(tmp_path, cluster_key, 0) as (h, node):
        c = await h.client()
        await c.append(1, 0, make_records(0, 3))
        worker = node.workers[0]
        layout = node.layout
        real_open = layout.open_partition
        failing = True

        def open_partition(pid: int) -> Any:
            if failing:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_open(pid)

        monkeypatch.setattr(layout, "open_partition", open_partition)
        await worker.call(worker._reopen_after_failure)  # as after a failed write
        assert worker.store is None
        ready, details = node.healthy()
        assert not ready and "its files cannot be opened" in details["broken_partitions"][0], details
        assert "waltz_storage_failed_partitions 1" in node.metrics.render_prometheus()
        admin = await h.admin()
        assert await admin.assigned_partition_status() == {0: False}  # what `waltz cluster verify` asks
        with pytest.raises(StorageError, match=r"its files cannot be opened \(\[Errno 28\] No space left"):
            await c.max_transaction_id(1, 0)
        failing = False  # the operator freed space; the next request within the interval still waits
        with pytest.raises(StorageError, match="its files cannot be opened"):
            await c.max_transaction_id(1, 0)
        await asyncio.sleep(0.25)
        assert await c.max_transaction_id(1, 0) == 2
        await c.append(1, 0, make_records(3, 2))
        assert node.healthy()[0] is True
        assert "waltz_storage_failed_partitions 0" in node.metrics.render_prometheus()
        assert await admin.assigned_partition_status() == {0: True}
        assert list(await c.record_list(1, 0, 0, 10)) == make_records(0, 5)


async def test_a_run_of_the_same_append_failure_is_logged_once_then_at_intervals(
        tmp_path: Path, cluster_key: uuid.UUID, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A full disk fails every append until it is freed: its first failure is logged with the
    traceback, the next ones only as a count once per WRITE_FAILURE_LOG_INTERVAL, and the first
    success says the appends are written again."""
    from waltz_core.storage import node as node_module
    from waltz_core.storage import segmented

    async with _started_node(tmp_path, cluster_key, 0, journal=False) as (h, node):
        c = await h.client()
        real = segmented._pwrite_all
        full = True

        def pwrite_all(fd: int, data: Any, offset: int) -> None:
            if full and len(data) > 100:  # the records, not the small index and header writes
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, data, offset)

        monkeypatch.setattr(segmented, "_pwrite_all", pwrite_all)
        big = [make_record(t, bytes(1000)) for t in range(10)]
        with caplog.at_level(logging.WARNING, logger="waltz.storage.node"):
            for _ in range(5):
                with pytest.raises(StorageError, match="No space left on device"):
                    await c.append(1, 0, big[:1])
            monkeypatch.setattr(node_module, "WRITE_FAILURE_LOG_INTERVAL", 0.0)
            with pytest.raises(StorageError, match="No space left on device"):
                await c.append(1, 0, big[:1])
            full = False
            await c.append(1, 0, big[:1])
        lines = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records
                 if r.name == "waltz.storage.node"]
        assert lines == [
            ("ERROR", "partition 0: append of 1 records failed: OSError(28, 'No space left on device')", True),
            ("ERROR", "partition 0: appends still fail: 4 more groups since the last report: "
                      "OSError(28, 'No space left on device')", False),
            ("WARNING", "partition 0: appends are written again (they failed: OSError(28, 'No space left on "
                        "device'))", False),
        ], lines
        assert node.healthy()[0] is True
        assert list(await c.record_list(1, 0, 0, 10)) == big[:1]


async def test_the_connections_gauge_counts_the_connections_open_now(harness: NodeHarness) -> None:
    """``waltz_storage_connections`` goes down when connections close (it was set only when one
    opened, so it kept the highest count since the last open)."""
    node = harness.node
    assert node is not None

    def gauge() -> float:
        return float(next(line.split()[1] for line in node.metrics.render_prometheus().splitlines()
                          if line.startswith("waltz_storage_connections ")))

    clients = [await harness.client() for _ in range(3)]
    await eventually(lambda: gauge() == 3, 5, "three connections counted")
    for c in clients:
        await c.close()
    await eventually(lambda: gauge() == 0, 5, "closed connections no longer counted")
