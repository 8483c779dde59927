"""Transaction data by range, and the adaptive read-ahead behind ``Transaction.fetch_data``.

The seed fetches each transaction's data with one RPC. Applications mostly read a partition in
order (``apply_transaction`` is called in transaction-id order), so the client does what a
filesystem does for a file read sequentially:

* a fetch of transaction ``t`` right after ``t - 1`` of the same partition (or at the edge of the
  current window) is *sequential*: the client fetches a range ``t, t + 1, ...`` in one
  ``TransactionDataRangeRequest``, 4 transactions the first time, doubling per range up to
  ``client.data_read_ahead`` (and about :data:`READ_AHEAD_MAX_BYTES` of data);
* when the application takes the first transaction of a range that arrived, the next range is
  requested (asynchronous read-ahead), so the RPC overlaps the application's work;
* ranges are kept in a small per-partition window; what the application has passed is dropped
  when the next range arrives, and everything once it took the last one;
* any other fetch is *random*: the window is dropped and the transaction is fetched alone (one
  ``TransactionDataRequest``), as before.

Read-ahead never goes beyond the last transaction this client received in the partition's feed
(it is committed), so a reader at the head of the log costs no extra RPCs. A server that speaks
only protocol version 1 gets one ``TransactionDataRequest`` per transaction, ranges included.
The RPCs themselves, their retries and checksum checks are :mod:`.rpc`'s.

:class:`DataReader` is the :class:`~.api.TransactionDataSource` of the client's transactions.

Threading: fetching runs on the client's event loop. :meth:`DataReader.take` (a window hit) is
also called by ``Transaction.get_data`` on the sync client's consumer threads, so what it reads
and writes in a window is guarded by the window's lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from ..errors import ClientError
from ..protocol.session import SessionState
from .rpc import verified

if TYPE_CHECKING:
    from .context import ClientContext
    from .rpc import Rpc

log = logging.getLogger("waltz.client")

READ_AHEAD_START = 4  #: transactions of the first range a sequential reader gets
READ_AHEAD_MAX_BYTES = 1024 * 1024  #: data bytes asked for per range (at most a quarter of the max frame size)
RANGE_REQUEST_MAX = 1024  #: transactions asked for per RPC by fetch_data_range (servers cap at 1024 too)
_NEVER = 2**63


class _Window:
    """Read-ahead state of one partition."""

    __slots__ = ("lock", "base", "items", "last", "size", "marker", "pending", "pending_first", "pending_end")

    def __init__(self) -> None:
        self.lock = threading.Lock()  #: guards base, items, last, size and marker
        self.base = 0  #: transaction id of items[0]
        self.items: list[bytes] = []  #: data of base, base + 1, ...
        self.last = -2  #: the transaction the application fetched last
        self.size = 0  #: current read-ahead in transactions; 0: not reading sequentially
        self.marker = _NEVER  #: taking this transaction (or a later one) starts the next read-ahead
        # event loop only:
        self.pending: asyncio.Future[None] | None = None  #: resolved when the range in flight arrived or failed
        self.pending_first = 0
        self.pending_end = 0  #: exclusive

    def store(self, first: int, data: list[bytes]) -> None:
        """Keep a range that arrived (event loop): append it to what the application has not
        passed yet, or replace the window when it does not follow on."""
        with self.lock:
            if self.size == 0:
                return  # random access since it was asked for: not wanted any more
            keep_from = max(self.base, self.last + 1)
            end = self.base + len(self.items)
            if first == end and keep_from <= end:
                items = self.items[keep_from - self.base:]
                items.extend(data)
                self.items = items
                self.base = keep_from
            else:
                self.items = list(data)
                self.base = first
            self.marker = first


class DataReader:
    """Transaction data fetches of one client (ranges, read-ahead)."""

    def __init__(self, ctx: ClientContext, rpc: Rpc) -> None:
        self._ctx = ctx
        self._rpc = rpc
        cfg = ctx.config
        self._max_window = max(0, cfg.client.data_read_ahead)
        self._max_bytes = max(1, min(READ_AHEAD_MAX_BYTES, cfg.transport.max_frame_size // 4))
        self._windows: dict[int, _Window] = {}  # created on the loop; read from any thread

    def forget(self, partition_id: int) -> None:
        """Drop a partition's window (it is no longer mounted)."""
        self._windows.pop(partition_id, None)

    # ----------------------------------------------------------------- single transactions

    def take(self, partition_id: int, transaction_id: int) -> bytes | None:
        """The data if the read-ahead window holds it (any thread), else None."""
        window = self._windows.get(partition_id)
        if window is None:
            return None
        with window.lock:
            i = transaction_id - window.base
            items = window.items
            if i < 0 or i >= len(items):
                return None
            data = items[i]
            window.last = transaction_id
            if i == len(items) - 1:  # the application reached the end: release the window's memory
                window.items = []
                window.base = transaction_id + 1
            ahead = transaction_id >= window.marker
            if ahead:
                window.marker = _NEVER
        if ahead:
            ctx = self._ctx
            loop = ctx.loop
            if ctx.on_loop_thread():
                self._read_ahead(partition_id, window)
            elif loop is not None and not ctx.closed:
                loop.call_soon_threadsafe(self._read_ahead, partition_id, window)
        return data

    def read_blocking(self, partition_id: int, transaction_id: int) -> bytes:
        """:meth:`read` from a thread other than the client's loop (``Transaction.get_data``)."""
        ctx = self._ctx
        loop = ctx.loop
        if loop is None:
            raise ClientError("the client is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or ctx.on_loop_thread():
            raise ClientError("Transaction.get_data() would block the client's event loop: "
                              "use 'await transaction.fetch_data()' there")
        data = self.take(partition_id, transaction_id)  # read ahead already: no hop to the loop
        if data is None:
            data = asyncio.run_coroutine_threadsafe(self.read(partition_id, transaction_id), loop).result()
        return data

    async def read(self, partition_id: int, transaction_id: int) -> bytes:
        """The data of one transaction, through the read-ahead window (event loop)."""
        data = self.take(partition_id, transaction_id)
        if data is not None:
            return data
        window = self._windows.get(partition_id)
        if window is None:
            window = self._windows[partition_id] = _Window()
        while (pending := window.pending) is not None and window.pending_first <= transaction_id <= window.pending_end:
            await asyncio.shield(pending)  # the range in flight brings it, or ends where it starts
            data = self.take(partition_id, transaction_id)
            if data is not None:
                return data
        max_window = self._max_window
        with window.lock:
            end = window.base + len(window.items)
            sequential = max_window > 1 and (transaction_id == window.last + 1 or
                                             (window.size > 0 and end <= transaction_id < end + max_window))
            window.last = transaction_id
            if sequential:
                window.size = READ_AHEAD_START if window.size == 0 else window.size * 2
                window.size = min(window.size, max_window)
                size = window.size
            else:  # random access: one transaction per RPC, nothing kept
                window.size = 0
                window.items = []
                window.base = transaction_id + 1
                window.marker = _NEVER
        if not sequential:
            return (await self._rpc.fetch_data(partition_id, transaction_id, 1, 1))[0]
        count = max(1, self._committed_count(partition_id, transaction_id, size))
        loop = asyncio.get_running_loop()
        window.pending = done = loop.create_future()
        window.pending_first, window.pending_end = transaction_id, transaction_id + count
        try:
            data_list = await self._rpc.fetch_data(partition_id, transaction_id, count, self._max_bytes)
            window.store(transaction_id, data_list)
        finally:
            if window.pending is done:
                window.pending = None
            done.set_result(None)
        return data_list[0]

    def _committed_count(self, partition_id: int, first: int, wanted: int) -> int:
        """``wanted``, capped at the last transaction received in the feed (known committed) when
        this client mounts the partition: a reader at the head of the log asks for nothing more."""
        p = self._ctx.partitions.get(partition_id)
        if p is None or p.state is SessionState.INACTIVE:
            return wanted
        return min(wanted, p.session.received - first + 1)

    def _read_ahead(self, partition_id: int, window: _Window) -> None:
        """Start fetching the range after the window (event loop), unless one is in flight."""
        ctx = self._ctx
        if window.pending is not None or ctx.closed or self._windows.get(partition_id) is not window:
            return
        with window.lock:
            if window.size == 0:
                return
            window.size = min(window.size * 2, self._max_window)
            first = window.base + len(window.items)
            size = window.size
        count = self._committed_count(partition_id, first, size)
        if count < 1:
            return
        assert ctx.loop is not None
        window.pending = done = ctx.loop.create_future()
        window.pending_first, window.pending_end = first, first + count
        ctx.spawn(self._read_ahead_task(partition_id, window, first, count, done))

    async def _read_ahead_task(self, partition_id: int, window: _Window, first: int, count: int,
                               done: asyncio.Future[None]) -> None:
        """One attempt, no retries: a failure only means the application's next fetch misses and
        fetches (with retries) itself."""
        try:
            data, checksums, _ = await self._rpc.data_range(partition_id, first, count, self._max_bytes)
            good = verified(data, checksums)
            if good:
                window.store(first, list(data[:good]))
        except Exception as exc:  # noqa: BLE001 - whatever failed, the synchronous path takes over
            log.debug("client %d: read-ahead of partition %d from %d failed: %r",
                      self._ctx.client_id, partition_id, first, exc)
        finally:
            if window.pending is done:
                window.pending = None
            if not done.done():
                done.set_result(None)

    # ------------------------------------------------------------------------------ ranges

    async def fetch_range(self, partition_id: int, first: int, count: int) -> list[bytes]:
        """Data of transactions ``first .. first + count - 1`` (see AsyncWaltzClient.fetch_data_range)."""
        ctx = self._ctx
        ctx.check_open()
        if count < 0:
            raise ValueError(f"count must not be negative, got {count}")
        if not 0 <= partition_id < ctx.num_partitions:
            raise ClientError(f"no partition {partition_id}")
        if first < 0:
            raise ClientError(f"no transaction {first}: transaction ids start at 0")
        out: list[bytes] = []
        while len(out) < count:
            out.extend(await self._rpc.fetch_data(partition_id, first + len(out),
                                                  min(count - len(out), RANGE_REQUEST_MAX), self._max_bytes))
        del out[count:]
        return out
