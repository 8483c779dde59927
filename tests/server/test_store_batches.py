"""The store session encodes each record once and sends the same bytes to every replica."""

from __future__ import annotations

import asyncio
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
    await _append_together_and_check(store, replicas, [900, 900, 900, 900, 3800, 10, 10, 1500, 1500, 1500],
                                     max_frame - APPEND_BATCH_HEADROOM)
    assert all(len(replica.batches) >= 4 for replica in replicas.values())  # 10 records of 12 KB in 4 KB frames
    await store.close()


async def _append_together_and_check(store: ReplicatedStore, replicas: dict[str, RecordingReplica],
                                     sizes: list[int], max_batch_bytes: int) -> None:
    """Append records of ``sizes`` with no await in between (in flight together), then check that
    every replica holds them all and got no batch over ``max_batch_bytes``."""
    for i, size in enumerate(sizes):
        data = bytes([i]) * size
        assert store.append_if_writable(ReqId(9, 0, 0, i), 0, data, crc32(data)) == i
    await store.flush()
    for replica in replicas.values():
        assert [len(r.data) for r in replica.log(0)] == sizes
        assert all(b.nbytes <= max_batch_bytes for b in replica.batches)


class FrameLimitSink(Sink):
    def __init__(self) -> None:
        super().__init__()
        self.frame_limits: list[int] = []

    def on_frame_limit(self, max_frame_size: int) -> None:
        self.frame_limits.append(max_frame_size)


async def test_a_replica_with_a_smaller_frame_limit_bounds_the_sessions_batches() -> None:
    """A replica whose node takes smaller frames than the server (storage protocol 5 tells the
    client, ``max_frame_size``) bounds every batch of the session, not only its own: the
    replicas share the batches. The partition hears the limit once."""
    replicas = {ep: RecordingReplica(ep) for ep in EPS}
    replicas[EPS[1]].max_frame_size = 2048  # type: ignore[attr-defined]
    store = ReplicatedStore(0, 0, MemoryMetadata({0: EPS}), connector(replicas), CONFIG, max_frame_size=8192)
    sink = FrameLimitSink()
    await store.open(sink)
    assert sink.frame_limits == [2048] and store.frame_limit == 2048
    await _append_together_and_check(store, replicas, [700, 700, 700, 700, 1900, 10, 10], 2048 - APPEND_BATCH_HEADROOM)
    await store.close()


async def test_replicas_that_take_the_servers_frames_change_nothing() -> None:
    replicas = {ep: RecordingReplica(ep) for ep in EPS}
    for replica in replicas.values():
        replica.max_frame_size = 1 << 20  # type: ignore[attr-defined]  # larger than the server's
    store = ReplicatedStore(0, 0, MemoryMetadata({0: EPS}), connector(replicas), CONFIG, max_frame_size=8192)
    sink = FrameLimitSink()
    await store.open(sink)
    assert sink.frame_limits == [] and store.frame_limit == 8192
    assert store.session is not None and store.session.max_batch_bytes == 8192 - APPEND_BATCH_HEADROOM
    await store.close()


async def test_a_replica_with_smaller_frames_catches_up_from_a_peer_within_its_frames() -> None:
    """A peer's record list is bounded by the peer's frame limit, not the replica's: the batch a
    lagging replica is sent from it is cut to the session's bound (before, the node refused
    the frame and the replica never caught up)."""
    replicas = {ep: RecordingReplica(ep) for ep in EPS}
    small = replicas[EPS[2]]
    small.max_frame_size = 4096  # type: ignore[attr-defined]
    small.down = True
    config = ServerConfig(initial_retry_interval=0.01, max_retry_interval=0.05, max_batch_size=100)
    store = ReplicatedStore(0, 0, MemoryMetadata({0: EPS}), connector(replicas), config, max_frame_size=1 << 20)
    sink = FrameLimitSink()
    await store.open(sink)
    for i in range(20):
        data = bytes([i]) * 1000
        await store.wait_writable()
        store.append(ReqId(9, 0, 0, i), 0, data, crc32(data))
    await store.flush()
    assert sink.frame_limits == [] and max(b.nbytes for b in replicas[EPS[0]].batches) > 4096
    small.down = False  # back: a new session takes it in, and it catches up from its peers
    deadline = asyncio.get_running_loop().time() + 10
    while len(small.log(0)) < 20:
        assert asyncio.get_running_loop().time() < deadline, f"caught up to {len(small.log(0))} of 20"
        await asyncio.sleep(0.01)
    assert small.log(0) == replicas[EPS[0]].log(0)
    assert sink.frame_limits == [4096]
    assert small.batches and all(b.nbytes <= 4096 - APPEND_BATCH_HEADROOM for b in small.batches)
    await store.close()
