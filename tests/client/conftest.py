"""Shared applications for the client tests: a lock-protected counter per key.

Every transaction carries ``{"key", "old", "new"}`` computed from the application's state at
``execute`` time under a write lock on the key. If the lock model holds, replaying a partition's
log in order finds every transaction's ``old`` equal to the value the previous transaction on the
same key wrote: a committed conflicting transaction (a lost update) breaks the chain.
"""

from __future__ import annotations

import threading
import types

import pytest

from waltz_core.client import JsonSerializer, PartitionLocalLock, TransactionContext, WaltzClientCallbacks

JSON = JsonSerializer()


class CounterApp(WaltzClientCallbacks):
    """One application instance: its 'database' is this object (sync apply)."""

    def __init__(self, start_hwm: dict[int, int] | None = None, values: dict[str, int] | None = None) -> None:
        self.hwm: dict[int, int] = dict(start_hwm or {})
        self.values: dict[str, int] = dict(values or {})
        self.applied: dict[int, list[int]] = {}
        self.records: dict[int, list[dict]] = {}
        self.apply_threads: set[str] = set()
        self.fail_on: set[tuple[int, int]] = set()  # (partition, txn): raise once
        self.uncaught: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm.get(partition_id, -1)

    def _apply(self, txn, data: dict) -> None:
        if (txn.partition_id, txn.transaction_id) in self.fail_on:
            self.fail_on.discard((txn.partition_id, txn.transaction_id))
            raise RuntimeError("injected apply failure")
        with self.lock:
            self.apply_threads.add(threading.current_thread().name)
            self.values[data["key"]] = data["new"]
            self.hwm[txn.partition_id] = txn.transaction_id
            self.applied.setdefault(txn.partition_id, []).append(txn.transaction_id)
            self.records.setdefault(txn.partition_id, []).append(data)

    def apply_transaction(self, txn) -> None:
        self._apply(txn, txn.get_data(JSON))

    def _apply_id(self, txn) -> None:
        """Apply without reading the data (what a plain-function apply of the async client can do)."""
        if (txn.partition_id, txn.transaction_id) in self.fail_on:
            self.fail_on.discard((txn.partition_id, txn.transaction_id))
            raise RuntimeError("injected apply failure")
        self.hwm[txn.partition_id] = txn.transaction_id
        self.applied.setdefault(txn.partition_id, []).append(txn.transaction_id)

    def uncaught_exception(self, partition_id: int, transaction_id: int, exc: BaseException) -> None:
        self.uncaught.append((partition_id, transaction_id))


class AsyncCounterApp(CounterApp):
    async def apply_transaction(self, txn) -> None:
        self._apply(txn, await txn.fetch_data(JSON))


class Increment(TransactionContext):
    """Add one to ``key`` (in partition ``pid``) under a write lock on it."""

    def __init__(self, app: CounterApp, key: str, pid: int, **kw) -> None:
        super().__init__(**kw)
        self.app = app
        self.key = key
        self.pid = pid
        self.executions = 0
        self.events: list[object] = []

    def partition_id(self, num_partitions: int) -> int:
        return self.pid % num_partitions

    def execute(self, builder) -> bool:
        self.executions += 1
        with self.app.lock:
            old = self.app.values.get(self.key, 0)
        builder.set_header(self.executions)
        builder.set_transaction_data({"key": self.key, "old": old, "new": old + 1}, JSON)
        builder.set_write_locks([PartitionLocalLock("counter:" + self.key, 0)])
        return True

    def on_completion(self, result: bool) -> None:
        self.events.append(("completion", result))

    def on_application(self) -> None:
        self.events.append("application")

    def on_lock_failure(self) -> None:
        self.events.append("lock_failure")

    def on_exception(self, exc: BaseException) -> None:
        self.events.append(("exception", type(exc).__name__))

    def on_expiration(self) -> None:
        self.events.append("expiration")


def check_chains(records: list[dict]) -> dict[str, int]:
    """Replay one partition's committed counter transactions; fail on a lost update."""
    values: dict[str, int] = {}
    for i, data in enumerate(records):
        assert data["old"] == values.get(data["key"], 0), f"transaction {i} committed a stale read: {data}"
        values[data["key"]] = data["new"]
    return values


@pytest.fixture
def apps() -> types.SimpleNamespace:
    return types.SimpleNamespace(CounterApp=CounterApp, AsyncCounterApp=AsyncCounterApp, Increment=Increment,
                                 check_chains=check_chains, JSON=JSON)
