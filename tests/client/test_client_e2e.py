"""The clients against a real cluster: local coordination, 3 storage nodes, servers (in-process, TCP)."""

from __future__ import annotations

import asyncio
import threading

import attrs
import pytest

from waltz_core.client import (
    AsyncWaltzClient,
    PartitionLocalLock,
    TransactionContext,
    WaltzClient,
    WaltzClientCallbacks,
)
from waltz_core.errors import TooManyLocksError, TransactionTooLargeError
from waltz_core.protocol.client import APPEND_LOCK_SIZE, TRANSACTION_FRAME_HEADROOM
from waltz_core.testing.cluster import ClusterSpec, InProcessCluster
from waltz_core.testing.conformance.coordination import eventually

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def cluster(tmp_path):
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=2, num_storages=3, num_servers=2)
    async with InProcessCluster(spec) as running:
        yield running


async def test_concurrent_clients_with_conflicting_locks_never_commit_a_conflict(cluster, apps) -> None:
    config = cluster.spec.client_config(long_wait_threshold=1.0)
    instances = [apps.AsyncCounterApp() for _ in range(3)]
    clients = [AsyncWaltzClient(app, config) for app in instances]
    for c in clients:
        await c.start()
    try:
        assert len({c.client_id for c in clients}) == 3

        async def produce(app, client) -> None:
            for i in range(30):
                await client.submit(apps.Increment(app, f"k{i % 2}", i % 2))

        await asyncio.gather(*(produce(app, c) for app, c in zip(instances, clients, strict=True)))
        for c in clients:
            await c.flush()
        for pid in (0, 1):
            hwm = await clients[0].high_water_mark(pid)
            assert hwm == 44  # 45 increments per partition, each committed once
            for app in instances:
                assert app.applied[pid] == list(range(hwm + 1))  # in order, no gap, no duplicate
                # replay the log: every committed increment read the previous committed value
                assert apps.check_chains(app.records[pid]) == {f"k{pid}": hwm + 1}
    finally:
        for c in clients:
            await c.close()


async def test_client_closed_and_restarted_resumes_without_gap_or_duplicate(cluster, apps) -> None:
    config = cluster.spec.client_config()
    first = apps.AsyncCounterApp()
    async with AsyncWaltzClient(first, config) as client:
        for i in range(12):
            await client.submit(apps.Increment(first, "k", i % 2))
        await client.flush()
    writer = apps.AsyncCounterApp()
    async with AsyncWaltzClient(writer, config) as client:
        for i in range(8):
            await client.submit(apps.Increment(writer, "k", i % 2))
        await client.flush()
    restarted = apps.AsyncCounterApp(start_hwm=first.hwm, values=first.values)
    async with AsyncWaltzClient(restarted, config) as client:
        await client.wait_mounted(10)
        await client.flush()
    assert restarted.applied == {0: [6, 7, 8, 9], 1: [6, 7, 8, 9]}
    for pid in (0, 1):
        assert first.applied[pid] + restarted.applied[pid] == writer.applied[pid] == list(range(10))



async def test_server_restart_under_load_loses_no_acknowledged_transaction(cluster, apps) -> None:
    """A blocking client on its own loop thread keeps writing while a server stops and restarts."""
    config = cluster.spec.client_config(long_wait_threshold=0.5, reconnect_delay=0.1)
    app = apps.CounterApp()
    done = threading.Event()
    errors: list[BaseException] = []
    ctxs: list = []
    server_stopped = threading.Event()

    def produce(client: WaltzClient) -> None:
        try:
            for i in range(40):
                if i == 10:  # the other 30 are submitted while the server is down or restarting
                    server_stopped.wait(30)
                ctxs.append(apps.Increment(app, f"k{i % 2}", i % 2))
                client.submit(ctxs[-1])
            client.flush(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            done.set()

    client = await asyncio.to_thread(WaltzClient, app, config)
    try:
        producer = threading.Thread(target=produce, args=(client,))
        producer.start()
        await eventually(lambda: len(ctxs) >= 10, 30, "the producer's first 10 submissions")
        await cluster.stop_server(0)  # its partitions move to the other server
        server_stopped.set()
        await asyncio.sleep(0.5)
        await cluster.start_server(0)
        while not done.is_set():
            await asyncio.sleep(0.05)
        producer.join()
        assert errors == []
        for pid in (0, 1):
            assert apps.check_chains(app.records[pid]) == {f"k{pid}": 20}
            assert app.applied[pid] == list(range(20))
        assert all(c.events[-2:] == [("completion", True), "application"] for c in ctxs)
    finally:
        await asyncio.to_thread(client.close)


async def test_a_slow_application_holds_the_feed_back_without_losing_or_reordering(cluster, apps, monkeypatch) -> None:
    """The per-partition feed queue is bounded: while apply_transaction is stuck, the stream reader
    stops at the bound (back pressure to the server); once it resumes every record arrives, in order."""
    from waltz_core.client import partition

    monkeypatch.setattr(partition, "FEED_QUEUE", 8)
    config = cluster.spec.client_config()
    writer = apps.AsyncCounterApp()
    async with AsyncWaltzClient(writer, config) as client:
        for i in range(60):
            await client.submit(apps.Increment(writer, f"k{i % 2}", 0))
        await client.flush()

    gate = asyncio.Event()
    seen: list[int] = []
    longest = 0

    class Stuck(apps.CounterApp):
        async def apply_transaction(self, txn) -> None:
            nonlocal longest
            await gate.wait()
            longest = max(longest, len(reader._partitions[txn.partition_id].feed))
            seen.append(txn.transaction_id) if txn.partition_id == 0 else None

    reader = AsyncWaltzClient(Stuck(), config)
    async with reader:
        feed = reader._partitions[0].feed
        for _ in range(200):  # the feed of 60 arrives; the reader must stop at the bound
            if len(feed) >= partition.FEED_QUEUE:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # time for an unbounded reader to go past the bound
        queued = len(feed)
        assert 1 <= queued <= partition.FEED_QUEUE
        gate.set()
        for _ in range(200):  # flush() covers only what was received; the rest is still arriving
            if len(seen) == 60:
                break
            await asyncio.sleep(0.05)
    assert seen == list(range(60))
    assert longest <= partition.FEED_QUEUE


class RawAppend(TransactionContext):
    """``size`` bytes of data on partition 0, with ``locks`` write locks."""

    def __init__(self, size: int, locks: int = 0, lock_name: str = "k") -> None:
        super().__init__()
        self.data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        self.locks = [PartitionLocalLock(f"{lock_name}{i}", 0) for i in range(locks)]
        self.events: list[object] = []

    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder) -> bool:
        builder.set_transaction_data(self.data)
        builder.set_write_locks(self.locks)
        return True

    def on_completion(self, result: bool) -> None:
        self.events.append(("completion", result))

    def on_exception(self, exc: BaseException) -> None:
        self.events.append(exc)


class DataApp(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}

    def client_high_water_mark(self, partition_id: int) -> int:
        return max(self.data, default=-1) if partition_id == 0 else -1

    async def apply_transaction(self, txn) -> None:
        self.data[txn.transaction_id] = await txn.fetch_data()


async def test_the_largest_transaction_commits_and_one_byte_more_is_refused_at_submit(tmp_path) -> None:
    """One append over the frame limit used to stop the client's writer (every later append on the
    link was dropped, silently); one just under it, within the storage append's overhead, was
    refused by every replica link at every recovery (the partition never committed again)."""
    max_frame = 8192
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, max_frame_size=max_frame)
    async with InProcessCluster(spec):
        app = DataApp()
        async with AsyncWaltzClient(app, spec.client_config()) as client:
            largest = max_frame - TRANSACTION_FRAME_HEADROOM
            fits = RawAppend(largest)
            await client.submit(fits)
            too_large = RawAppend(largest - 3 * APPEND_LOCK_SIZE + 1, locks=3)  # its locks count too
            with pytest.raises(TransactionTooLargeError, match=f"may carry {largest}"):
                await client.submit(too_large)
            assert len(too_large.events) == 1 and isinstance(too_large.events[0], TransactionTooLargeError)
            after = RawAppend(100, locks=3)
            await client.submit(after)
            await client.flush()
            await eventually(lambda: len(app.data) == 2, 20, "both transactions applied")
            assert fits.events == after.events == [("completion", True)]
            assert app.data == {0: fits.data, 1: after.data}  # read back whole through the data range


async def test_the_blocking_client_raises_too_large_from_submit_on_the_submitting_thread(tmp_path) -> None:
    """WaltzClient.submit returns once execute said yes: the size is checked before, on that thread."""
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, max_frame_size=4096)

    class App(WaltzClientCallbacks):
        def __init__(self) -> None:
            self.applied: list[int] = []

        def client_high_water_mark(self, partition_id: int) -> int:
            return self.applied[-1] if self.applied else -1

        def apply_transaction(self, txn) -> None:
            self.applied.append(txn.transaction_id)

    class Recorded(RawAppend):
        def on_exception(self, exc: BaseException) -> None:
            self.events.append((threading.current_thread().name, type(exc).__name__))

    def run(config) -> tuple[Recorded, Recorded, list[int], str]:
        app = App()
        with WaltzClient(app, config) as client:
            too_large, fits = Recorded(4096 - TRANSACTION_FRAME_HEADROOM + 1), Recorded(10)
            with pytest.raises(TransactionTooLargeError):
                client.submit(too_large)
            client.submit(fits)
            client.flush(timeout=20)
            return too_large, fits, app.applied, threading.current_thread().name

    async with InProcessCluster(spec):
        too_large, fits, applied, thread = await asyncio.to_thread(run, spec.client_config())
    assert too_large.events == [(thread, "TransactionTooLargeError")]  # on_exception where submit was called
    assert fits.events == [("completion", True)] and applied == [0]


async def test_appends_the_server_refuses_end_with_the_error_and_are_not_retried(tmp_path, caplog) -> None:
    """A client configured with larger frames than the servers passes its own size check. Before,
    a frame over the server's limit closed the stream connection, again at every retry, and one
    under it but too large for a record was dropped and retried for ever; nobody was told. Now
    the client learns the server's limits when it connects and ends both with
    TransactionTooLargeError (the server refuses such an append too, for other clients:
    tests/server/test_server_protocol.py); a transaction with more locks than the server takes
    ends with TooManyLocksError, the server's refusal. None is retried."""
    max_frame = 8192
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, max_frame_size=max_frame,
                       server_overrides={"max_locks_per_transaction": 2})
    async with InProcessCluster(spec):
        app = DataApp()
        config = spec.client_config()
        config = attrs.evolve(config, transport=attrs.evolve(config.transport, max_frame_size=4 * max_frame))
        async with AsyncWaltzClient(app, config) as client:
            over_frame = RawAppend(max_frame)  # its frame is over the server's limit
            over_record = RawAppend(max_frame - 60)  # fits the server's frames, not its records
            too_many_locks = RawAppend(10, locks=3)
            # other locks than too_many_locks': an append in flight that writes a lock holds back the
            # client's next transaction on it until decided (tests/client/test_held_locks.py)
            fits = RawAppend(100, locks=2, lock_name="f")
            with caplog.at_level("WARNING"):
                for context in (over_frame, over_record, too_many_locks, fits):
                    await client.submit(context)
                await client.flush()
                await eventually(lambda: over_frame.events and over_record.events and too_many_locks.events and app.data,
                                 20, "all decided")
            largest = max_frame - TRANSACTION_FRAME_HEADROOM
            assert [type(e) for e in over_frame.events] == [TransactionTooLargeError]
            assert f"carries {max_frame} bytes of data and locks; the server" in str(over_frame.events[0])
            assert f"takes {largest}" in str(over_frame.events[0])
            assert [type(e) for e in over_record.events] == [TransactionTooLargeError]
            assert f"carries {max_frame - 60} bytes of data and locks" in str(over_record.events[0])
            assert [type(e) for e in too_many_locks.events] == [TooManyLocksError]
            assert "3 locks, over the server's max_locks_per_transaction = 2" in str(too_many_locks.events[0])
            assert fits.events == [("completion", True)] and app.data == {0: fits.data}
            assert "waltz_client_retries_total 0" in client.metrics.render_prometheus()
            assert not [r for r in caplog.records if "closing connection" in r.getMessage()]  # the link never broke
            logged = [r.getMessage() for r in caplog.records if "such transactions so far" in r.getMessage()]
            assert len(logged) == 2 and "(2 such transactions so far)" in logged[1]  # the 1st and 2nd of 3


async def test_a_client_is_told_its_servers_storage_nodes_smaller_frame_limit(tmp_path) -> None:
    """Storage nodes with smaller frames than their server and its clients: the server tells a
    client the smallest limit of the nodes it is connected to, and the client ends a transaction
    over it before sending it (the server would refuse it: tests/server/test_server_protocol.py)."""
    node_frame = 8192
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, max_frame_size=4 * node_frame,
                       storage_max_frame_size=node_frame)
    async with InProcessCluster(spec) as cluster:
        app = DataApp()
        async with AsyncWaltzClient(app, spec.client_config()) as client:
            largest = node_frame - TRANSACTION_FRAME_HEADROOM
            over = RawAppend(largest + 1)
            fits = RawAppend(largest)
            await client.submit(over)  # its own limit is 32 KiB: submit takes it
            await client.submit(fits)
            await client.flush()
            await eventually(lambda: over.events and app.data, 20, "both decided")
            assert [type(e) for e in over.events] == [TransactionTooLargeError]
            assert f"takes {largest}" in str(over.events[0])
            assert fits.events == [("completion", True)] and app.data == {0: fits.data}
        assert cluster.servers[0].partitions[0].refused == 0  # never sent


async def test_large_transactions_in_flight_together_all_commit(tmp_path) -> None:
    """Records streamed to a replica together made one append: twenty transactions of 7,000
    bytes in flight with 8 KiB frames made frames of 35 KB, which the replica links refused;
    every replica left the session, the next session sent the same batch, and the partition
    never committed again (1,587 sessions in 20 s). Batches now stay within a frame."""
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, max_frame_size=8192)
    async with InProcessCluster(spec) as cluster:
        app = DataApp()
        async with AsyncWaltzClient(app, spec.client_config()) as client:
            contexts = [RawAppend(7000) for _ in range(20)]
            for context in contexts:
                await client.submit(context)
            await client.flush()
            await eventually(lambda: len(app.data) == 20, 20, "every transaction applied")
            assert all(c.events == [("completion", True)] for c in contexts)
            assert sorted(app.data) == list(range(20)) and all(d == contexts[0].data for d in app.data.values())
        assert cluster.servers[0].partitions[0].store.sessions_started == 1
