"""The store session encodes each record once and sends the same bytes to every replica."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from waltz_core.config import ServerConfig
from waltz_core.protocol.storage import APPEND_BATCH_HEADROOM
from waltz_core.protocol.wire import Record, RecordBatch, ReqId, crc32, encode_stored_record
from waltz_core.server import store as store_module
from waltz_core.server.store import ReplicatedStore
from waltz_core.testing.fake_storage import FakeReplica, MemoryMetadata, connector

pytestmark = pytest.mark.timeout(30)

EPS = ["s1:1", "s2:1", "s3:1"]
CONFIG = ServerConfig(initial_retry_interval=0.01, max_retry_interval=0.05, max_batch_size=8)


class RecordingReplica(FakeReplica):
    """A fake replica that keeps every batch it was sent."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.batches: list[RecordBatch] = []

    async def append(self, session_id: int, partition_id: int, records: Sequence[Record]) -> None:
        assert isinstance(records, RecordBatch), "the store sends record batches"
        self.batches.append(records)
        await super().append(session_id, partition_id, records)


class Sink:
    def __init__(self) -> None:
        self.committed = -1

    def on_committed(self, hwm: int) -> None:
        self.committed = hwm

    def on_session_reset(self, hwm: int) -> None:
        self.committed = hwm


async def test_each_record_is_encoded_once_and_replicas_get_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    encodes = 0
    real = store_module.encode_stored_record

    def counting(*args: object) -> bytes:
        nonlocal encodes
        encodes += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module, "encode_stored_record", counting)
    replicas = {ep: RecordingReplica(ep) for ep in EPS}
    store = ReplicatedStore(0, 0, MemoryMetadata({0: EPS}), connector(replicas), CONFIG)
    await store.open(Sink())
    expected = []
    for i in range(40):
        await store.wait_writable()
        data = f"payload {i}".encode() * (i % 4)
        q = ReqId(9, 0, 0, i)
        assert store.append(q, i, data, crc32(data)) == i
        expected.append(Record(i, q, i, data, crc32(data)))
    await store.flush()
    assert encodes == 40, "one encoding per record, whatever the number of replicas"
    stored = b"".join(encode_stored_record(r.transaction_id, r.req_id, r.header, r.data, r.checksum)
                      for r in expected)
    for replica in replicas.values():
        assert replica.log(0) == expected
        assert b"".join(bytes(b.data) for b in replica.batches) == stored
        assert all(len(b) <= CONFIG.max_batch_size for b in replica.batches)
    await store.close()


async def test_append_if_writable_appends_exactly_while_the_store_is_writable() -> None:
    """The partition's one-call path agrees with ``writable``: appends up to the window of
    appends in flight, then None (nothing assigned) until commits make room again."""
    replicas = {ep: FakeReplica(ep) for ep in EPS}
    store = ReplicatedStore(0, 0, MemoryMetadata({0: EPS}), connector(replicas), CONFIG)
    sink = Sink()
    await store.open(sink)
    data = b"x"
    taken: list[int] = []
    while len(taken) < 10_000:  # no await in between: nothing is acknowledged meanwhile
        writable = store.writable
        txn = store.append_if_writable(ReqId(9, 0, 0, len(taken)), 0, data, crc32(data))
        assert (txn is not None) == writable
        if txn is None:
            break
        taken.append(txn)
    assert taken == list(range(len(taken))) and 0 < len(taken) < 10_000
    assert store.append_if_writable(ReqId(9, 0, 0, 0), 0, data, crc32(data)) is None, "still full"
    await store.flush()
    assert sink.committed == taken[-1]
    assert store.append_if_writable(ReqId(9, 0, 0, len(taken)), 0, data, crc32(data)) == len(taken)
    await store.flush()
    await store.close()
    assert store.append_if_writable(ReqId(9, 0, 0, 0), 0, data, crc32(data)) is None, "closed"


async def test_batches_to_a_replica_stay_within_a_frame_and_carry_every_record() -> None:
    """Records appended together go in batches of at most ``max_frame_size -
    APPEND_BATCH_HEADROOM`` bytes; a record as large as a frame allows goes alone."""
    max_frame = 4096
    replicas = {ep: RecordingReplica(ep) for ep in EPS}
    store = ReplicatedStore(0, 0, MemoryMetadata({0: EPS}), connector(replicas), CONFIG, max_frame_size=max_frame)
    await store.open(Sink())
    sizes = [900, 900, 900, 900, 3800, 10, 10, 1500, 1500, 1500]  # no awaits: appended together
    for i, size in enumerate(sizes):
        data = bytes([i]) * size
        assert store.append_if_writable(ReqId(9, 0, 0, i), 0, data, crc32(data)) == i
    await store.flush()
    for replica in replicas.values():
        assert [len(r.data) for r in replica.log(0)] == sizes
        assert all(b.nbytes <= max_frame - APPEND_BATCH_HEADROOM for b in replica.batches)
        assert len(replica.batches) >= 4  # 10 records of 12 KB in 4 KB frames
    await store.close()
