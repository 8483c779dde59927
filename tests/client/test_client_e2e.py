"""The clients against a real cluster: local coordination, 3 storage nodes, servers (in-process, TCP)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from waltz_core.client import AsyncWaltzClient, WaltzClient
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
