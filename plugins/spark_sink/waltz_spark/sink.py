"""DataFrame rows as transactions: the write side of the ``waltz`` data source.

One Spark task writes its rows through one :class:`~waltz_core.client.WaltzClient`: each row is a
:class:`~waltz_core.client.TransactionContext` (data, optional header and write locks), submitted
with back pressure; the client retries failed appends (its monitor decides each append's fate
from the feed, so an append that committed is never re-sent by the same client). The task ends
with ``flush()`` and fails if any row's outcome is not "committed" (or "duplicate", below), so
Spark retries the task.

Delivery guarantee (see docs/spark.md):

* default: **at-least-once**. A task that fails after some of its rows committed is retried by
  Spark and writes those rows again;
* ``idempotent=true`` with ``lockColumn`` (an idempotency key per row): every attempt of every
  task appends with a write lock on the key **checked against the high-water marks read on the
  driver before the job** (or the pinned ``lockSnapshot``), not against the client's own. A row
  whose key was written by anyone after that snapshot (for example by an earlier attempt of this
  task) fails its lock check and is dropped as a duplicate. This is exactly-once for task
  retries and speculative tasks of one job or one streaming query run, provided the server's
  lock table reports no false conflicts (``server.lock_table = "exact"``; the default ``hashed``
  table may drop a row whose key shares a slot with another key written after the snapshot).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from waltz_core.client import (
    PartitionLocalLock,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
    WaltzClientCallbacks,
)
from waltz_core.config import ClientProcessConfig
from waltz_core.errors import ClientError

from .options import WriteOptions, client_config

#: In-flight appends per partition for a writing task unless ``client.max_concurrent_transactions`` is set.
SINK_IN_FLIGHT = 256


class SinkWriteError(ClientError):
    """Some rows of a writing task have no committed outcome (the task fails; Spark retries it)."""


@attrs.frozen
class WriteResult:
    """What one writing task did (the WriterCommitMessage payload)."""

    committed: int
    duplicates: int
    per_partition: tuple[tuple[int, int], ...]


class _Tracker:
    """Outcomes of a task's rows (client threads report, the task thread waits)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.committed = 0
        self.duplicates = 0
        self.failures: list[str] = []
        self.per_partition: dict[int, int] = {}

    @property
    def resolved(self) -> int:
        return self.committed + self.duplicates + len(self.failures)


class RowTransaction(TransactionContext):
    """One DataFrame row as a transaction (``execute`` may run several times)."""

    def __init__(self, partition: int, data: bytes, header: int, locks: tuple[PartitionLocalLock, ...],
                 pinned_hwm: int | None, tracker: _Tracker, *, timeout: float | None, max_retries: int | None) -> None:
        super().__init__(timeout=timeout, max_retries=max_retries)
        self.partition = partition
        self.data = data
        self.header = header
        self.locks = locks
        self.pinned_hwm = pinned_hwm
        self.tracker = tracker
        self.lock_failures = 0

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        if self.pinned_hwm is not None and self.lock_failures:
            return False  # the key was written after the snapshot: a duplicate, drop it
        builder.set_header(self.header)
        builder.set_transaction_data(self.data)
        if self.locks:
            builder.set_write_locks(self.locks)
        if self.pinned_hwm is not None:
            # Check the key against the snapshot taken before the job, on every attempt. Even if
            # this re-execution races ahead of on_lock_failure it cannot commit: the conflicting
            # write is still after the snapshot, so it fails again and the next execute drops it.
            builder.client_high_water_mark = self.pinned_hwm
        return True

    def on_lock_failure(self) -> None:
        self.lock_failures += 1

    def on_completion(self, result: bool) -> None:
        with self.tracker.lock:
            if result:
                self.tracker.committed += 1
                pp = self.tracker.per_partition
                pp[self.partition] = pp.get(self.partition, 0) + 1
            else:
                self.tracker.duplicates += 1

    def on_exception(self, exc: BaseException) -> None:
        with self.tracker.lock:
            self.tracker.failures.append(f"{type(exc).__name__}: {exc}")

    def on_expiration(self) -> None:
        with self.tracker.lock:
            self.tracker.failures.append("expired (option 'timeout' or 'maxRetries' reached)")


class _FromMarks(WaltzClientCallbacks):
    """A writing client follows the feed from the high-water marks read when it started."""

    def __init__(self, marks: Mapping[int, int]) -> None:
        self.marks = marks

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.marks[partition_id]

    def apply_transaction(self, transaction: Transaction) -> None:
        pass


def _to_bytes(value: Any, column: str) -> bytes:
    if value is None:
        return b""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    raise ClientError(f"waltz write: column {column!r} must be binary or string, got {type(value).__name__} "
                      "(serialize it first, for example with to_json())")


def key_to_lock_id(value: Any, column: str) -> int:
    """A lock id (signed 64-bit) from an int key, or a stable hash of a string/bytes key."""
    if isinstance(value, bool):
        raise ClientError(f"waltz write: column {column!r}: a boolean is not a lock key")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(hashlib.blake2b(bytes(value), digest_size=8).digest(), "big", signed=True)
    raise ClientError(f"waltz write: column {column!r}: a lock key must be an integer, string or binary, "
                      f"got {type(value).__name__}")


def _locks(value: Any, name: str, column: str) -> tuple[PartitionLocalLock, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(PartitionLocalLock(name, key_to_lock_id(v, column)) for v in value)
    return (PartitionLocalLock(name, key_to_lock_id(value, column)),)


def load_partitioner(spec: str) -> Callable[[Any, int], int]:
    """``"module:function"`` -> the function (called as ``f(row, num_partitions)``)."""
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ClientError(f"waltz write option 'partitioner': cannot load {spec!r}: {exc}") from exc
    if not callable(fn):
        raise ClientError(f"waltz write option 'partitioner': {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def partition_of(row: Any, opts: WriteOptions, data: bytes, num_partitions: int,
                 partitioner: Callable[[Any, int], int] | None) -> int:
    """The row's partition: the partitioner, else partitionColumn, else the lock key, else the data's CRC."""
    if partitioner is not None:
        pid = partitioner(row, num_partitions)
        if not isinstance(pid, int) or not 0 <= pid < num_partitions:
            raise ClientError(f"waltz write: partitioner {opts.partitioner} returned {pid!r}, "
                              f"not a partition in 0..{num_partitions - 1}")
        return pid
    column = opts.partition_column or opts.lock_column
    if column is not None:
        value = row[column]
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            if isinstance(value, int) and not isinstance(value, bool):
                return value % num_partitions
            return zlib.crc32(_to_bytes(value, column)) % num_partitions
    return zlib.crc32(data) % num_partitions


def write_rows(config: ClientProcessConfig, rows: Iterable[Any], opts: WriteOptions,
               snapshot: Mapping[int, int] | None) -> WriteResult:
    """Append every row as a transaction and wait for every outcome (a Spark task thread; blocks).

    ``snapshot`` (idempotent mode): partition -> high-water mark before the job; the lock check
    of every append is made against it. Raises :class:`SinkWriteError` if a row did not commit.
    """
    if "max_concurrent_transactions" not in {k[len("client."):] for k in opts.raw if k.startswith("client.")}:
        config = attrs.evolve(config, client=attrs.evolve(config.client, max_concurrent_transactions=SINK_IN_FLIGHT))
    config = attrs.evolve(config, client=attrs.evolve(config.client, auto_mount=False))
    partitioner = load_partitioner(opts.partitioner) if opts.partitioner else None
    tracker = _Tracker()
    marks: dict[int, int] = {}
    client = WaltzClient(_FromMarks(marks), config)
    submitted = 0
    try:
        n = client.num_partitions

        async def current() -> list[int]:
            return list(await asyncio.gather(*(client.async_client.high_water_mark(p) for p in range(n))))

        marks.update(enumerate(asyncio.run_coroutine_threadsafe(current(), client.loop).result(
            config.client.rpc_timeout * 3)))
        if snapshot is not None:
            unknown = [p for p in range(n) if p not in snapshot]
            if unknown:
                raise ClientError(f"waltz write: the lock snapshot has no high-water mark for partitions {unknown}")
        client.set_partitions(range(n))
        for row in rows:
            data = _to_bytes(row[opts.data_column], opts.data_column)
            header = int(row[opts.header_column] or 0) if opts.header_column else 0
            locks = _locks(row[opts.lock_column], opts.lock_name, opts.lock_column) if opts.lock_column else ()
            pid = partition_of(row, opts, data, n, partitioner)
            pinned = snapshot[pid] if snapshot is not None else None
            client.submit(RowTransaction(pid, data, header, locks, pinned, tracker,
                                         timeout=opts.timeout, max_retries=opts.max_retries))
            submitted += 1
        client.flush()
    finally:
        client.close()
    with tracker.lock:
        if tracker.failures or tracker.resolved != submitted:
            unresolved = submitted - tracker.resolved
            sample = "; ".join(tracker.failures[:3])
            raise SinkWriteError(f"waltz write: {len(tracker.failures)} of {submitted} rows failed and {unresolved} "
                                 f"have no outcome ({sample}); the task fails so Spark retries it")
        return WriteResult(tracker.committed, tracker.duplicates, tuple(sorted(tracker.per_partition.items())))


def snapshot_for(opts: WriteOptions) -> dict[int, int] | None:
    """Driver side: the lock snapshot of an idempotent write (pinned option, else current marks)."""
    if not opts.idempotent:
        return None
    if opts.lock_snapshot is not None:
        return dict(opts.lock_snapshot)
    from .logclient import LogInfo

    with LogInfo(client_config(opts.raw)) as info:
        return info.high_water_marks(range(info.num_partitions))
