"""The server's caches of recent transactions: headers for feeds, data for data RPCs.

Both are bounded by bytes (``feed_cache_size``, ``transaction_data_cache_size``) and hold the
most recent committed transactions of one partition; anything older is read from storage.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from ..protocol.wire import RecordHeader

#: Approximate bytes one cached header costs (transaction id, request id, header, object overhead).
HEADER_COST = 40


class FeedCache:
    """Recent record headers of one partition, contiguous by transaction id."""

    __slots__ = ("_headers", "_first", "_capacity")

    def __init__(self, capacity_bytes: int) -> None:
        self._headers: deque[RecordHeader] = deque()
        self._first = 0  # transaction id of _headers[0]
        self._capacity = max(64, capacity_bytes // HEADER_COST)

    def reset(self, next_transaction_id: int) -> None:
        """Empty the cache; the next header added must be ``next_transaction_id``."""
        self._headers.clear()
        self._first = next_transaction_id

    def add(self, header: RecordHeader) -> None:
        headers = self._headers
        if header.transaction_id != self._first + len(headers):
            # Not contiguous (after a reset or a gap): restart the window at this header.
            headers.clear()
            self._first = header.transaction_id
        headers.append(header)
        if len(headers) > self._capacity:
            headers.popleft()
            self._first += 1

    def get(self, first: int, max_count: int) -> list[RecordHeader] | None:
        """Headers ``first, first+1, ...`` (at most ``max_count``) or None when ``first`` is not cached."""
        start = first - self._first
        if start < 0 or start >= len(self._headers):
            return None
        headers = self._headers
        end = min(len(headers), start + max_count)
        if start == 0 and end == len(headers):
            return list(headers)
        return [headers[i] for i in range(start, end)]


class DataCache:
    """Recent transaction data, by transaction id, bounded by total bytes (LRU)."""

    __slots__ = ("_items", "_bytes", "_capacity", "_max_item")

    def __init__(self, capacity_bytes: int) -> None:
        self._items: OrderedDict[int, tuple[bytes, int]] = OrderedDict()
        self._bytes = 0
        self._capacity = capacity_bytes
        self._max_item = capacity_bytes // 4  # as the original: big items are not cached

    def put(self, transaction_id: int, data: bytes, checksum: int) -> None:
        size = len(data)
        if size > self._max_item:
            return
        self._items[transaction_id] = (data, checksum)
        self._bytes += size
        while self._bytes > self._capacity and self._items:
            _, (old, _) = self._items.popitem(last=False)
            self._bytes -= len(old)

    def get(self, transaction_id: int) -> tuple[bytes, int] | None:
        return self._items.get(transaction_id)

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0
