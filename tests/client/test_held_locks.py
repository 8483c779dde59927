"""A transaction on a lock that one of its own client's appends will advance is held back in the
client, not sent to fail at the server (waltz_core/client/partition.py, ``HeldLocks``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from waltz_core.client import (
    AsyncWaltzClient,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_core.client.partition import HeldLocks
from waltz_core.testing.cluster import ClusterSpec, InProcessCluster
from waltz_core.testing.conformance.coordination import eventually
from waltz_core.testing.mock_cluster import MockCluster

from .conftest import AsyncCounterApp, Increment
from .test_client_e2e import RawAppend
from .test_client_mock import client_counter, replay_lock_model

pytestmark = pytest.mark.timeout(60)


class Ctx(TransactionContext):
    def partition_id(self, n: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        return True


def test_a_freed_lock_goes_to_the_oldest_transaction_waiting_for_it_and_stays_reserved() -> None:
    held = HeldLocks()
    first, second, third = Ctx(), Ctx(), Ctx()
    held.hold((1, 2))  # an own append writes locks 1 and 2
    held.hold((2,))  # another one lock 2
    assert held.conflict((3,), (1,)) == 1  # read locks count: the server checks them too
    assert held.conflict((5,), (6,)) is None
    held.wait(2, first, 1)
    held.wait(2, second, 1)
    held.wait(1, third, 1)
    assert len(held) == 3
    assert held.release((1, 2)) == [(third, 1, 1)]  # lock 2 still has a holder
    assert held.release((2,)) == [(first, 1, 2)]  # one at a time: the second would be held back again
    assert held.conflict((2,), ()) == 2  # reserved to the first: the others still wait
    assert held.conflict((2,), (), has_reservation=True) is None  # a transaction with one waits for appends only
    held.hold((2,))  # the first's new append takes it ...
    assert held.end_reservation(2) == []  # ... and its reservation ends: the lock stays held
    assert held.conflict((2,), (), has_reservation=True) == 2
    assert held.release((2,)) == [(second, 1, 2)]  # its append applied: the second's turn
    assert held.end_reservation(2) == [] and held.end_reservation(1) == []  # they took no append
    assert not held.locks and not held.reserved and len(held) == 0 and not held


def test_transactions_reserved_each_others_locks_do_not_hand_them_on_for_ever() -> None:
    # x needs a and b, y needs b and a; a is reserved to x, b to y. Each one waits only for
    # appends, so the first to execute takes both (before, each held back on the other's
    # reservation and passed its own on, again and again).
    held = HeldLocks()
    x, y, z = Ctx(), Ctx(), Ctx()
    held.hold((1, 2))
    held.wait(1, x, 1)
    held.wait(2, y, 1)
    held.wait(1, z, 1)
    assert held.release((1, 2)) == [(x, 1, 1), (y, 1, 2)]
    assert held.conflict((1, 2), (), has_reservation=True) is None  # x goes
    held.hold((1, 2))
    assert held.end_reservation(1) == []  # x's append holds a: z keeps waiting
    assert held.conflict((2, 1), (), has_reservation=True) == 2  # y waits for x's append
    held.wait(2, y, 2)
    assert held.end_reservation(2) == []
    assert held.release((1, 2)) == [(z, 1, 1), (y, 2, 2)]


def test_locks_of_committed_appends_are_released_once_applied_and_a_lock_failed_holder_goes_first() -> None:
    held = HeldLocks()
    waiter, holder = Ctx(), Ctx()
    held.hold((7,))
    held.wait(7, waiter, 1)
    held.committed(12, (7,))  # the holder committed as transaction 12
    assert held.applying and held.release_applied(11) == []
    assert held.release_applied(12) == [(waiter, 1, 7)] and not held.applying
    assert held.end_reservation(7) == [] and not held.locks and not held.reserved
    # A holder whose append failed its lock check (conflict 20) keeps the lock until 20 is
    # applied, then gets it before what it held back: it is the older one.
    held.hold((7,))
    held.wait(7, waiter, 2)
    held.held_until(20, (7,))
    held.wait_first(7, holder, 1)
    assert held.release_applied(19) == []
    assert held.release_applied(20) == [(holder, 1, 7)]
    assert held.drain() == [waiter] and not held.locks and not held.reserved and not held.applying


async def test_one_clients_transactions_on_one_lock_go_one_at_a_time_without_a_lock_failure(apps) -> None:
    async with MockCluster(1, seed=3) as cluster:
        cluster.set_max_delay(0.002)
        app = apps.AsyncCounterApp()
        client = cluster.async_client(app)
        await client.start()
        try:
            ctxs = [apps.Increment(app, "hot", 0) for _ in range(20)]
            for ctx in ctxs:
                await client.submit(ctx)  # all 20 in flight at once
            await client.flush()
            await eventually(lambda: all("application" in c.events for c in ctxs), 20, "all applied")
            assert replay_lock_model(cluster, 0) == 20
            assert app.values == {"hot": 20}  # no update lost
            # Before, 19 went to the server, failed there behind the first, and went again.
            assert cluster.lock_failures == 0
            assert sorted(c.executions for c in ctxs) == [1] + [2] * 19  # each held back once
            assert client_counter(client, "lock_waits") == 19
            assert sum(c.events.count("lock_failure") for c in ctxs) == 19  # still told: a retry follows
        finally:
            await client.close()


class Log(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.applied: list[int] = []

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, txn) -> None:
        self.applied.append(txn.transaction_id)


class Locked(RawAppend):
    """RawAppend with its executions counted."""

    def __init__(self, locks: int, lock_name: str = "k") -> None:
        super().__init__(1, locks, lock_name)
        self.executions = 0

    def execute(self, builder: TransactionBuilder) -> bool:
        self.executions += 1
        return super().execute(builder)


async def test_a_held_back_transaction_goes_when_the_append_holding_its_lock_is_refused(tmp_path) -> None:
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, server_overrides={"max_locks_per_transaction": 2})
    async with InProcessCluster(spec), AsyncWaltzClient(Log(), spec.client_config()) as client:
        refused = Locked(3)  # over the server's max_locks_per_transaction
        waiter = Locked(1)
        await client.submit(refused)
        await client.submit(waiter)  # held back: the refused one holds "k0" until decided
        await client.flush()
        await eventually(lambda: refused.events and waiter.events, 20, "both decided")
        assert [type(e).__name__ for e in refused.events] == ["TooManyLocksError"]
        assert waiter.events == [("completion", True)] and waiter.executions == 2
        assert client_counter(client, "lock_waits") == 1


async def test_closing_the_client_ends_held_back_transactions_with_client_closed() -> None:
    async with MockCluster(1, seed=5) as cluster:
        app = AsyncCounterApp()
        client = cluster.async_client(app)
        await client.start()
        await client.wait_mounted(10)
        cluster.suspend_feed()  # the client sees no commit: the first append keeps its lock
        await asyncio.sleep(0.05)
        holder, waiter = Increment(app, "k", 0), Increment(app, "k", 0)
        await client.submit(holder)
        await client.submit(waiter)
        await eventually(lambda: "lock_failure" in waiter.events, 10, "the second is held back")
        await client.close()
        await asyncio.sleep(0)
        assert ("exception", "ClientClosedError") in waiter.events
        assert ("exception", "ClientClosedError") in holder.events  # its outcome is unknown too


class Chained(Locked):
    """Writes one lock; once applied, submits the next of ``left`` on the same lock (an
    application that goes on from ``on_application``, on the sync client's consumer thread)."""

    def __init__(self, client: object, left: int, done: list[int]) -> None:
        super().__init__(1, "chain")
        self.client, self.left, self.done = client, left, done

    def on_application(self) -> None:
        self.done.append(self.executions)
        if self.left:
            self.client.submit(Chained(self.client, self.left - 1, self.done))  # type: ignore[attr-defined]


def test_a_transaction_submitted_once_its_predecessor_on_the_lock_was_applied_is_not_held_back() -> None:
    with MockCluster(1, seed=9) as cluster, cluster.client(Log()) as client:
        client.wait_mounted(10)
        done: list[int] = []
        client.submit(Chained(client, 30, done))
        deadline = time.monotonic() + 20
        while len(done) < 31 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == [1] * 31  # each executed once: its predecessor was applied when it was built
        assert client_counter(client, "lock_waits") == 0
