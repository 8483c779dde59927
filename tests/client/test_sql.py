"""Exactly-once apply into a shared SQLite database from two application instances."""

from __future__ import annotations

import sqlite3

import pytest

from waltz_core.client import TransactionBuilder, TransactionContext
from waltz_core.client.sql import SqlClientCallbacks
from waltz_core.testing.mock_cluster import MockCluster

pytestmark = pytest.mark.timeout(60)


class Ledger(SqlClientCallbacks):
    def __init__(self, path: str, name: str) -> None:
        self.name = name
        super().__init__(lambda: sqlite3.connect(path, timeout=10, check_same_thread=False))

    def apply(self, transaction, connection) -> None:
        connection.execute("CREATE TABLE IF NOT EXISTS entries (partition_id INTEGER, txn INTEGER, data TEXT, "
                           "applied_by TEXT, PRIMARY KEY (partition_id, txn))")
        connection.execute("INSERT INTO entries VALUES (?, ?, ?, ?)",
                           (transaction.partition_id, transaction.transaction_id, transaction.get_data().decode(), self.name))


class Note(TransactionContext):
    def __init__(self, text: str, pid: int) -> None:
        super().__init__()
        self.text = text
        self.pid = pid

    def partition_id(self, num_partitions: int) -> int:
        return self.pid

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data(self.text.encode())
        return True


def test_two_instances_apply_each_transaction_exactly_once(tmp_path) -> None:
    path = str(tmp_path / "app.db")
    with sqlite3.connect(path) as db:  # the application's own table exists before the feed starts
        db.execute("CREATE TABLE entries (partition_id INTEGER, txn INTEGER, data TEXT, applied_by TEXT, "
                   "PRIMARY KEY (partition_id, txn))")
    with MockCluster(2) as cluster:
        a, b = Ledger(path, "a"), Ledger(path, "b")
        with cluster.client(a) as ca, cluster.client(b) as cb:
            for i in range(20):
                (ca if i % 2 else cb).submit(Note(f"n{i}", i % 2))
            ca.flush()
            cb.flush()
        with sqlite3.connect(path) as db:
            rows = db.execute("SELECT partition_id, txn, data, applied_by FROM entries ORDER BY partition_id, txn").fetchall()
            marks = dict(db.execute("SELECT partition_id, high_water_mark FROM waltz_high_water_marks").fetchall())
    assert [(p, t) for p, t, _, _ in rows] == [(p, t) for p in (0, 1) for t in range(10)]  # each once, no gap
    assert sorted(d for _, _, d, _ in rows) == sorted(f"n{i}" for i in range(20))
    assert marks == {0: 9, 1: 9}
    # a third instance started later applies nothing old: it resumes from the shared high-water mark
    with MockCluster(1) as cluster:
        assert Ledger(path, "c").client_high_water_mark(0) == 9


def test_failed_apply_rolls_back_the_high_water_mark(tmp_path) -> None:
    path = str(tmp_path / "app.db")

    class Flaky(Ledger):
        failures = 1

        def apply(self, transaction, connection) -> None:
            super().apply(transaction, connection)
            if self.failures:
                self.failures -= 1
                raise RuntimeError("application bug")

    with MockCluster(1) as cluster:
        ledger = Flaky(path, "a")
        with cluster.client(ledger) as client:
            for i in range(3):
                client.submit(Note(f"n{i}", 0))
            client.flush()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT txn FROM entries ORDER BY txn").fetchall() == [(0,), (1,), (2,)]
        assert db.execute("SELECT high_water_mark FROM waltz_high_water_marks").fetchall() == [(2,)]
