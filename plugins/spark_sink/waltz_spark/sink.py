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
* ``idempotent=true`` with ``lockColumn`` (an idempotency key per row): **exactly-once** for task
  retries and speculative tasks of one job or one streaming query run. Every row's data is
  written with its keys in front (:mod:`waltz_spark.keyed`), and the first append of every
  attempt of every task carries a write lock on the key **checked against the high-water marks
  read on the driver before the job** (or the pinned ``lockSnapshot``). A lock conflict only
  says that *some* key sharing the lock's slots was written after the snapshot (the ``hashed``
  table reports false conflicts), so it drops nothing by itself: the row is re-executed, the
  task reads the partition's keys from the snapshot up to its own high-water mark (once, then
  incrementally: :class:`_KeyIndex`), and the row is dropped as a duplicate only if one of its
  keys is there. Otherwise it is sent again, checked against that high-water mark (any write of
  the key after it still conflicts); after ``maxFalseConflicts`` such retries the task fails.
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

from .keyed import canonical_key, decode_keyed, describe_key, encode_keyed
from .options import WriteOptions, client_config

#: In-flight appends per partition for a writing task unless ``client.max_concurrent_transactions`` is set.
SINK_IN_FLIGHT = 256
#: Transactions whose data one RPC fetches while a task reads the keys of a partition.
KEY_SCAN_WINDOW = 1024


class SinkWriteError(ClientError):
    """Some rows of a writing task have no committed outcome (the task fails; Spark retries it)."""


@attrs.frozen
class WriteResult:
    """What one writing task did (the WriterCommitMessage payload)."""

    committed: int
    duplicates: int  #: rows dropped because one of their keys is in the log after the snapshot
    per_partition: tuple[tuple[int, int], ...]
    false_conflicts: int  #: re-executions of rows whose keys were proven absent (sent again)


class _Tracker:
    """Outcomes of a task's rows (client threads report, the task thread waits)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.committed = 0
        self.duplicates = 0
        self.false_conflicts = 0
        self.failures: list[str] = []
        self.per_partition: dict[int, int] = {}

    @property
    def resolved(self) -> int:
        return self.committed + self.duplicates + len(self.failures)


class _KeyIndex:
    """The idempotency keys in one partition's transactions after the snapshot, read on demand.

    Built only when a row of the task is re-executed, by reading the data of the partition's
    transactions from the snapshot on (then only what was added since the last read), so a task
    without lock conflicts reads nothing. Thread-safe: retry threads share it.
    """

    def __init__(self, client: WaltzClient, partition: int, snapshot: int) -> None:
        self.client = client
        self.partition = partition
        self.read_to = snapshot
        self.keys: set[bytes] = set()
        self.lock = threading.Lock()

    def has_any(self, keys: tuple[bytes, ...], up_to: int) -> bool:
        """True if one of ``keys`` is in a transaction after the snapshot (reading up to ``up_to``)."""
        with self.lock:
            while self.read_to < up_to:
                first = self.read_to + 1
                count = min(up_to - self.read_to, KEY_SCAN_WINDOW)
                for data in self.client.fetch_data_range(self.partition, first, count):
                    keyed = decode_keyed(data)
                    if keyed is not None:
                        self.keys.update(keyed[0])
                self.read_to = first + count - 1
            return not self.keys.isdisjoint(keys)


@attrs.frozen
class _Idempotency:
    """What an idempotent row checks: the snapshot mark, its partition's key index, the retry bound."""

    snapshot: int
    index: _KeyIndex
    max_false_conflicts: int


class RowTransaction(TransactionContext):
    """One DataFrame row as a transaction (``execute`` may run several times)."""

    def __init__(self, partition: int, data: bytes, header: int, locks: tuple[PartitionLocalLock, ...],
                 keys: tuple[bytes, ...], idempotency: _Idempotency | None, tracker: _Tracker, *,
                 timeout: float | None, max_retries: int | None) -> None:
        super().__init__(timeout=timeout, max_retries=max_retries)
        self.partition = partition
        self.data = encode_keyed(keys, data) if idempotency is not None else data
        self.header = header
        self.locks = locks
        self.keys = keys
        self.idempotency = idempotency
        self.tracker = tracker
        self.executions = 0
        self.false_conflicts = 0
        self.checked_to = idempotency.snapshot if idempotency is not None else -1

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        self.executions += 1
        idem = self.idempotency
        if idem is not None and self.keys and self.executions > 1:
            # A re-execution: the last attempt hit a lock conflict (or failed otherwise). Only the
            # log tells a duplicate from a false conflict. The client consumed the conflicting
            # transaction before re-executing, so reading up to its mark covers it.
            up_to = max(builder.client_high_water_mark, self.checked_to)
            if idem.index.has_any(self.keys, up_to):
                return False  # proven: a key of this row is in the log after the snapshot
            if self.false_conflicts >= idem.max_false_conflicts:
                raise SinkWriteError(
                    f"waltz write: partition {self.partition}: the row with idempotency key "
                    f"{describe_key(self.keys[0])} conflicted {self.false_conflicts + 1} times although its key is "
                    f"not in the log after the snapshot (false conflicts of the server's lock table; option "
                    f"'maxFalseConflicts' is {idem.max_false_conflicts}); the row was not written")
            self.false_conflicts += 1
            with self.tracker.lock:
                self.tracker.false_conflicts += 1
            self.checked_to = up_to  # absent up to here: a write of the key after it still conflicts
        builder.set_header(self.header)
        builder.set_transaction_data(self.data)
        if self.locks:
            builder.set_write_locks(self.locks)
        if idem is not None:
            builder.client_high_water_mark = self.checked_to
        return True

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


def _keys(value: Any, column: str) -> tuple[bytes, ...]:
    """The canonical idempotency keys of a lock column's value (one key or an array of them)."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(canonical_key(v, column) for v in value)
    return (canonical_key(value, column),)


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

    ``snapshot`` (idempotent mode): partition -> high-water mark before the job; the first lock
    check of every append is made against it, and a row is dropped only when one of its keys is
    in the log after it. Raises :class:`SinkWriteError` if a row did not commit and is not such a
    duplicate.
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
        indexes = {p: _KeyIndex(client, p, snapshot[p]) for p in range(n)} if snapshot is not None else {}
        for row in rows:
            data = _to_bytes(row[opts.data_column], opts.data_column)
            header = int(row[opts.header_column] or 0) if opts.header_column else 0
            locks = _locks(row[opts.lock_column], opts.lock_name, opts.lock_column) if opts.lock_column else ()
            pid = partition_of(row, opts, data, n, partitioner)
            keys: tuple[bytes, ...] = ()
            idempotency = None
            if snapshot is not None:
                assert opts.lock_column is not None  # WriteOptions.parse: idempotent needs lockColumn
                keys = _keys(row[opts.lock_column], opts.lock_column)
                idempotency = _Idempotency(snapshot[pid], indexes[pid], opts.max_false_conflicts)
            client.submit(RowTransaction(pid, data, header, locks, keys, idempotency, tracker,
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
        return WriteResult(tracker.committed, tracker.duplicates, tuple(sorted(tracker.per_partition.items())),
                           tracker.false_conflicts)


def snapshot_for(opts: WriteOptions) -> dict[int, int] | None:
    """Driver side: the lock snapshot of an idempotent write (pinned option, else current marks)."""
    if not opts.idempotent:
        return None
    if opts.lock_snapshot is not None:
        return dict(opts.lock_snapshot)
    from .logclient import LogInfo

    with LogInfo(client_config(opts.raw)) as info:
        return info.high_water_marks(range(info.num_partitions))
