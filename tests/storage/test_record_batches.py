"""Appends as record batches: validated without per-record objects, written as received, read back as stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from waltz_core.errors import OutOfOrderAppendError, ProtocolError, StorageCorruptionError
from waltz_core.protocol import storage as sm
from waltz_core.protocol.wire import STORED_RECORD_HEAD, Record, RecordBatch
from waltz_core.storage.format import HEADER_SIZE
from waltz_core.storage.node import _Item

from .conftest import NodeHarness, make_record, make_records, write_held_batches


async def _ready(h: NodeHarness, *partitions: int) -> None:
    admin = await h.admin()
    await admin.set_assignment(list(partitions or (0,)), True)


def _segments(h: NodeHarness, partition_id: int = 0) -> list[Path]:
    return sorted((h.directory / str(partition_id)).glob("*.seq"))


async def _stored_bytes(h: NodeHarness, partition_id: int = 0) -> bytes:
    """The record bytes of every segment of a partition, in order (segment headers left out)."""
    assert h.node is not None
    await write_held_batches(h.node, partition_id)
    return b"".join(p.read_bytes()[HEADER_SIZE:] for p in _segments(h, partition_id))


async def test_malformed_batches_are_refused_before_anything_is_written(harness: NodeHarness) -> None:
    await _ready(harness, 0, 1)
    c = await harness.client()
    await c.append(1, 0, make_records(0, 3))
    on_disk = await _stored_bytes(harness)
    good = RecordBatch.from_records(make_records(3, 4))
    raw = bytes(good.data)
    flipped = bytearray(raw)
    flipped[good.offsets[1] + STORED_RECORD_HEAD.size + 2] ^= 0x01  # a data byte of transaction 4
    later = RecordBatch.from_records(make_records(4, 4))
    refused = [
        (0, RecordBatch(raw[:-9], 4, 3), ProtocolError, "partition 0: record batch: record 6 claims 28 data bytes"),
        (0, RecordBatch(raw + b"\0" * 50, 4, 3), ProtocolError, "50 bytes after its 4 records"),
        (0, RecordBatch(bytes(flipped), 4, 3), ProtocolError, "record 4 fails its record checksum"),
        (0, RecordBatch.from_records(make_records(3, 2) + make_records(6, 2)), ProtocolError,
         "record 2 has transaction id 6, expected 5"),
        (0, RecordBatch(later.data, 4, 3), ProtocolError, "record 0 has transaction id 4, expected 3"),
        (0, later, OutOfOrderAppendError, "record 0 of the batch has id 4, the next id must be 3"),
        (1, good, OutOfOrderAppendError, "partition 1: .* has id 3, the next id must be 0"),
    ]
    for partition_id, batch, error, match in refused:
        with pytest.raises(error, match=match):
            await c.append(1, partition_id, batch)
        assert await c.max_transaction_id(1, 0) == 2
        assert await c.max_transaction_id(1, 1) == -1
        assert await _stored_bytes(harness) == on_disk, f"{match}: nothing may reach the disk"
    assert await _stored_bytes(harness, 1) == b""
    # The connection survived every refusal, and the good batch goes in as it is.
    await c.append(1, 0, good)
    assert await _stored_bytes(harness) == on_disk + raw
    assert await c.record_list(1, 0, 0, 10) == make_records(0, 7)


async def test_a_refused_batch_inside_a_group_commit_fails_alone(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    node = harness.node
    assert node is not None
    worker = node.workers[0]
    first = RecordBatch.from_records(make_records(0, 2))
    corrupt = bytearray(RecordBatch.from_records(make_records(2, 2)).data)
    corrupt[-1] ^= 0xFF  # the record checksum of transaction 3
    gap = RecordBatch.from_records(make_records(2, 1) + make_records(4, 1))
    second = RecordBatch.from_records(make_records(2, 3))
    requests = [sm.StorageAppendRequest(1, seq, 0, batch) for seq, batch in
                enumerate([first, RecordBatch(bytes(corrupt), 2, 2), gap, second], 1)]
    syncs = node.metrics.counter("storage_append_batches", labels={"partition": "0"})
    before = syncs.value

    def one_round() -> list[tuple[object, Any]]:
        """What the I/O thread does with these items: run them, then make what they wrote durable."""
        replies: list[tuple[object, Any]] = []
        written = worker.run([_Item(req, lambda _r: None) for req in requests], replies)
        worker.io.finish([(worker, group) for group in written], replies)
        return replies

    out = await worker.call(one_round)
    responses = {response.seq_num: response for _reply, response in out}  # successes come at the flush
    assert [type(responses[seq]).__name__ for seq in (1, 2, 3, 4)] == [
        "SuccessResponse", "FailureResponse", "FailureResponse", "SuccessResponse"]
    assert "record 3 fails its record checksum" in responses[2].message
    assert "has transaction id 4, expected 3" in responses[3].message
    assert syncs.value == before + 1, "the good batches share one fdatasync"
    assert await _stored_bytes(harness) == bytes(first.data) + bytes(second.data)
    c = await harness.client()
    assert await c.record_list(1, 0, 0, 10) == make_records(0, 5)


async def test_append_read_restart_across_segments_keeps_the_bytes(harness: NodeHarness) -> None:
    # The harness rolls segments at 4 KiB and checkpoints the index every 10 records.
    await _ready(harness, 0)
    c = await harness.client()
    sent: list[bytes] = []
    records: list[Record] = []
    for start in range(0, 140, 7):
        batch = RecordBatch.from_records(make_records(start, 7))
        await c.append(1, 0, batch)
        sent.append(bytes(batch.data))
        records.extend(batch)
    assert len(_segments(harness)) >= 3
    assert await _stored_bytes(harness) == b"".join(sent), "records are written exactly as they were sent"

    async def read_all() -> RecordBatch:
        got = await c.record_list(1, 0, 0, 1000)
        assert isinstance(got, RecordBatch)
        return got

    got = await read_all()
    assert bytes(got.data) == b"".join(sent) and got == records  # served across segments, as stored
    assert await c.record_list(1, 0, 33, 20) == records[33:53]
    assert await c.record(1, 0, 77) == records[77]
    await harness.restart()
    c = await harness.client()
    assert harness.node is not None and harness.node.repairs == []
    assert bytes((await read_all()).data) == b"".join(sent)
    more = RecordBatch.from_records(make_records(140, 5))
    await c.append(1, 0, more)
    assert await c.record_list(1, 0, 138, 10) == records[138:] + list(more)
    assert await c.max_transaction_id(1, 0) == 144


async def test_record_lists_are_bounded_by_the_frame_size_but_serve_one_record(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    c = await harness.client()
    # Max frame 1 MiB: a list response holds at most 512 KiB of records, and at least one record.
    for t, size in enumerate((300_000, 300_000, 600_000, 10, 10)):
        await c.append(1, 0, [make_record(t, bytes([t]) * size)])
    assert [r.transaction_id for r in await c.record_list(1, 0, 0, 10)] == [0]
    assert [r.transaction_id for r in await c.record_list(1, 0, 1, 10)] == [1]
    assert [r.transaction_id for r in await c.record_list(1, 0, 2, 10)] == [2]
    assert [r.transaction_id for r in await c.record_list(1, 0, 3, 10)] == [3, 4]
    assert len(await c.record_list(1, 0, 5, 10)) == 0


async def test_a_record_corrupted_on_disk_is_not_served(harness: NodeHarness) -> None:
    await _ready(harness, 0)
    c = await harness.client()
    batch = RecordBatch.from_records(make_records(0, 5))
    await c.append(1, 0, batch)
    assert harness.node is not None
    await write_held_batches(harness.node, 0)
    (segment,) = _segments(harness)
    raw = bytearray(segment.read_bytes())
    raw[HEADER_SIZE + batch.offsets[3] + STORED_RECORD_HEAD.size] ^= 0x04
    segment.write_bytes(bytes(raw))
    assert await c.record_list(1, 0, 0, 3) == make_records(0, 3)
    with pytest.raises(StorageCorruptionError, match=r"transaction 3 .* failed verification"):
        await c.record_list(1, 0, 0, 10)
