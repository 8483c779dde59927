"""Unit tests of the client's per-partition runtime (ready in step with the session, lock waits),
transaction expiry and the builder."""

from __future__ import annotations

import time

import pytest

from waltz_core.client import PartitionLocalLock, TransactionBuilder, TransactionContext
from waltz_core.client.partition import LockWaits, Partition
from waltz_core.coordination.recipes import PartitionOwner
from waltz_core.protocol import client as m
from waltz_core.protocol.session import PendingAppend, SessionState
from waltz_core.protocol.wire import ReqId, crc32


class Ctx(TransactionContext):
    def partition_id(self, n: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        return True


async def test_ready_follows_the_session_state_through_every_change() -> None:
    p = Partition(3, client_id=7, high_water_mark=4)
    assert p.state is SessionState.UNMOUNTED and not p.ready.is_set()
    p.bind(PartitionOwner("server:1", 2, 1))
    assert p.session.generation == 2 and not p.ready.is_set()
    mount = p.mount(network_seq=1)
    assert mount.client_high_water_mark == 4 and mount.req_id == ReqId(7, 2, 3, mount.req_id.seq_num)
    assert p.state is SessionState.MOUNTING and not p.ready.is_set()
    p.receive(m.MountResponse(mount.req_id, m.PartitionState.READY))
    assert p.state is SessionState.READY and p.ready.is_set()
    p.link_lost()
    assert p.state is SessionState.UNMOUNTED and not p.ready.is_set()
    mount = p.mount(network_seq=2)
    p.receive(m.MountResponse(mount.req_id, m.PartitionState.CLIENT_AHEAD))
    assert p.state is SessionState.AHEAD and p.ready.is_set()  # submitters wake up and raise
    p.link_lost()
    assert p.state is SessionState.AHEAD and p.ready.is_set()
    mount = p.mount(network_seq=3)
    p.receive(m.MountResponse(mount.req_id, m.PartitionState.READY))
    p.feed.put((5, 0, ReqId(1, 2, 3, 1), None))
    assert p.apply_failed() > 0 and not p.ready.is_set() and len(p.feed) == 0
    p.deactivate()
    assert p.state is SessionState.INACTIVE and p.ready.is_set()  # waiters see it and give up


def entry(seq: int) -> PendingAppend[Ctx]:
    return PendingAppend(seq, Ctx(), 1, 0.0)


def test_lock_waits_release_once_the_conflicting_transaction_is_consumed() -> None:
    waits = LockWaits()
    entries = [entry(seq) for seq in (1, 2, 3)]
    waits.add(10, entries[0])
    waits.add(7, entries[1])
    waits.add(12, entries[2])
    assert waits.release(6) == []
    assert waits.release(7) == [entries[1]]
    assert waits.release(11) == [entries[0]]
    assert len(waits) == 1
    assert waits.drain() == [entries[2]]
    assert len(waits) == 0


def test_lock_waits_keep_the_order_of_failures_on_the_same_conflict() -> None:
    waits = LockWaits()
    entries = [entry(seq) for seq in (5, 1, 3)]
    for e in entries:
        waits.add(4, e)
    assert waits.drain() == entries


def test_expiry_by_retry_limit_and_deadline() -> None:
    ctx = Ctx(max_retries=2)
    assert not ctx._expired(0)
    assert not ctx._expired(2)  # two executions done: one retry left
    assert ctx._expired(3)
    timed = Ctx(timeout=0.05)
    created = timed._created_monotonic
    assert not timed._expired(10, now=created + 0.04)
    assert timed._expired(0, now=created + 0.06)
    time.sleep(0.06)
    assert timed._expired(0)  # the default clock is time.monotonic()
    assert not Ctx()._expired(10**6)


def test_builder_checksums_data_and_hashes_locks() -> None:
    b = TransactionBuilder(3, 41)
    assert (b.partition_id, b.client_high_water_mark, b.data, b.checksum) == (3, 41, b"", 0)
    b.set_transaction_data(b"hello")
    assert b.checksum == crc32(b"hello")
    lock = PartitionLocalLock("account", 7)
    b.set_write_locks([lock])
    b.set_read_locks([PartitionLocalLock("branch", 1)])
    b.set_append_locks([])
    assert b.write_locks == (lock.lock_hash,)
    assert b.read_locks == (PartitionLocalLock("branch", 1).lock_hash,)
    with pytest.raises(TypeError):
        b.set_transaction_data("not bytes")
    with pytest.raises(TypeError):
        b.set_write_locks([("account", 7)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        b.set_header(2**31)
