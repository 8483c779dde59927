"""Appends decided in the connection reader's call (server/partition.py): while the partition's
append task waits for work, an append that needs no waiting is decided by ``offer`` itself, with
no task wake-up; anything queued ahead of it (a flush or mount barrier, a busy task) keeps the
task's order."""

from __future__ import annotations

from typing import Any

import pytest

from waltz_core.protocol import client as m
from waltz_core.protocol.wire import ReqId

from .conftest import append, settle

pytestmark = pytest.mark.timeout(30)


async def test_an_append_offered_to_an_idle_partition_is_decided_in_the_offer(mounted: Any) -> None:
    store, partition, link = mounted
    assert partition.offer(append(1, b"a"), link) is None
    assert store.appended == [b"a"], "decided in the call, no task step in between"
    assert partition.offer(append(2, b"b"), link) is None
    assert store.appended == [b"a", b"b"]
    store.commit(1)
    await settle()
    assert store.appended == [b"a", b"b"], "the task decides nothing twice"
    assert link.fed == [0, 1]


async def test_appends_behind_a_barrier_wait_for_it_in_order(mounted: Any) -> None:
    store, partition, link = mounted
    partition.offer(append(1, b"a"), link)
    assert partition.offer(m.FlushRequest(ReqId(1, 1, 0, 2)), link) is None
    await settle()  # the task is inside the flush: it waits for transaction 0 to commit
    partition.offer(append(3, b"c"), link)
    await settle()
    assert store.appended == [b"a"], "an append after the flush must wait for it"
    store.commit(0)
    await settle()
    assert store.appended == [b"a", b"c"]
    flushed = link.of(m.FlushResponse)
    assert [r.transaction_id for r in flushed] == [0]
    # The task is idle again: the next append is decided in its offer.
    partition.offer(append(4, b"d"), link)
    assert store.appended == [b"a", b"c", b"d"]


async def test_an_append_offered_in_the_step_that_queued_a_barrier_waits_for_it(mounted: Any) -> None:
    # The task has not woken for the flush yet (no step in between), so it still looks idle:
    # the append must go behind the flush all the same.
    store, partition, link = mounted
    assert partition.offer(m.FlushRequest(ReqId(1, 1, 0, 1)), link) is None
    partition.offer(append(2, b"b"), link)
    assert store.appended == [], "an append offered after a flush must not be decided ahead of it"
    await settle()
    assert store.appended == [b"b"]
    assert len(link.of(m.FlushResponse)) == 1, "the flush did not wait for the append after it"


async def test_an_append_with_locks_is_left_to_the_task(mounted: Any) -> None:
    store, partition, link = mounted
    partition.offer(append(1, b"locked", write=(7,)), link)
    assert store.appended == [], "appends with locks keep the task's batching (docs/performance.md)"
    await settle()
    assert store.appended == [b"locked"]
    partition.offer(append(2, b"free"), link)
    assert store.appended == [b"locked", b"free"]


async def test_an_append_offered_in_the_step_that_queued_one_with_locks_keeps_its_order(mounted: Any) -> None:
    store, partition, link = mounted
    partition.offer(append(1, b"locked", write=(7,)), link)
    partition.offer(append(2, b"free"), link)
    assert store.appended == [], "the append without locks must not overtake the one queued before it"
    await settle()
    assert store.appended == [b"locked", b"free"]
