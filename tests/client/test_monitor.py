"""Unit tests of the fate-decision rules (Waltz design, "Detection of Failed Append Requests") and expiry."""

from __future__ import annotations

import time

import pytest

from waltz_core.client import PartitionLocalLock, TransactionBuilder, TransactionContext
from waltz_core.client.monitor import LockWaits, TransactionMonitor
from waltz_core.protocol.wire import crc32


class Ctx(TransactionContext):
    def partition_id(self, n: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        return True


def test_own_success_fails_every_older_pending_append_only() -> None:
    mon = TransactionMonitor()
    ctxs = [Ctx() for _ in range(5)]
    for seq, ctx in zip((2, 4, 6, 8, 10), ctxs, strict=True):
        mon.register(seq, ctx, 1, 0.0)
    entry, failed = mon.on_feed(6)
    assert entry is not None and entry.context is ctxs[2]
    assert [e.context for e in failed] == [ctxs[0], ctxs[1]]
    assert [e.seq for e in mon] == [8, 10]
    # someone else's / an already resolved request changes nothing
    assert mon.on_feed(6) == (None, [])
    assert mon.on_feed(7) == (None, [])
    assert len(mon) == 2


def test_mount_or_flush_fails_appends_sent_before_it() -> None:
    mon = TransactionMonitor()
    for seq in (1, 2, 5, 9):
        mon.register(seq, Ctx(), 1, float(seq))
    assert mon.oldest() == 1.0
    assert [e.seq for e in mon.fail_before(5)] == [1, 2]
    assert [e.seq for e in mon] == [5, 9]
    assert mon.oldest() == 5.0
    assert [e.seq for e in mon.fail_all()] == [5, 9]
    assert mon.oldest() is None


def test_lock_failure_removes_only_that_append() -> None:
    mon = TransactionMonitor()
    for seq in (1, 2, 3):
        mon.register(seq, Ctx(), 1, 0.0)
    assert mon.on_lock_failure(2) is not None
    assert mon.on_lock_failure(2) is None
    assert [e.seq for e in mon] == [1, 3]


def test_registration_order_is_enforced() -> None:
    mon = TransactionMonitor()
    mon.register(5, Ctx(), 1, 0.0)
    with pytest.raises(ValueError):
        mon.register(5, Ctx(), 1, 0.0)


def test_lock_waits_release_once_the_conflicting_transaction_is_consumed() -> None:
    mon = TransactionMonitor()
    waits = LockWaits()
    entries = [mon.register(seq, Ctx(), 1, 0.0) for seq in (1, 2, 3)]
    waits.add(10, entries[0])
    waits.add(7, entries[1])
    waits.add(12, entries[2])
    assert waits.release(6) == []
    assert waits.release(7) == [entries[1]]
    assert waits.release(11) == [entries[0]]
    assert len(waits) == 1
    assert waits.drain() == [entries[2]]


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
