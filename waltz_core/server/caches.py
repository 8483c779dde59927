"""The server's caches of recent transactions: feed frames for feeds, data for data RPCs.

Both are bounded by bytes (``feed_cache_size``, ``transaction_data_cache_size``) and hold the
most recent committed transactions of one partition; anything older is read from storage.
"""

from __future__ import annotations

from collections import OrderedDict, deque

#: Approximate bytes one cached feed frame costs (29-byte FeedData payload plus object overhead).
FRAME_COST = 72


class FeedCache:
    """Recent feed frames (encoded FeedData) of one partition, contiguous by transaction id.

    A commit is encoded once, here; every mounted client's feed posts the same bytes.
    """

    __slots__ = ("_frames", "_first", "_capacity")

    def __init__(self, capacity_bytes: int) -> None:
        self._frames: deque[bytes] = deque()
        self._first = 0  # transaction id of _frames[0]
        self._capacity = max(64, capacity_bytes // FRAME_COST)

    def reset(self, next_transaction_id: int) -> None:
        """Empty the cache; the next frame added must be ``next_transaction_id``'s."""
        self._frames.clear()
        self._first = next_transaction_id

    def add(self, transaction_id: int, frame: bytes) -> None:
        frames = self._frames
        if transaction_id != self._first + len(frames):
            # Not contiguous (after a reset or a gap): restart the window at this transaction.
            frames.clear()
            self._first = transaction_id
        frames.append(frame)
        if len(frames) > self._capacity:
            frames.popleft()
            self._first += 1

    def get(self, first: int, max_count: int) -> list[bytes] | None:
        """Frames of ``first, first+1, ...`` (at most ``max_count``) or None when ``first`` is not cached."""
        start = first - self._first
        frames = self._frames
        if start < 0 or start >= len(frames):
            return None
        end = min(len(frames), start + max_count)
        if start == 0 and end == len(frames):
            return list(frames)
        return [frames[i] for i in range(start, end)]


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
