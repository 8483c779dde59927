"""The async client's applier: every partition from one task, and the partitions that must wait
(application code that awaits, an apply that failed) apart, so that they hold up no other."""

from __future__ import annotations

import asyncio

import pytest

from waltz_core.inbox import Inbox
from waltz_core.testing.conformance.coordination import eventually
from waltz_core.testing.mock_cluster import MockCluster

pytestmark = pytest.mark.timeout(60)


def apply_tasks() -> list[str]:
    return sorted(t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("waltz-client-") and "apply" in t.get_name())


async def test_an_armed_inbox_calls_back_once_per_arming() -> None:
    calls: list[int] = []
    inbox: Inbox[int] = Inbox(4)
    inbox.put(0)  # not armed: nothing is called
    inbox.arm(lambda: calls.append(len(inbox)))
    inbox.put(1)
    inbox.put(2)  # called once, at the first put after arming
    assert calls == [2]
    inbox.arm(lambda: calls.append(-1))
    inbox.nudge()
    assert calls == [2, -1]
    inbox.put(3)  # not armed again
    assert calls == [2, -1] and inbox.take(10) == [0, 1, 2, 3]


async def test_partitions_apply_from_one_task_and_an_awaiting_one_holds_up_no_other(apps) -> None:
    release = asyncio.Event()

    class App(apps.CounterApp):
        def apply_transaction(self, txn):  # a plain function; partition 0 returns an awaitable
            if txn.partition_id != 0:
                return self._apply_id(txn)

            async def later() -> None:
                await release.wait()
                self._apply(txn, await txn.fetch_data(apps.JSON))

            return later()

    async with MockCluster(3) as cluster:
        app = App()
        async with cluster.async_client(app) as client:
            assert apply_tasks() == [f"waltz-client-{client.client_id}-apply"]
            for _ in range(5):
                for pid in range(3):
                    await client.submit(apps.Increment(app, f"k{pid}", pid))
            # Partitions 1 and 2 apply everything while partition 0 waits in its own task.
            await eventually(lambda: app.applied.get(1) == list(range(5)) and app.applied.get(2) == list(range(5)),
                             10, "partitions 1 and 2 applied while partition 0 waits")
            assert 0 not in app.applied
            assert apply_tasks() == sorted([f"waltz-client-{client.client_id}-apply", "waltz-client-apply-p0"])
            release.set()
            await client.flush()
            assert app.applied == {pid: list(range(5)) for pid in range(3)}
            # Back on the shared task once its batches are done.
            await eventually(lambda: apply_tasks() == [f"waltz-client-{client.client_id}-apply"], 10,
                             "partition 0 back on the shared task")
            for _ in range(3):
                await client.submit(apps.Increment(app, "k0", 0))
            await client.flush()
            assert app.applied[0] == list(range(8))
        assert apps.check_chains(app.records[0]) == {"k0": 8}


async def test_a_failed_apply_recovers_apart_while_the_other_partitions_go_on(apps) -> None:
    class App(apps.CounterApp):
        def apply_transaction(self, txn) -> None:  # a plain function (no data: it would block the loop)
            self._apply_id(txn)

    async with MockCluster(2) as cluster:
        app = App()
        app.fail_on.add((1, 2))
        async with cluster.async_client(app) as client:
            for _ in range(6):
                for pid in range(2):
                    await client.submit(apps.Increment(app, f"k{pid}", pid))
            await client.flush()
            assert app.uncaught == [(1, 2)]
            # Redelivered from the client high-water mark, in order, without gaps or repeats.
            assert app.applied == {0: list(range(6)), 1: list(range(6))}
            for pid in range(2):
                await client.submit(apps.Increment(app, f"k{pid}", pid))
            await client.flush()
            assert app.applied == {0: list(range(7)), 1: list(range(7))}
