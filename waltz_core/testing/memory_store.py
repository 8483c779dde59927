"""An in-memory :class:`~waltz_core.server.partition.Store`: the storage under the mock cluster.

A :class:`MemoryLog` is the durable log of one partition (what storage nodes hold), and lives as
long as the cluster. A :class:`MemoryStore` is one store session over it, opened by one
:class:`~waltz_core.server.partition.Partition` object (one generation), as the server's
``ReplicatedStore`` is; a newer session fences the older ones.

The contract the partition relies on, kept here:

* :meth:`MemoryStore.append` assigns the next transaction id and returns at once; the commit
  arrives later, from the store's own task, through ``sink.on_committed`` - never from inside
  ``append`` (the partition records the append as pending only after ``append`` returns).
* Commits reach the sink in transaction-id order, several at once when they are due together
  (group commit). :attr:`MemoryStore.commit_delay` draws each append's delay (the mock cluster's
  ``set_max_delay``); an append never commits before the one before it, so order is kept.
* At most ``window`` appends are in flight (:attr:`MemoryStore.writable`, :meth:`wait_writable`:
  the server's ``max(4 * max_batch_size, 64)``); :meth:`flush` waits for every append handed over.
* Recovery keeps everything: a new session (:meth:`open`) commits every record in the log, those
  an older session left in flight included - all "replicas" hold all of them. That is one of the
  outcomes the real recovery may choose; clients cannot tell it apart from a quick replication.
* Reads (:meth:`read_headers`, :meth:`read_record`, :meth:`read_records`) see committed records only.

There are no replicas, so nothing can fail here but a closed or fenced session
(:class:`~waltz_core.errors.PartitionNotReadyError`). Everything runs on one event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from ..errors import PartitionNotReadyError
from ..protocol.wire import Record, RecordHeader, ReqId
from ..server.partition import StoreSink


def no_delay() -> float:
    """The default commit delay: commit on the next turn of the loop."""
    return 0.0


@attrs.define(slots=True, eq=False)
class MemoryLog:
    """Every record appended to one partition, in transaction-id order, and its commit point."""

    records: list[Record] = attrs.Factory(list)
    #: highest committed transaction id (-1: none)
    high_water_mark: int = -1
    #: the newest store session; an older one may no longer append
    session: int = 0

    def committed(self) -> list[Record]:
        """The committed records (a copy, safe to take from another thread)."""
        return self.records[:self.high_water_mark + 1]


class MemoryStore:
    """One store session over a :class:`MemoryLog` (see the module docstring)."""

    def __init__(self, log: MemoryLog, *, window: int = 64, commit_delay: Callable[[], float] = no_delay) -> None:
        self.log = log
        self.window = window
        #: seconds the next append waits before it commits (read once per append)
        self.commit_delay = commit_delay
        self.high_water_mark = -1
        self._session = -1
        self._sink: StoreSink | None = None
        self._last_assigned = -1
        self._due: deque[tuple[int, float]] = deque()  # (transaction id, loop time it commits at)
        self._last_due = 0.0
        self._appended = asyncio.Event()
        self._changed = asyncio.Event()
        self._committer: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------------------- lifecycle

    async def open(self, sink: StoreSink) -> int:
        if self._closed:
            raise PartitionNotReadyError("the store was closed before it opened")
        log = self.log
        log.session += 1
        self._session = log.session
        log.high_water_mark = len(log.records) - 1  # recovery keeps every record (module docstring)
        self.high_water_mark = self._last_assigned = log.high_water_mark
        self._sink = sink
        self._committer = asyncio.get_running_loop().create_task(self._commit_loop(), name="memory-store-commits")
        return self.high_water_mark

    async def close(self) -> None:
        self._closed = True
        if self._committer is not None:
            self._committer.cancel()
            await asyncio.gather(self._committer, return_exceptions=True)
        self._notify()

    # ------------------------------------------------------------------- the Store protocol

    def append(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> int:
        log = self.log
        if self._closed or self._sink is None or self._session != log.session:
            raise PartitionNotReadyError("no store session (closed, or fenced by a newer one)")
        txn = len(log.records)
        log.records.append(Record(txn, req_id, header, data, checksum))
        self._last_assigned = txn
        # Never before the previous append: commits stay in transaction-id order.
        self._last_due = max(self._last_due, asyncio.get_running_loop().time() + self.commit_delay())
        self._due.append((txn, self._last_due))
        self._appended.set()
        return txn

    def append_if_writable(self, req_id: ReqId, header: int, data: bytes, checksum: int) -> int | None:
        return self.append(req_id, header, data, checksum) if self.writable else None

    @property
    def writable(self) -> bool:
        return not self._closed and self._sink is not None and self._last_assigned - self.high_water_mark < self.window

    async def wait_writable(self) -> None:
        while not self._closed:
            if self.writable:
                return
            await self._changed.wait()
        raise PartitionNotReadyError("the store is closed")

    async def flush(self) -> None:
        target = self._last_assigned
        while not self._closed and self.high_water_mark < target:
            await self._changed.wait()

    async def read_headers(self, first: int, max_count: int) -> Sequence[RecordHeader]:
        return [RecordHeader(r.transaction_id, r.req_id, r.header) for r in self._committed(first, max_count)]

    async def read_record(self, transaction_id: int) -> Record | None:
        records = self._committed(transaction_id, 1)
        return records[0] if records else None

    async def read_records(self, first: int, max_count: int) -> Sequence[Record]:
        return self._committed(first, max_count)

    @property
    def healthy(self) -> bool:
        return not self._closed and self._sink is not None and self._session == self.log.session

    @property
    def buffered_bytes(self) -> int:
        return 0  # no replicas to buffer for

    # -------------------------------------------------------------------------- internals

    def _committed(self, first: int, max_count: int) -> list[Record]:
        if first < 0 or max_count < 1:
            return []
        return self.log.records[first:min(first + max_count, self.high_water_mark + 1)]

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _commit_loop(self) -> None:
        loop = asyncio.get_running_loop()
        due = self._due
        while True:
            if not due:
                self._appended.clear()
                await self._appended.wait()
                continue
            wait = due[0][1] - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            now = loop.time()
            last = -1
            while due and due[0][1] <= now:
                last = due.popleft()[0]
            if last < 0:
                continue
            self.high_water_mark = last
            if self._session == self.log.session:  # a fenced session must not move the log's commit point
                self.log.high_water_mark = last
            assert self._sink is not None
            self._sink.on_committed(last)
            self._notify()
