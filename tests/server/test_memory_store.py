"""The in-memory store under the mock cluster keeps the contract the partition relies on."""

from __future__ import annotations

import asyncio

import pytest

from waltz_core.errors import PartitionNotReadyError
from waltz_core.protocol.wire import ReqId
from waltz_core.testing.memory_store import MemoryLog, MemoryStore

pytestmark = pytest.mark.timeout(30)


class Sink:
    def __init__(self) -> None:
        self.commits: list[int] = []

    def on_committed(self, high_water_mark: int) -> None:
        self.commits.append(high_water_mark)

    def on_session_reset(self, high_water_mark: int) -> None:
        raise AssertionError("the memory store never resets a session")


def q(seq: int) -> ReqId:
    return ReqId(1, 1, 0, seq)


async def test_commits_come_later_in_order_and_grouped() -> None:
    delays = iter([0.1, 0.0, 0.0])  # the later appends are due at once, but not before the first
    store = MemoryStore(MemoryLog(), commit_delay=lambda: next(delays))
    sink = Sink()
    assert await store.open(sink) == -1
    assert [store.append(q(i), 0, b"x", 0) for i in range(3)] == [0, 1, 2]
    assert sink.commits == []  # never from inside append
    assert await store.read_record(0) is None  # not committed: not readable
    await store.flush()
    assert sink.commits == [2] and store.high_water_mark == store.log.high_water_mark == 2  # one group
    assert [h.transaction_id for h in await store.read_headers(0, 10)] == [0, 1, 2]
    await store.close()


async def test_a_window_of_appends_in_flight() -> None:
    store = MemoryStore(MemoryLog(), window=2, commit_delay=lambda: 0.05)
    await store.open(Sink())
    store.append(q(1), 0, b"a", 0)
    assert store.writable
    store.append(q(2), 0, b"b", 0)
    assert not store.writable
    await asyncio.wait_for(store.wait_writable(), 5)
    assert store.high_water_mark >= 0
    await store.close()
    with pytest.raises(PartitionNotReadyError):
        await store.wait_writable()


async def test_a_new_session_keeps_what_the_old_one_left_in_flight_and_fences_it() -> None:
    log = MemoryLog()
    old = MemoryStore(log, commit_delay=lambda: 60.0)
    await old.open(Sink())
    old.append(q(1), 0, b"in flight", 0)
    await old.close()
    new = MemoryStore(log)
    assert await new.open(Sink()) == 0  # recovery keeps every record of the log
    assert [r.data for r in log.committed()] == [b"in flight"]
    with pytest.raises(PartitionNotReadyError):
        old.append(q(2), 0, b"late", 0)
    assert new.append(q(3), 0, b"next", 0) == 1
    await new.flush()
    assert new.healthy and not old.healthy
    await new.close()
