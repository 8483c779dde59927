"""``waltz client validate``: the original's optimistic-locking validation (``ClientCli validate``).

``clients`` producers (one :class:`~waltz_core.client.AsyncWaltzClient` each, distinct client
ids) submit ``txn_per_client`` transactions each, with exponential inter-arrival times of mean
``interval`` ms. Every transaction's data is *its client high-water mark + 1* and it holds the
one shared write lock ``validate-lock/0``: it can only commit if nothing committed after the
high-water mark it read, so a committed transaction's data must equal its own transaction id.
A fresh consumer then reads every transaction committed since the run began and checks
``data == transaction id`` and that the ids are gap-free.

The check assumes no other application writes to the active partitions during the run.
"""

from __future__ import annotations

import asyncio
import random
import time

import attrs

from ..client.api import Transaction, TransactionBuilder, TransactionContext, WaltzClientCallbacks
from ..client.core import AsyncWaltzClient
from ..config import ClientProcessConfig
from ..locks.lock_id import PartitionLocalLock
from ..timeouts import wait_for

VALIDATE_LOCK = PartitionLocalLock("validate-lock", 0)


@attrs.define
class ValidateResult:
    clients: int
    txn_per_client: int
    partitions: list[int]
    committed: int = 0
    executions: int = 0
    lock_failures: int = 0
    failed: int = 0
    consumed: int = 0
    seconds: float = 0.0
    errors: list[str] = attrs.Factory(list)

    @property
    def expected(self) -> int:
        return self.clients * self.txn_per_client

    @property
    def retries(self) -> int:
        return self.executions - self.committed - self.failed

    @property
    def passed(self) -> bool:
        return not self.errors and self.committed == self.consumed == self.expected and self.failed == 0

    def report(self) -> list[str]:
        lines = [
            f"clients={self.clients} txn-per-client={self.txn_per_client} partitions={self.partitions}",
            f"committed={self.committed}/{self.expected} consumed={self.consumed} executions={self.executions} "
            f"lock-failures={self.lock_failures} retries={self.retries} failed={self.failed} in {self.seconds:.1f}s",
        ]
        lines.extend(f"error: {e}" for e in self.errors[:20])
        if len(self.errors) > 20:
            lines.append(f"... {len(self.errors) - 20} more errors")
        lines.append("PASS" if self.passed else "FAIL")
        return lines


class _Tracker(WaltzClientCallbacks):
    """A producer's application: it only tracks its high-water marks (from ``start``)."""

    def __init__(self, start: dict[int, int]) -> None:
        self.hwm = dict(start)

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm.get(partition_id, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        self.hwm[transaction.partition_id] = transaction.transaction_id


class _ValidateTxn(TransactionContext):
    def __init__(self, partition: int, result: ValidateResult, done: asyncio.Future[None]) -> None:
        super().__init__()
        self.partition = partition
        self.result = result
        self.done = done

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        self.result.executions += 1
        builder.set_transaction_data(str(builder.client_high_water_mark + 1).encode())
        builder.set_write_locks([VALIDATE_LOCK])
        return True

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def on_completion(self, result: bool) -> None:
        if result:
            self.result.committed += 1
        self._finish()

    def on_lock_failure(self) -> None:
        self.result.lock_failures += 1

    def on_exception(self, exc: BaseException) -> None:
        self.result.failed += 1
        self.result.errors.append(f"transaction failed: {exc!r}")
        self._finish()

    def on_expiration(self) -> None:
        self.result.failed += 1
        self._finish()


class _Checker(WaltzClientCallbacks):
    """The consumer: every transaction after ``start`` must carry its own id, gap-free."""

    def __init__(self, start: dict[int, int], result: ValidateResult) -> None:
        self.start = dict(start)
        self.hwm = dict(start)
        self.result = result
        self.changed = asyncio.Event()

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.start.get(partition_id, -1)

    async def apply_transaction(self, transaction: Transaction) -> None:
        pid, tid = transaction.partition_id, transaction.transaction_id
        if pid in self.start:
            expected = self.hwm[pid] + 1
            if tid != expected:
                self.result.errors.append(f"partition {pid}: transaction {tid} arrived, expected {expected} (gap)")
            data = await transaction.fetch_data()
            try:
                value = int(data.decode())
            except (UnicodeDecodeError, ValueError):
                value = None
            if value != tid:
                self.result.errors.append(f"partition {pid}: transaction {tid} carries {data[:40]!r}: "
                                          "committed on a stale read (optimistic locking violated)")
            self.result.consumed += 1
        self.hwm[pid] = tid
        self.changed.set()


async def validate(config: ClientProcessConfig, *, clients: int = 4, txn_per_client: int = 100,
                   interval_ms: float = 10.0, active_partitions: int = 1, seed: int | None = None,
                   timeout: float = 120.0) -> ValidateResult:
    """Run the validation on the running event loop; never raises on a failed check (see ``passed``)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    # Only the active partitions are mounted (the others may hold anything).
    config = attrs.evolve(config, client=attrs.evolve(config.client, auto_mount=False))
    probe = AsyncWaltzClient(_Tracker({}), config)
    await probe.start()
    try:
        partitions = list(range(min(max(1, active_partitions), probe.num_partitions)))
        start = {pid: await probe.high_water_mark(pid) for pid in partitions}
    finally:
        await probe.close()
    result = ValidateResult(clients, txn_per_client, partitions)
    producers = [AsyncWaltzClient(_Tracker(start), config) for _ in range(clients)]
    try:
        for p in producers:
            await p.start()
            await p.set_partitions(partitions)
        loop = asyncio.get_running_loop()

        async def produce(client: AsyncWaltzClient, r: random.Random) -> None:
            pending: list[asyncio.Future[None]] = []
            for _ in range(txn_per_client):
                if interval_ms > 0:
                    await asyncio.sleep(r.expovariate(1000.0 / interval_ms))
                done: asyncio.Future[None] = loop.create_future()
                pending.append(done)
                await client.submit(_ValidateTxn(r.choice(partitions), result, done))
            await wait_for(asyncio.gather(*pending), timeout)
            await client.flush()

        await asyncio.gather(*(produce(p, random.Random(rng.randrange(2**32))) for p in producers))
    finally:
        for p in producers:
            await p.close()

    checker = _Checker(start, result)
    async with AsyncWaltzClient(checker, config) as consumer:
        await consumer.set_partitions(partitions)
        targets = {pid: await consumer.high_water_mark(pid) for pid in partitions}
        deadline = time.monotonic() + timeout
        while any(checker.hwm.get(pid, -1) < hwm for pid, hwm in targets.items()):
            if time.monotonic() > deadline:
                result.errors.append(f"consumer stopped at {checker.hwm}, expected {targets}")
                break
            checker.changed.clear()
            try:
                await wait_for(checker.changed.wait(), 0.5)
            except TimeoutError:
                pass
    result.seconds = time.monotonic() - t0
    if result.committed != result.expected:
        result.errors.append(f"{result.committed} of {result.expected} transactions committed")
    if result.consumed != result.committed:
        result.errors.append(f"consumer read {result.consumed} transactions, producers saw {result.committed} commit")
    return result
