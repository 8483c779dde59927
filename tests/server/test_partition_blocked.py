"""Appends whose locks collide with an append in flight wait aside (server/partition.py): they are
decided after that append's fate is known, the appends behind them go on, and a flush answers only
once they are decided. Driven here by a store whose commits and session resets the test scripts."""

from __future__ import annotations

from typing import Any

import pytest

from waltz_core.protocol import client as m
from waltz_core.protocol.wire import ReqId

from .conftest import append, settle

pytestmark = pytest.mark.timeout(30)


async def test_a_blocked_append_is_decided_again_after_a_session_reset(mounted: Any) -> None:
    store, partition, link = mounted
    await partition.submit(append(1, b"first", write=(7,)), link)
    await partition.submit(append(2, b"second", write=(7,)), link)
    await partition.submit(append(3, b"other", write=(8,)), link)
    await settle()
    assert store.appended == [b"first", b"other"] and partition.blocked_count == 1
    # The session ends before anything commits: the colliding append never committed, so the
    # blocked one is not a lock failure; it goes to the new session.
    store.reset(-1)
    await settle()
    assert store.appended == [b"second"] and partition.blocked_count == 0
    assert link.of(m.LockFailure) == []
    store.commit(0)
    await partition.submit(m.FlushRequest(ReqId(1, 1, 0, 4)), link)
    await settle()
    assert [r.transaction_id for r in link.of(m.FlushResponse)] == [0]


async def test_a_flush_waits_for_the_blocked_appends_before_it(mounted: Any) -> None:
    store, partition, link = mounted
    await partition.submit(append(1, b"first", write=(7,)), link)
    await partition.submit(append(2, b"second", write=(7,)), link)
    await partition.submit(m.FlushRequest(ReqId(1, 1, 0, 3)), link)
    await partition.submit(append(4, b"after-the-flush", write=(9,)), link)
    await settle()
    assert link.of(m.FlushResponse) == [] and partition.blocked_count == 1
    store.commit(0)  # the first commits; the blocked one read stale data and fails
    await settle()
    failures = link.of(m.LockFailure)
    assert [(f.req_id.seq_num, f.transaction_id) for f in failures] == [(2, 0)]
    assert [r.transaction_id for r in link.of(m.FlushResponse)] == [0]
    # The flush answered before the append behind it was handed to the store.
    assert link.posted.index(failures[0]) < link.posted.index(link.of(m.FlushResponse)[0])
    assert store.appended == [b"first", b"after-the-flush"]
