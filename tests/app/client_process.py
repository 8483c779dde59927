"""A client application run as its own process by the end-to-end tests (so it can be killed -9).

    python client_process.py <client.toml> <app.sqlite3> <partition> <produce N> <prefix>

It produces N transactions (data ``<prefix>-<i>``) to ``partition``, applies every committed
transaction of that partition to SQLite through the exactly-once helper (one row per apply in
``applied``, no unique key, so a duplicate apply would show), then waits until it has applied
everything the server has committed and prints ``DONE <hwm>``.
"""

from __future__ import annotations

import sys
import time

from waltz_core import TransactionContext, WaltzClient, config
from waltz_core.client.sql import SqlClientCallbacks


class App(SqlClientCallbacks):
    def __init__(self, path: str, partition: int) -> None:
        import sqlite3

        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS applied (partition_id INTEGER, txn_id INTEGER, data TEXT)")
        super().__init__(lambda: sqlite3.connect(path, timeout=30))
        self.partition = partition

    def apply(self, transaction, connection) -> None:
        if transaction.partition_id == self.partition:
            connection.execute("INSERT INTO applied VALUES (?, ?, ?)", (transaction.partition_id,
                               transaction.transaction_id, transaction.get_data().decode()))


class Put(TransactionContext):
    def __init__(self, partition: int, data: bytes) -> None:
        super().__init__()
        self.partition, self.data = partition, data

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder) -> bool:
        builder.set_transaction_data(self.data)
        return True


def main(config_path: str, db: str, partition: int, produce: int, prefix: str) -> None:
    cfg = config.load(config.ClientProcessConfig, config_path)
    app = App(db, partition)
    with WaltzClient(app, cfg) as client:
        for i in range(produce):
            client.submit(Put(partition, f"{prefix}-{i}".encode()))
            if i % 20 == 0:
                print(f"submitted {i}", flush=True)
            time.sleep(0.005)
        client.flush(timeout=60)
        target = client.high_water_mark(partition)
        deadline = time.monotonic() + 60
        while app.client_high_water_mark(partition) < target:
            if time.monotonic() > deadline:
                raise SystemExit(f"not caught up: {app.client_high_water_mark(partition)} < {target}")
            time.sleep(0.05)
        print(f"DONE {target}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
