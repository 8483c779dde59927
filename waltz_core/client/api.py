"""What applications write and receive (Waltz design, "Client API"; original ``waltz-client`` §1.1).

* :class:`TransactionContext` - subclassed by the application: partitioning, ``execute`` (may
  run many times), outcome callbacks and optional expiry;
* :class:`TransactionBuilder` - handed to ``execute``: header, data, locks, and the client
  high-water mark snapshot taken *before* ``execute`` (the optimistic-lock read version);
* :class:`WaltzClientCallbacks` - the application's side of the feed;
* :class:`Transaction` - one committed transaction as ``apply_transaction`` sees it, data
  fetched lazily by RPC through its :class:`TransactionDataSource` (the client's read-ahead);
* :class:`Serializer` - bytes <-> application objects.

Threading rules (also in the client docstrings): with :class:`~waltz_core.client.AsyncWaltzClient`
every callback runs on the client's event loop (plain functions must not block; ``async def``
callbacks are awaited). With :class:`~waltz_core.client.WaltzClient` the feed callbacks of one
partition run on that partition's consumer thread, ``execute`` runs on the thread that called
``submit`` (first attempt) or on a retry thread (re-executions).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from ..errors import ClientError
from ..locks.lock_id import PartitionLocalLock
from ..protocol.wire import ReqId, crc32

T = TypeVar("T")


@runtime_checkable
class Serializer(Protocol[T]):
    """Turns application objects into transaction data and back (original ``Serializer<T>``)."""

    def serialize(self, value: T) -> bytes: ...

    def deserialize(self, data: bytes) -> T: ...


class BytesSerializer:
    """The identity serializer (transaction data as raw bytes)."""

    def serialize(self, value: bytes) -> bytes:
        return bytes(value)

    def deserialize(self, data: bytes) -> bytes:
        return data


class Utf8Serializer:
    """Strings as UTF-8."""

    def serialize(self, value: str) -> bytes:
        return value.encode()

    def deserialize(self, data: bytes) -> str:
        return data.decode()


class JsonSerializer:
    """JSON values (compact, UTF-8)."""

    def serialize(self, value: Any) -> bytes:
        import json

        return json.dumps(value, separators=(",", ":")).encode()

    def deserialize(self, data: bytes) -> Any:
        import json

        return json.loads(data)


BYTES = BytesSerializer()


# ------------------------------------------------------------------------------- contexts


class TransactionContext:
    """The application's code that builds one transaction; subclass it.

    Required: :meth:`partition_id` and :meth:`execute`. Optional outcome callbacks, each called at
    most once except :meth:`on_lock_failure` (once per lock failure):

    * ``on_completion(True)`` - this client saw its transaction committed in the feed (called
      *before* ``apply_transaction`` of it); ``on_completion(False)`` - ``execute`` returned False;
    * ``on_application()`` - ``apply_transaction`` of this transaction succeeded;
    * ``on_exception(exc)`` - ``execute`` raised, or the client closed with the outcome unknown;
      terminal, no retry;
    * ``on_lock_failure()`` - informational; the client re-executes after it consumed the
      conflicting transaction;
    * ``on_expiration()`` - the deadline passed or the retry limit was reached before success;
      terminal.

    Expiry (the original documented it but never built it): pass ``timeout`` (seconds from
    construction) and/or ``max_retries`` (re-executions after the first attempt) to
    ``super().__init__``, or set them as class attributes. It is checked before every
    (re-)execution; a transaction already in flight is never withdrawn.
    """

    timeout: float | None = None
    max_retries: int | None = None

    def __init__(self, *, timeout: float | None = None, max_retries: int | None = None) -> None:
        self.creation_time = time.time()
        self._created_monotonic = time.monotonic()
        if timeout is not None:
            self.timeout = timeout
        if max_retries is not None:
            self.max_retries = max_retries

    # -- application code
    def partition_id(self, num_partitions: int) -> int:
        """The partition of this transaction (``0 <= id < num_partitions``)."""
        raise NotImplementedError

    def execute(self, builder: TransactionBuilder) -> bool | Awaitable[bool]:
        """Fill ``builder``; return False to drop the transaction. May run many times (every retry).

        May be ``async def`` with :class:`~waltz_core.client.AsyncWaltzClient` (so may the outcome
        callbacks below); plain functions with :class:`~waltz_core.client.WaltzClient`."""
        raise NotImplementedError

    # -- outcome callbacks
    def on_completion(self, result: bool) -> Awaitable[None] | None:
        """Committed (True, before its apply) or dropped by ``execute`` (False)."""

    def on_application(self) -> Awaitable[None] | None:
        """``apply_transaction`` of this client's own transaction succeeded."""

    def on_exception(self, exc: BaseException) -> Awaitable[None] | None:
        """``execute`` raised or the client closed; no retry follows."""

    def on_lock_failure(self) -> Awaitable[None] | None:
        """The server rejected an attempt on an optimistic-lock conflict (a retry follows)."""

    def on_expiration(self) -> Awaitable[None] | None:
        """Deadline or retry limit reached; no retry follows."""

    # -- expiry bookkeeping (used by the client)
    def _expired(self, attempts: int, now: float | None = None) -> bool:
        """True if another execution (``attempts`` done so far) is not allowed."""
        limit = self.max_retries
        if limit is not None and attempts > limit:
            return True
        if self.timeout is not None:
            created = getattr(self, "_created_monotonic", None)
            if created is None:  # a subclass that did not call super().__init__()
                created = self._created_monotonic = time.monotonic()
            return (time.monotonic() if now is None else now) - created > self.timeout
        return False


class TransactionBuilder:
    """Collects what ``execute`` decides: header, data, write/read/append locks.

    ``client_high_water_mark`` is the partition's client high-water mark taken before ``execute``
    was called: the transaction is checked against every lock committed after it.
    """

    __slots__ = ("partition_id", "client_high_water_mark", "header", "data", "checksum", "write_locks",
                 "read_locks", "append_locks")

    def __init__(self, partition_id: int, client_high_water_mark: int) -> None:
        self.partition_id = partition_id
        self.client_high_water_mark = client_high_water_mark
        self.header = 0
        self.data = b""
        self.checksum = 0  # crc32(b"") == 0
        self.write_locks: tuple[int, ...] = ()
        self.read_locks: tuple[int, ...] = ()
        self.append_locks: tuple[int, ...] = ()

    def set_header(self, header: int) -> None:
        """A 32-bit application value streamed with the feed (signed int32)."""
        if not -(2**31) <= header < 2**31:
            raise ValueError(f"header {header} does not fit a signed 32-bit int")
        self.header = header

    def set_transaction_data(self, value: Any, serializer: Serializer[Any] | None = None) -> None:
        """Serialize ``value`` now (raw ``bytes`` need no serializer) and attach its CRC-32."""
        if serializer is None:
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise TypeError("transaction data without a serializer must be bytes")
            data = bytes(value)
        else:
            data = serializer.serialize(value)
        self.data = data
        self.checksum = crc32(data)

    def set_write_locks(self, locks: Iterable[PartitionLocalLock]) -> None:
        """Fail if any lock was written/appended after the client high-water mark; advance them on commit."""
        self.write_locks = _hashes(locks)

    def set_read_locks(self, locks: Iterable[PartitionLocalLock]) -> None:
        """Checked like write locks, but not advanced (readers never fail each other)."""
        self.read_locks = _hashes(locks)

    def set_append_locks(self, locks: Iterable[PartitionLocalLock]) -> None:
        """Not checked, but advanced on commit (appenders never fail each other)."""
        self.append_locks = _hashes(locks)


def _hashes(locks: Iterable[PartitionLocalLock]) -> tuple[int, ...]:
    out = []
    for lock in locks:
        if not isinstance(lock, PartitionLocalLock):
            raise TypeError(f"locks must be PartitionLocalLock, got {type(lock).__name__}")
        out.append(lock.lock_hash)
    return tuple(out)


# ------------------------------------------------------------------------------ callbacks


class WaltzClientCallbacks:
    """The application's side of the feed; subclass it (methods may be ``async def`` with
    :class:`~waltz_core.client.AsyncWaltzClient`).

    * ``client_high_water_mark(partition)`` - the id of the last transaction the application
      applied (-1: none); read when the partition is mounted;
    * ``apply_transaction(txn)`` - called strictly in transaction-id order per partition, without
      gaps, for every committed transaction of every client; the application must persist its
      new high-water mark (``txn.transaction_id``) atomically with its changes;
    * ``uncaught_exception(partition, txn_id, exc)`` - ``apply_transaction`` raised: the client
      high-water mark is not advanced and the transaction is delivered again after a re-mount.
    """

    def client_high_water_mark(self, partition_id: int) -> int | Awaitable[int]:
        raise NotImplementedError

    def apply_transaction(self, transaction: Transaction) -> Awaitable[None] | None:
        raise NotImplementedError

    def uncaught_exception(self, partition_id: int, transaction_id: int,
                           exc: BaseException) -> Awaitable[None] | None:
        """Default: nothing (the client logs the exception)."""


class TransactionDataSource(Protocol):
    """Where a :class:`Transaction` gets its data (the client's :class:`~.readahead.DataReader`)."""

    def take(self, partition_id: int, transaction_id: int) -> bytes | None:
        """The data if it is at hand already (any thread, never blocks), else None."""
        ...

    async def read(self, partition_id: int, transaction_id: int) -> bytes:
        """The data, fetched if needed (on the client's event loop)."""
        ...

    def read_blocking(self, partition_id: int, transaction_id: int) -> bytes:
        """The data, from a thread other than the client's event loop (ClientError there)."""
        ...


class Transaction:
    """A committed transaction handed to ``apply_transaction``.

    Its data is not in the feed: :meth:`fetch_data` (async) or :meth:`get_data` (blocking, not
    on the client's event loop) fetch it by RPC from the partition's server, check its CRC-32
    (up to ``client.data_fetch_attempts`` attempts on a mismatch) and retry RPC failures with
    backoff (10 ms doubling to 5 s) until ``client.data_fetch_timeout``. The bytes are cached on
    the object.

    Fetching transactions of a partition in order (as ``apply_transaction`` sees them) turns on
    the client's read-ahead: it fetches ranges of following transactions in one RPC each
    (up to ``client.data_read_ahead``) and keeps them briefly, so most fetches do not wait for
    an RPC at all (:mod:`waltz_core.client.readahead`). Other access patterns fetch one
    transaction per RPC.
    """

    __slots__ = ("partition_id", "transaction_id", "header", "_req", "_source", "_data")

    def __init__(self, partition_id: int, transaction_id: int, header: int,
                 req_id: ReqId | tuple[int, int, int, int, int, int],
                 source: TransactionDataSource | None) -> None:
        self.partition_id = partition_id
        self.transaction_id = transaction_id
        self.header = header
        #: the ReqId, or (from the client's feed) the fields of the feed record it is made of when
        #: first read: most applications never read it, and one is not made per transaction
        self._req = req_id
        self._source = source
        self._data: bytes | None = None

    @property
    def req_id(self) -> ReqId:
        """The id of the append request that made this transaction."""
        req = self._req
        if isinstance(req, tuple):
            req = self._req = ReqId(req[0], req[1], req[2], req[3])
        return req

    @req_id.setter
    def req_id(self, value: ReqId) -> None:
        self._req = value

    def __repr__(self) -> str:
        return f"Transaction(partition={self.partition_id}, id={self.transaction_id}, header={self.header})"

    async def fetch_data(self, serializer: Serializer[Any] | None = None) -> Any:
        """The data, deserialized (raw bytes without a serializer). Runs on the client's loop."""
        if self._data is None:
            source = self._source
            if source is None:
                raise ClientError("this transaction is not bound to a client")
            data = source.take(self.partition_id, self.transaction_id)  # read ahead already: no coroutine
            if data is None:
                data = await source.read(self.partition_id, self.transaction_id)
            self._data = data
        return self._data if serializer is None else serializer.deserialize(self._data)

    def get_data(self, serializer: Serializer[Any] | None = None) -> Any:
        """Blocking variant of :meth:`fetch_data`, for threads other than the client's loop."""
        if self._data is None:
            source = self._source
            if source is None:
                raise ClientError("this transaction is not bound to a client")
            self._data = source.read_blocking(self.partition_id, self.transaction_id)
        return self._data if serializer is None else serializer.deserialize(self._data)


class DataTransaction(Transaction):
    """A transaction whose data is already known (mock feeds and tests)."""

    __slots__ = ()

    def __init__(self, partition_id: int, transaction_id: int, header: int, req_id: ReqId, data: bytes) -> None:
        super().__init__(partition_id, transaction_id, header, req_id, None)
        self._data = data


__all__: Sequence[str] = [
    "BYTES", "BytesSerializer", "DataTransaction", "JsonSerializer", "Serializer", "Transaction",
    "TransactionBuilder", "TransactionContext", "TransactionDataSource", "Utf8Serializer", "WaltzClientCallbacks",
]
