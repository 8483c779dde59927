"""Shipped test and benchmark support: a recording client that writes transactions and keeps what it applied."""

from __future__ import annotations

import threading
from typing import Any

from waltz_core.client import Transaction, TransactionBuilder, TransactionContext, WaltzClient, WaltzClientCallbacks

Row = tuple[int, int, int, int, int, int, bytes]


class Recorder(WaltzClientCallbacks):
    """Applies every transaction of every partition (from the start) and keeps it as a row."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], Row] = {}
        self.lock = threading.Lock()

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, transaction: Transaction) -> None:
        q = transaction.req_id
        row = (transaction.partition_id, transaction.transaction_id, transaction.header, q.client_id,
               q.generation, q.seq_num, transaction.get_data())
        with self.lock:
            self.rows[(row[0], row[1])] = row


class Put(TransactionContext):
    def __init__(self, partition: int, data: bytes, header: int = 0) -> None:
        super().__init__()
        self.partition = partition
        self.data = data
        self.header = header

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_header(self.header)
        builder.set_transaction_data(self.data)
        return True


def write_and_record(config: Any, items: list[tuple[int, bytes, int]]) -> dict[tuple[int, int], Row]:
    """Append (partition, data, header) items, then return every row the client applied (whole log)."""
    recorder = Recorder()
    with WaltzClient(recorder, config) as client:
        client.wait_mounted(30)
        for partition, data, header in items:
            client.submit(Put(partition, data, header))
        client.flush(120)
        marks = {p: client.high_water_mark(p) for p in range(client.num_partitions)}
        # flush() waits for what this client received; the marks tell what the log holds
        for p, hwm in marks.items():
            assert all((p, t) in recorder.rows for t in range(hwm + 1))
    with recorder.lock:
        return dict(recorder.rows)


def high_water_marks(config: Any) -> dict[int, int]:
    from waltz_spark.logclient import LogInfo

    with LogInfo(config) as info:
        return info.high_water_marks(range(info.num_partitions))
