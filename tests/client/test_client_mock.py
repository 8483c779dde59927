"""The real clients against the in-memory cluster (real protocol over the memory transport)."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import attrs
import pytest

from waltz_core.client import (
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_core.errors import ChecksumError, ClientError
from waltz_core.locks.base import LockRequest
from waltz_core.locks.exact import ExactLockTable
from waltz_core.protocol import CLIENT
from waltz_core.protocol import client as m
from waltz_core.server.partition import Partition
from waltz_core.testing.conformance.coordination import eventually
from waltz_core.testing.memory_store import MemoryStore
from waltz_core.testing.mock_cluster import MockCluster
from waltz_core.testing.raw_stream import RawStream
from waltz_core.transport import MessageChannel
from waltz_core.transport.memory import MemoryTransport

pytestmark = pytest.mark.timeout(60)


def client_counter(client: object, name: str) -> int:
    """A ``waltz_client_<name>_total`` counter of a client, as it renders it."""
    text = client.metrics.render_prometheus()  # type: ignore[attr-defined]
    match = re.search(rf"^waltz_client_{name}_total (\d+)$", text, re.MULTILINE)
    assert match is not None, text
    return int(match.group(1))


def replay_lock_model(cluster: MockCluster, partition_id: int) -> int:
    """Check every committed transaction against an exact lock table rebuilt from the log."""
    table = ExactLockTable(-1)
    log = cluster.transactions(partition_id)
    for t in log:
        assert t.transaction_id == log.index(t)
        request = LockRequest(t.write_locks, t.read_locks, t.append_locks)
        assert table.check(request, t.client_high_water_mark) is None, f"conflicting transaction committed: {t}"
        table.begin(request)
        table.commit(request, t.transaction_id)
    return len(log)


async def test_concurrent_async_clients_never_commit_a_conflict(apps) -> None:
    async with MockCluster(2, seed=1) as cluster:
        cluster.set_max_delay(0.002)
        instances = [apps.AsyncCounterApp() for _ in range(3)]
        clients = [cluster.async_client(app) for app in instances]
        for c in clients:
            await c.start()
        try:
            ctxs = []

            async def produce(app, client) -> None:
                for i in range(40):
                    ctx = apps.Increment(app, f"k{i % 2}", i % 2)
                    ctxs.append(ctx)
                    await client.submit(ctx)

            await asyncio.gather(*(produce(app, c) for app, c in zip(instances, clients, strict=True)))
            for c in clients:
                await c.flush()
            for pid in (0, 1):
                n = replay_lock_model(cluster, pid)
                records = [apps.JSON.deserialize(t.data) for t in cluster.transactions(pid)]
                final = apps.check_chains(records)
                assert final == {f"k{pid}": n}  # every increment committed exactly once
                assert n == 60
                for app in instances:  # every instance applied the whole log, in order, once
                    assert app.applied[pid] == list(range(n))
            assert cluster.lock_failures > 0  # the clients really raced
            assert all(("completion", True) in c.events and "application" in c.events for c in ctxs)
            # A transaction on a lock one of its own client's appends holds is held back, not sent:
            # a lock failure the server never sees (each client has 19 behind its first per key).
            held_back = sum(client_counter(c, "lock_waits") for c in clients)
            assert held_back >= 3 * 2 * 19
            assert sum(c.events.count("lock_failure") for c in ctxs) == cluster.lock_failures + held_back
        finally:
            for c in clients:
                await c.close()


def test_sync_clients_with_faults_commit_each_transaction_exactly_once(apps) -> None:
    with MockCluster(2, seed=7) as cluster:
        cluster.set_fault_rate(0.2)
        instances = [apps.CounterApp() for _ in range(2)]
        clients = [cluster.client(app) for app in instances]
        try:
            def produce(app, client) -> None:
                for i in range(30):
                    client.submit(apps.Increment(app, f"k{i % 2}", i % 2))

            threads = [threading.Thread(target=produce, args=pair) for pair in zip(instances, clients, strict=True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for c in clients:
                c.flush(timeout=30)
                assert not c.has_pending()
            assert cluster.dropped_appends > 0
            total = 0
            for pid in (0, 1):
                n = replay_lock_model(cluster, pid)
                assert apps.check_chains([apps.JSON.deserialize(t.data) for t in cluster.transactions(pid)]) == {f"k{pid}": n}
                total += n
            assert total == 60  # no lost and no duplicated transaction despite dropped appends
            # apply callbacks ran on the consumer threads, never on the loop or the submitting threads
            assert instances[0].apply_threads and all(n.startswith("waltz-consumer") for n in instances[0].apply_threads)
        finally:
            for c in clients:
                c.close()


def test_restarted_client_resumes_from_its_high_water_mark(apps) -> None:
    with MockCluster(1) as cluster:
        first = apps.CounterApp()
        with cluster.client(first) as client:
            for _ in range(10):
                client.submit(apps.Increment(first, "k", 0))
            client.flush()
        assert first.applied[0] == list(range(10))
        # other clients keep writing while our application is down
        other = apps.CounterApp()
        with cluster.client(other) as client:
            for _ in range(7):
                client.submit(apps.Increment(other, "k", 0))
            client.flush()
        # restart from the state the first instance persisted: no gap, no duplicate
        restarted = apps.CounterApp(start_hwm=first.hwm, values=first.values)
        with cluster.client(restarted) as client:
            client.wait_mounted(5)
            client.submit(apps.Increment(restarted, "k", 0))
            client.flush()
            assert client.high_water_mark(0) == 17
        assert restarted.applied[0] == list(range(10, 18))
        assert restarted.values == {"k": 18}
        assert apps.check_chains([apps.JSON.deserialize(t.data) for t in cluster.transactions(0)]) == {"k": 18}


async def test_lock_failure_then_retry_succeeds(apps) -> None:
    async with MockCluster(1) as cluster:
        app = apps.AsyncCounterApp()
        async with cluster.async_client(app) as client:
            await client.wait_mounted(5)
            cluster.force_next_lock_fail()
            ctx = apps.Increment(app, "k", 0)
            await client.submit(ctx)
            await client.flush()
        assert ctx.events == ["lock_failure", ("completion", True), "application"]
        assert ctx.executions == 2
        assert [t.transaction_id for t in cluster.transactions(0)] == [0]


async def test_lock_failure_waits_until_the_conflicting_transaction_is_applied(apps) -> None:
    async with MockCluster(1) as cluster:
        writer_app, slow_app = apps.AsyncCounterApp(), apps.AsyncCounterApp()
        async with cluster.async_client(writer_app) as writer, cluster.async_client(slow_app) as slow:
            await slow.wait_mounted(5)
            cluster.suspend_feed()  # slow does not see the writer's commit...
            await writer.submit(apps.Increment(writer_app, "k", 0))
            await eventually(lambda: len(cluster.transactions(0)) == 1, 10, "the writer's commit")
            ctx = apps.Increment(slow_app, "k", 0)
            await slow.submit(ctx)  # ...so its stale increment fails on the lock
            await eventually(lambda: bool(ctx.events), 10, "the stale increment's outcome")
            await asyncio.sleep(0.1)  # a blind retry would show up here
            assert ctx.events == ["lock_failure"] and ctx.executions == 1  # not retried blind
            cluster.resume_feed()
            await slow.flush()
            await writer.flush()
        assert ctx.executions == 2 and ctx.events[-1] == "application"
        assert apps.check_chains([apps.JSON.deserialize(t.data) for t in cluster.transactions(0)]) == {"k": 2}


async def test_expiry_by_retry_limit_and_by_deadline(apps) -> None:
    async with MockCluster(1) as cluster:
        app = apps.AsyncCounterApp()
        async with cluster.async_client(app) as client:
            await client.wait_mounted(5)
            cluster.force_next_lock_fail()
            limited = apps.Increment(app, "k", 0, max_retries=0)
            await client.submit(limited)
            await client.flush()
            assert limited.events == ["lock_failure", "expiration"]
            cluster.set_fault_rate(1.0)  # every append is lost: retried until the deadline
            timed = apps.Increment(app, "k", 0, timeout=0.8)
            await client.submit(timed)
            await client.flush()
            assert timed.events == ["expiration"] and timed.executions >= 2
            late = apps.Increment(app, "k", 0, timeout=0.0)
            await asyncio.sleep(0.01)
            await client.submit(late)
            assert late.events == ["expiration"] and late.executions == 0
        assert cluster.transactions(0) == []


def test_back_pressure_blocks_submit_at_the_cap(apps) -> None:
    with MockCluster(1) as cluster:
        app = apps.CounterApp()
        config = cluster.client_process_config()
        with cluster.client(app, config) as client:
            client.wait_mounted(5)
            cap = config.client.max_concurrent_transactions
            assert cap == 5
            cluster.suspend_feed()  # commits happen, but the client cannot see them: appends stay in flight
            for i in range(cap):  # distinct keys: no lock failure frees a slot
                client.submit(apps.Increment(app, f"k{i}", 0))
            blocked = threading.Event()
            done = threading.Event()

            def one_more() -> None:
                blocked.set()
                client.submit(apps.Increment(app, "k-last", 0))
                done.set()

            t = threading.Thread(target=one_more)
            t.start()
            blocked.wait(5)
            assert not done.wait(0.3)  # the sixth submit waits for a slot
            assert client.has_pending()
            cluster.resume_feed()
            assert done.wait(5)
            t.join()
            client.flush()
            assert not client.has_pending()
        assert len(cluster.transactions(0)) >= cap + 1


async def test_reconnect_and_partition_move_lose_nothing(apps) -> None:
    async with MockCluster(2, seed=3) as cluster:
        app = apps.AsyncCounterApp()
        async with cluster.async_client(app) as client:
            for i in range(60):
                await client.submit(apps.Increment(app, f"k{i % 2}", i % 2))
                if i == 20:
                    cluster.disconnect_clients()
                if i == 40:
                    cluster.move_partition(1)
            await client.flush()
        for pid in (0, 1):
            n = replay_lock_model(cluster, pid)
            assert apps.check_chains([apps.JSON.deserialize(t.data) for t in cluster.transactions(pid)]) == {f"k{pid}": n}
            assert n == 30
            assert app.applied[pid] == list(range(30))
        assert cluster.partitions[1].generation == 2


async def test_failed_apply_is_redelivered_in_order(apps) -> None:
    async with MockCluster(1) as cluster:
        app = apps.AsyncCounterApp()
        app.fail_on.add((0, 3))
        async with cluster.async_client(app) as client:
            for _ in range(6):
                await client.submit(apps.Increment(app, "k", 0))
            await client.flush()
        assert app.uncaught == [(0, 3)]
        assert app.applied[0] == list(range(6))


class DataApp(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.errors: list[BaseException] = []

    def client_high_water_mark(self, partition_id: int) -> int:
        return len(self.data) - 1

    async def apply_transaction(self, txn) -> None:
        try:
            self.data.append(await txn.fetch_data())
        except ChecksumError as exc:
            self.errors.append(exc)
            self.data.append(b"")


class Put(TransactionContext):
    def __init__(self, payload: bytes, keep: bool = True) -> None:
        super().__init__()
        self.payload = payload
        self.keep = keep
        self.results: list[object] = []

    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        if self.payload == b"boom":
            raise ValueError("cannot build")
        builder.set_transaction_data(self.payload)
        return self.keep

    def on_completion(self, result: bool) -> None:
        self.results.append(result)

    def on_exception(self, exc: BaseException) -> None:
        self.results.append(type(exc).__name__)


async def test_data_checksums_execute_outcomes_and_high_water_mark() -> None:
    async with MockCluster(1) as cluster:
        app = DataApp()
        async with cluster.async_client(app) as client:
            cluster.corrupt_next_data(2)  # retried: attempts 3 of 5 succeeds
            await client.submit(Put(b"one"))
            await client.flush()
            assert app.data == [b"one"] and app.errors == []
            cluster.corrupt_next_data(5)  # every attempt corrupt: DataChecksumError
            await client.submit(Put(b"two"))
            await client.flush()
            assert len(app.errors) == 1
            dropped = Put(b"x", keep=False)
            await client.submit(dropped)
            assert dropped.results == [False]
            failing = Put(b"boom")
            with pytest.raises(ValueError):
                await client.submit(failing)
            assert failing.results == ["ValueError"]
            assert await client.high_water_mark(0) == 1
            assert not client.has_pending()
        assert [t.data for t in cluster.transactions(0)] == [b"one", b"two"]


def test_sync_client_refuses_flush_from_an_apply_callback() -> None:
    class Reentrant(WaltzClientCallbacks):
        client = None
        error: BaseException | None = None

        def client_high_water_mark(self, partition_id: int) -> int:
            return -1

        def apply_transaction(self, txn) -> None:
            try:
                self.client.flush()
            except ClientError as exc:
                self.error = exc

    with MockCluster(1) as cluster:
        app = Reentrant()
        with cluster.client(app) as client:
            app.client = client
            client.submit(Put(b"a"))
            deadline = time.monotonic() + 5
            while app.error is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert isinstance(app.error, ClientError)
            client.flush()


def test_sync_client_refuses_async_callbacks_with_a_clear_error() -> None:
    """An ``async def`` apply_transaction given to the blocking WaltzClient is reported through
    uncaught_exception as a ClientError naming the fix, and never awaited (it used to be a coroutine
    silently dropped, the transaction counted as applied)."""

    class AsyncApp(WaltzClientCallbacks):
        def __init__(self) -> None:
            self.applied: list[int] = []
            self.uncaught: list[BaseException] = []

        def client_high_water_mark(self, partition_id: int) -> int:
            return -1

        async def apply_transaction(self, txn) -> None:
            self.applied.append(txn.transaction_id)  # must never run

        def uncaught_exception(self, partition_id: int, transaction_id: int, exc: BaseException) -> None:
            self.uncaught.append(exc)

    with MockCluster(1) as cluster:
        app = AsyncApp()
        with cluster.client(app) as client:
            client.submit(Put(b"a"))
            deadline = time.monotonic() + 5
            while not app.uncaught and time.monotonic() < deadline:
                time.sleep(0.01)
        assert app.uncaught, "the error never reached uncaught_exception"
        assert isinstance(app.uncaught[0], ClientError)
        assert "use AsyncWaltzClient" in str(app.uncaught[0])
        assert app.applied == []
        assert [t.data for t in cluster.transactions(0)] == [b"a"]


async def test_a_released_slot_passes_to_the_oldest_waiter_only() -> None:
    from waltz_core.client.partition import Partition

    p = Partition(0, 1, -1)
    p.inflight = 2  # the cap is reached
    loop = asyncio.get_running_loop()
    waiters = [loop.create_future() for _ in range(3)]
    p.slot_waiters.extend(waiters)
    waiters[0].cancel()  # a waiter that gave up is skipped
    p.release_slot()
    assert [w.done() and not w.cancelled() for w in waiters] == [False, True, False]
    assert waiters[1].result() is True and p.inflight == 2  # the slot passed on, still counted
    p.release_slot()
    assert waiters[2].result() is True and p.inflight == 2
    p.release_slot()  # nobody waits: the slot is freed
    assert p.inflight == 1
    p.slot_waiters.append(last := loop.create_future())
    p.wake_slot_waiters()  # a state change: re-check, no slot
    assert last.result() is False and p.inflight == 1


async def test_a_burst_far_above_the_cap_commits_every_transaction_in_submit_order(apps) -> None:
    async with MockCluster(1) as cluster:
        app = apps.AsyncCounterApp()
        config = cluster.client_process_config()
        cap = config.client.max_concurrent_transactions
        async with cluster.async_client(app) as client:
            await client.wait_mounted(5)
            n = 100 * cap
            ctxs = [apps.Increment(app, f"k{i}", 0) for i in range(n)]  # distinct keys: no lock failures
            submits = [asyncio.create_task(client.submit(c)) for c in ctxs]
            async with asyncio.timeout(60):
                await asyncio.gather(*submits)
                await client.flush()
        assert all(c.events[-1] == "application" and c.executions == 1 for c in ctxs)
        keys = [apps.JSON.deserialize(t.data)["key"] for t in cluster.transactions(0)]
        assert keys == [f"k{i}" for i in range(n)]  # slots are handed out first come, first served


async def test_waiters_for_slots_survive_a_reconnect_and_each_transaction_commits_once(apps) -> None:
    async with MockCluster(1) as cluster:
        app = apps.AsyncCounterApp()
        cap = cluster.client_process_config().client.max_concurrent_transactions
        async with cluster.async_client(app) as client:
            await client.wait_mounted(5)
            cluster.suspend_feed()  # the first `cap` stay in flight; the rest wait for slots
            ctxs = [apps.Increment(app, f"k{i}", 0) for i in range(6 * cap)]
            submits = [asyncio.create_task(client.submit(c)) for c in ctxs]
            await asyncio.sleep(0.1)
            assert sum(t.done() for t in submits) == cap
            cluster.disconnect_clients()  # the link drops with `cap` in flight and the rest waiting
            await asyncio.sleep(0.1)
            cluster.resume_feed()
            async with asyncio.timeout(30):
                await asyncio.gather(*submits)
                await client.flush()
            assert not client.has_pending()
        assert all(c.events[-1] == "application" for c in ctxs)
        keys = sorted(apps.JSON.deserialize(t.data)["key"] for t in cluster.transactions(0))
        assert keys == sorted(f"k{i}" for i in range(6 * cap))  # every one committed, none twice


def test_a_client_closed_while_it_connects_does_not_hang(apps) -> None:
    """close() right after the client is made, while its stream connection is being opened: on 3.11
    a wait_for around the connect lost close()'s cancellation, and the stream task then waited on
    its new connection for ever (about 1 in 4 closes hung). Each close must return."""
    for _ in range(20):
        with MockCluster(1) as cluster:
            client = cluster.client(apps.CounterApp())
            closed = threading.Event()
            closer = threading.Thread(target=lambda c=client, done=closed: (c.close(), done.set()), daemon=True)
            closer.start()
            assert closed.wait(30), "WaltzClient.close() hung while the client was connecting"


# ----------------------------------------------------------------- the server's own partition
#
# Raw protocol messages against the mock, as tests/server/test_server_protocol.py sends them to a
# real server: the answers must be the server's, because the mock runs the server's Partition.


async def connect_raw(cluster: MockCluster, client_id: int) -> RawStream:
    """A raw stream connection of ``client_id`` to the mock's partition 0."""
    conn = await MemoryTransport().connect(cluster.address)
    return RawStream(await MessageChannel.open(conn, CLIENT, "test"), client_id, cluster.partitions[0].generation)


async def test_the_mock_runs_the_servers_partition_and_its_lock_rules() -> None:
    async with MockCluster(1) as cluster:
        partition = cluster.partitions[0]
        assert type(partition) is Partition and isinstance(partition.store, MemoryStore)
        assert isinstance(partition.locks, ExactLockTable)  # the mock's default table
        a = await connect_raw(cluster, 1)
        assert (await a.mount()).state is m.PartitionState.READY
        lock = 12345
        await a.append(b"w0", hwm=-1, write=(lock,))
        assert await a.flush() == 0
        # The sequence of test_lock_kinds_follow_the_original_semantics (tests/server), same answers.
        q = await a.append(b"stale-write", hwm=-1, write=(lock,))
        assert (await a.until(m.LockFailure, q)).transaction_id == 0
        q = await a.append(b"stale-read", hwm=-1, read=(lock,))
        assert (await a.until(m.LockFailure, q)).transaction_id == 0
        await a.append(b"fresh-read", hwm=0, read=(lock,))
        assert await a.flush() == 1
        await a.append(b"w2", hwm=0, write=(lock,))
        assert await a.flush() == 2
        await a.append(b"appender", hwm=-1, append=(lock,))
        assert await a.flush() == 3
        q = await a.append(b"reader", hwm=2, read=(lock,))
        assert (await a.until(m.LockFailure, q)).transaction_id == 3
        assert {f.transaction_id for f in a.feed} == {0, 1, 2, 3}
        assert cluster.lock_failures == partition.lock_failures == 3
        assert [t.data for t in cluster.transactions(0)] == [b"w0", b"fresh-read", b"w2", b"appender"]
        assert replay_lock_model(cluster, 0) == 4
        # A partition the server does not own gets the server's answers.
        q = a.q()
        await a.ch.send(m.HighWaterMarkRequest(attrs.evolve(q, partition_id=7)))
        assert (await a.until(m.HighWaterMarkResponse)).transaction_id == -2


async def test_conflicting_appends_in_flight_serialize_as_on_the_server() -> None:
    async with MockCluster(1, seed=0) as cluster:
        cluster.set_max_delay(0.6)  # seed 0: the first append stays in flight for about 0.5 s
        partition = cluster.partitions[0]
        a = await connect_raw(cluster, 1)
        await a.mount()
        # Ten appends on one lock, each computed at the head before the previous committed.
        reqs = [await a.append(f"x{i}".encode(), hwm=-1, write=(7,)) for i in range(10)]
        # The first is in flight; the others collide with it and wait for its commit aside (the
        # append task goes on with other appends), none is decided on the table without that commit.
        await eventually(lambda: partition.blocked_count == 9, 5, "the colliding appends to wait", interval=0.005)
        assert partition.queue_size == 0 and partition.pending_count == 1
        assert cluster.high_water_mark(0) == -1 and cluster.lock_failures == 0
        failure = await a.until(m.LockFailure, reqs[1])
        assert failure.transaction_id == 0 and cluster.high_water_mark(0) == 0  # decided after the commit
        assert await a.flush() == 0
        assert [f.req_id for f in a.feed] == [reqs[0]]  # the first wins; the others read stale data
        assert cluster.lock_failures == 9


async def test_a_conflict_waits_aside_and_does_not_hold_back_the_appends_behind_it() -> None:
    async with MockCluster(1, seed=0) as cluster:
        cluster.set_max_delay(0.6)  # seed 0: the first append stays in flight for about 0.5 s
        partition = cluster.partitions[0]
        a = await connect_raw(cluster, 1)
        await a.mount()
        first = await a.append(b"w7", hwm=-1, write=(7,))
        conflicting = await a.append(b"also-w7", hwm=-1, write=(7,))
        other = await a.append(b"w8", hwm=-1, write=(8,))
        plain = await a.append(b"no-locks")
        # The appends behind the conflict went to the store while the first is still in flight.
        await eventually(lambda: partition.pending_count == 3, 5, "the appends behind the conflict", interval=0.005)
        assert partition.blocked_count == 1 and cluster.lock_failures == 0
        # A flush answers only once the blocked append is decided too (here: failed, it read stale
        # data): its LockFailure comes first.
        flush = a.q()
        await a.ch.send(m.FlushRequest(flush))
        failure = await a.until(m.LockFailure)  # a FlushResponse before it is dropped: the next line times out
        assert failure.req_id == conflicting and failure.transaction_id == 0
        assert (await a.until(m.FlushResponse, flush)).transaction_id == 2 and partition.blocked_count == 0
        while len(a.feed) < 3:
            await a.until(m.FeedData)
        assert [f.req_id for f in a.feed] == [first, other, plain]


async def test_a_moved_partition_starts_a_new_lock_table_at_its_high_water_mark() -> None:
    async with MockCluster(1) as cluster:
        old = await connect_raw(cluster, 1)
        await old.mount()
        await old.append(b"w0", hwm=-1, write=(7,))
        assert await old.flush() == 0
        cluster.move_partition(0)
        await old.until(m.FeedSuspended)  # the old generation's clients are told
        assert cluster.partitions[0].generation == 2
        new = await connect_raw(cluster, 2)
        assert (await new.mount()).state is m.PartitionState.READY
        assert [f.transaction_id for f in new.feed] == [0]
        # As Partition.open does on a server: every lock's estimate starts at the high-water mark,
        # so an append built before it fails even on a lock nobody took (the old mock kept its table).
        q = await new.append(b"fresh-lock", hwm=-1, write=(99,))
        assert (await new.until(m.LockFailure, q)).transaction_id == 0
        await old.append(b"old-generation", hwm=0, generation=1)  # stale generation: ignored
        await new.append(b"fresh-lock", hwm=0, write=(99,))
        assert await new.flush() == 1
        assert [t.data for t in cluster.transactions(0)] == [b"w0", b"fresh-lock"]


async def test_a_client_closes_its_links_to_an_endpoint_it_no_longer_uses(apps, caplog) -> None:
    """Once no partition of a client is on a server endpoint, the client closes its connections
    there and forgets it: a server replaced on a new address is not dialled every
    ``reconnect_delay`` for as long as the client runs, one endpoint more at each replacement."""
    caplog.set_level(logging.INFO, logger="waltz.client.link")
    async with MockCluster(2, seed=5) as cluster:
        app = apps.AsyncCounterApp()
        async with cluster.async_client(app) as client:
            await client.submit(apps.Increment(app, "k0", 0))
            await client.flush()
            links = client._ctx.links
            assert links is not None and links.endpoints == [cluster.address]
            old = links.get(cluster.address)
            gone = "198.18.0.250:1"  # nothing listens there (memory transport): every connect fails

            def dials() -> int:
                return sum(f"stream connection to {gone} failed" in r.getMessage() for r in caplog.records)

            client._on_owners({pid: o._replace(endpoint=gone) for pid, o in client._ctx.owners.items()})
            await eventually(lambda: links.endpoints == [gone] and not old.connected, 5, "the old link retired")
            await eventually(lambda: dials() >= 2, 5, "the new endpoint dialled")
            client._on_owners(cluster._owners())  # back: a new link to the cluster, the dead one retired
            await eventually(lambda: links.endpoints == [cluster.address], 5, "the dead link retired")
            assert links.get(cluster.address) is not old
            await asyncio.sleep(0.1)
            attempts = dials()
            await asyncio.sleep(0.5)  # 10 reconnect delays of the mock's client config
            assert dials() == attempts, "the retired link still dials"
            await client.submit(apps.Increment(app, "k0", 0))
            await client.flush()
        assert app.applied[0] == [0, 1]


async def test_submits_that_give_up_waiting_for_a_slot_leave_nothing_behind(apps) -> None:
    """While a partition's in-flight slots stay taken (appends whose commits the client does not
    see), every submit that times out or is cancelled while it waits for a slot must take its
    place in the queue away: the queue used to keep one cancelled future per try, for as long as
    the partition was stuck, a leak at the rate an application retries."""
    async with MockCluster(1) as cluster:
        app = apps.AsyncCounterApp()
        config = cluster.client_process_config()
        async with cluster.async_client(app, config) as client:
            await client.wait_mounted(5)
            cap = config.client.max_concurrent_transactions
            cluster.suspend_feed()
            for i in range(cap):
                await client.submit(apps.Increment(app, f"k{i}", 0))
            p = client._ctx.partitions[0]
            for i in range(200):  # an application retrying with a timeout of its own
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(client.submit(apps.Increment(app, f"t{i}", 0)), 0.005)
            assert len(p.slot_waiters) == 0, len(p.slot_waiters)
            waiting = asyncio.create_task(client.submit(apps.Increment(app, "last", 0)))
            await eventually(lambda: len(p.slot_waiters) == 1, 5, "the submit waits for a slot")
            cluster.resume_feed()
            await asyncio.wait_for(waiting, 10)
            await client.flush()
        keys = sorted(apps.JSON.deserialize(t.data)["key"] for t in cluster.transactions(0))
        assert keys == sorted([f"k{i}" for i in range(cap)] + ["last"])
