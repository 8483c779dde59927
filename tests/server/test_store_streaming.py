"""Replica sessions that stream: a replica API with ``append_nowait`` (the storage client's) is
sent batches from callbacks, not from a task per replica session (waltz_core/server/store.py).
Every test of test_store.py also runs in this mode; these check the mode itself."""

from __future__ import annotations

import pytest

from waltz_core.server.store import ReplicatedStore, ReplicationBudget
from waltz_core.testing.fake_storage import MemoryMetadata, StreamingFakeReplica, connector

from .test_store import CONFIG, EPS, Sink, append_n, make, wait_for

pytestmark = pytest.mark.timeout(30)


async def test_clean_replicas_stream_and_a_slow_one_leaves_the_stream_to_read_from_peers() -> None:
    """With a client that has ``append_nowait`` the replica sessions stream (no task per batch);
    one that falls behind what the session buffers catches up from its peers in a task, then
    streams again."""
    replicas: dict[str, StreamingFakeReplica] = {ep: StreamingFakeReplica(ep) for ep in EPS}
    budget = ReplicationBudget(2048)
    store = ReplicatedStore(0, 0, MemoryMetadata({0: EPS}), connector(replicas), CONFIG, budget)
    sink = Sink()
    await store.open(sink)
    await append_n(store, 20)
    await store.flush()
    session = store.session
    assert session is not None
    assert sorted(r.endpoint for r in session.streamers) == EPS
    assert all(r.task is not None and r.task.done() for r in session.replicas.values())
    assert all(r.nowait_appends > 0 and r.appends == r.nowait_appends for r in replicas.values())

    slow = replicas["s3:1"]
    slow.delay = 0.05
    for i in range(30):
        await append_n(store, 10, start=100 + 10 * i)
    await store.flush()  # the quorum committed everything; the slow replica is far behind
    assert session.buffer_first > slow.log(0)[-1].transaction_id + 1, "the session no longer buffers what it needs"
    # Its outstanding append returns, what it needs next is gone: it reads from its peers.
    await wait_for(lambda: replicas["s1:1"].reads + replicas["s2:1"].reads > 0)
    slow.delay = 0.0
    await wait_for(lambda: len(slow.log(0)) == sink.committed + 1, timeout=20)
    await wait_for(lambda: sorted(r.endpoint for r in session.streamers) == EPS)
    streamed = slow.nowait_appends
    await append_n(store, 10, start=1000)
    await store.flush()
    await wait_for(lambda: len(slow.log(0)) == sink.committed + 1)
    assert slow.nowait_appends > streamed, "caught up, it streams again"
    assert slow.log(0) == replicas["s1:1"].log(0)
    assert store.sessions_started == 1, "falling behind is not a failure"
    await store.close()


async def test_a_refused_streaming_append_ends_the_session_and_loses_nothing_committed() -> None:
    replicas, _, store, sink = make(kind=StreamingFakeReplica)
    await store.open(sink)
    await append_n(store, 10)
    await store.flush()
    committed = sink.committed
    first = store.session
    assert first is not None and len(first.streamers) == 3
    down = first.replicas["s2:1"]
    replicas["s2:1"].down = True  # its next append_nowait raises; then it is unreachable
    await append_n(store, 5, start=100)
    await wait_for(lambda: store.sessions_started >= 2 and store.healthy)
    assert not down.streaming and down.task is not None and down.task.done(), "it left the stream, no task took over"
    assert first.stopped and not first.streamers
    assert sink.committed >= committed
    ids = await append_n(store, 5, start=200)
    await store.flush()
    assert sink.committed == ids[-1]
    await store.close()


async def test_partitions_sharing_a_stream_pump_send_their_batches_from_one_loop_callback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's stores share one StreamPump: the appends of one loop step to several
    partitions are sent by one callback, each partition's records in one batch per replica."""
    import asyncio

    from waltz_core.protocol.wire import ReqId, crc32
    from waltz_core.server.store import StreamPump

    pump = StreamPump()
    replicas: dict[str, StreamingFakeReplica] = {ep: StreamingFakeReplica(ep) for ep in EPS}
    metadata = MemoryMetadata({0: EPS, 1: EPS})
    stores = [ReplicatedStore(pid, 0, metadata, connector(replicas), CONFIG, stream_pump=pump) for pid in (0, 1)]
    sinks = [Sink(), Sink()]
    for store, sink in zip(stores, sinks, strict=True):
        await store.open(sink)
        await append_n(store, 1)
        await store.flush()
        assert store.session is not None and sorted(r.endpoint for r in store.session.streamers) == EPS
    before = {ep: r.nowait_appends for ep, r in replicas.items()}

    loop = asyncio.get_running_loop()
    scheduled: list[object] = []
    real_call_soon = loop.call_soon

    def call_soon(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        scheduled.append(getattr(callback, "__self__", None))
        return real_call_soon(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon", call_soon)
    for store in stores:  # one loop step: three appends to each partition
        for i in range(3):
            data = b"d%d" % i
            store.append(ReqId(1, 0, store.partition_id, 10 + i), 0, data, crc32(data))
    assert scheduled.count(pump) == 1, "one pump callback for both partitions"
    monkeypatch.undo()
    for store in stores:
        await store.flush()
    assert [sink.committed for sink in sinks] == [3, 3]
    assert all(r.nowait_appends - before[ep] == 2 for ep, r in replicas.items()), "one batch per partition"
    for store in stores:
        await store.close()


async def test_a_stream_pump_goes_on_past_a_session_whose_pump_raises(caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    from waltz_core.server.store import StreamPump

    pumped: list[int] = []

    class Session:
        def __init__(self, partition_id: int, broken: bool) -> None:
            self.partition_id, self.broken = partition_id, broken
            self.streamers: list[object] = []

        def pump(self) -> None:
            if self.broken:
                raise RuntimeError("a bug")
            pumped.append(self.partition_id)

    pump = StreamPump()
    for session in (Session(0, True), Session(1, False)):
        pump.schedule(session)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert pumped == [1]
    assert "partition 0: sending its replicas their batches failed" in caplog.text


async def test_the_stream_pump_sends_what_clients_hold_for_one_message() -> None:
    """A client that holds appends to send several partitions' in one message (the storage
    client with a protocol-4 node) offers ``send_appends``: the pump calls it once it has
    pumped every partition, so the batches leave in that loop step, not from the client's own
    loop callback a step later."""
    import asyncio

    class HoldingReplica(StreamingFakeReplica):
        def __init__(self, endpoint: str) -> None:
            super().__init__(endpoint)
            self.held: list[tuple] = []  # type: ignore[type-arg]
            self.sent_by_store = self.sent_by_fallback = 0

        def append_nowait(self, *args):  # type: ignore[no-untyped-def, override]
            if not self.held:
                asyncio.get_running_loop().call_soon(self._fallback)
            self.held.append(args)

        def send_appends(self) -> None:
            self.sent_by_store += bool(self.held)
            self._send()

        def _fallback(self) -> None:
            self.sent_by_fallback += bool(self.held)
            self._send()

        def _send(self) -> None:
            held, self.held = self.held, []
            for args in held:
                super().append_nowait(*args)

    replicas, _, store, sink = make(kind=HoldingReplica)
    await store.open(sink)
    for i in range(5):
        await append_n(store, 10, start=10 * i)
        await store.flush()
    holding = [r for r in replicas.values() if isinstance(r, HoldingReplica)]
    # The first batch leaves from the task that starts the stream: the client's own callback sends it.
    assert all(r.sent_by_store >= 4 and r.sent_by_fallback <= 1 for r in holding), [
        (r.sent_by_store, r.sent_by_fallback) for r in holding]
    assert all(r.log(0) == holding[0].log(0) and len(r.log(0)) == 50 for r in holding)
    await store.close()
