"""The server's caches of recent transactions: feed frames for feeds, data for data RPCs.

Each partition has its own :class:`FeedCache` and :class:`DataCache` (contiguous by transaction
id, oldest first), but their bytes count against one :class:`CacheBudget` per kind for the whole
server (``server.feed_cache_budget``, ``server.data_cache_budget``): a busy partition may use
most of it, an idle one nothing, and the server's cache memory is known in advance whatever the
number of partitions it owns. When a budget is exceeded the globally oldest entries go first.

Costs on the commit path: a partition adds every committed transaction to its caches (an append,
no accounting), then charges the budget once per commit batch (:meth:`FeedCache.settle`), which
records (cache, generation, count) in the budget's FIFO, whose own bytes are charged too; eviction
pops from the head of that FIFO. A cache that is emptied (a session reset, a closed partition)
bumps its generation, so its stale FIFO entries are skipped. Entry costs are measured, not guessed (tracemalloc on CPython
3.11): a 29-byte feed frame in a deque is 70 bytes; a data entry is 16 bytes of slots in two chunks, plus the
33-byte header of the data's ``bytes`` and its 32-byte checksum ``int``.
"""

from __future__ import annotations

from collections import deque

#: Bytes one cached feed frame costs (29-byte FeedData payload plus object and deque overhead).
FRAME_COST = 72
#: Bytes one cached data entry costs beyond its data: two slots of a chunk (16), the bytes header
#: (33), the checksum int (32); a partition's cache also holds up to two partly used chunks.
DATA_ENTRY_OVERHEAD = 81
#: Bytes the slot of an entry too large to cache costs (two slots of a chunk).
SKIPPED_DATA_COST = 16
#: Entries per chunk of a :class:`DataCache` (4 KiB of slots per chunk and kind).
DATA_CHUNK = 512
#: Bytes one settled batch costs in a budget's FIFO (a slot in each of three deques).
FIFO_ENTRY_COST = 24


class CacheBudget:
    """Bytes shared by one kind of cache of every partition of a server.

    The FIFO of settled batches is three parallel deques (owner, generation, entries): 24 bytes a
    batch, charged to the budget too - with one-record commit batches on many partitions there
    are as many batches as entries, and an uncounted FIFO would double a feed cache's memory.
    """

    __slots__ = ("limit", "used", "_owners", "_generations", "_counts")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._owners: deque[_BudgetedCache] = deque()
        self._generations: deque[int] = deque()
        self._counts: deque[int] = deque()

    def charge(self, cache: _BudgetedCache, count: int, nbytes: int) -> None:
        """``count`` entries of ``nbytes`` were added to ``cache``; evict the oldest if over the limit."""
        owners, counts = self._owners, self._counts
        if owners and owners[-1] is cache and self._generations[-1] == cache.generation:
            counts[-1] += count  # consecutive batches of one partition: one FIFO entry
        else:
            owners.append(cache)
            self._generations.append(cache.generation)
            counts.append(count)
            nbytes += FIFO_ENTRY_COST
        self.used += nbytes
        while self.used > self.limit and owners:
            owner, entries = owners[0], counts[0]
            if self._generations[0] != owner.generation:
                self._pop()  # emptied since: its bytes were already given back
                continue
            evicted, freed = owner.evict_oldest(entries, self.used - self.limit)
            self.used -= freed
            if evicted >= entries or evicted == 0:
                self._pop()
            else:
                counts[0] = entries - evicted

    @property
    def fifo_bytes(self) -> int:
        """Bytes of the FIFO itself (part of ``used``)."""
        return len(self._owners) * FIFO_ENTRY_COST

    def _pop(self) -> None:
        self._owners.popleft()
        self._generations.popleft()
        self._counts.popleft()
        self.used -= FIFO_ENTRY_COST

    def released(self, nbytes: int) -> None:
        """A cache dropped ``nbytes`` by itself (emptied)."""
        self.used -= nbytes


class _BudgetedCache:
    """What the budget needs from a cache."""

    __slots__ = ("budget", "generation", "_bytes", "_pending_count", "_pending_bytes")

    def __init__(self, budget: CacheBudget) -> None:
        self.budget = budget
        self.generation = 0
        self._bytes = 0  #: charged to the budget
        self._pending_count = 0  #: added since the last settle()
        self._pending_bytes = 0

    def settle(self) -> None:
        """Charge the budget for what was added since the last call (once per commit batch)."""
        if self._pending_count:
            count, nbytes = self._pending_count, self._pending_bytes
            self._pending_count = self._pending_bytes = 0
            self._bytes += nbytes
            self.budget.charge(self, count, nbytes)

    def evict_oldest(self, count: int, nbytes: int) -> tuple[int, int]:
        """Drop the oldest *settled* entries, at most ``count``, until ``nbytes`` are freed:
        (entries dropped, bytes freed)."""
        raise NotImplementedError

    def _emptied(self) -> None:
        self.generation += 1
        self.budget.released(self._bytes)
        self._bytes = self._pending_count = self._pending_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds now (settled or not)."""
        return self._bytes + self._pending_bytes


class FeedCache(_BudgetedCache):
    """Recent feed frames (encoded FeedData) of one partition, contiguous by transaction id.

    A commit is encoded once, here; every mounted client's feed posts the same bytes.
    """

    __slots__ = ("_frames", "_first")

    def __init__(self, budget: CacheBudget) -> None:
        super().__init__(budget)
        self._frames: deque[bytes] = deque()
        self._first = 0  # transaction id of _frames[0]

    def reset(self, next_transaction_id: int) -> None:
        """Empty the cache; the next frame added must be ``next_transaction_id``'s."""
        self._frames.clear()
        self._first = next_transaction_id
        self._emptied()

    def add(self, transaction_id: int, frame: bytes) -> None:
        frames = self._frames
        if transaction_id != self._first + len(frames):
            # Not contiguous (after a reset or a gap): restart the window at this transaction.
            self.reset(transaction_id)
        frames.append(frame)
        self._pending_count += 1
        self._pending_bytes += FRAME_COST

    def add_many(self, first_transaction_id: int, frames: list[bytes]) -> None:
        """:meth:`add` of ``frames`` for ``first_transaction_id, first_transaction_id + 1, ...``
        (a commit batch: one check and one count for all of them)."""
        cached = self._frames
        if first_transaction_id != self._first + len(cached):
            self.reset(first_transaction_id)  # as add() does for the first of them
        cached.extend(frames)
        n = len(frames)
        self._pending_count += n
        self._pending_bytes += n * FRAME_COST

    def evict_oldest(self, count: int, nbytes: int) -> tuple[int, int]:
        frames = self._frames
        n = min(count, len(frames) - self._pending_count, -(-nbytes // FRAME_COST))
        for _ in range(n):
            frames.popleft()
        self._first += n
        self._bytes -= n * FRAME_COST
        return n, n * FRAME_COST

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


class DataCache(_BudgetedCache):
    """Recent transaction data of one partition, contiguous by transaction id, oldest first.

    Slots in fixed chunks of :data:`DATA_CHUNK` (a chunk of data, a chunk of checksums), held in
    deques: an entry is a slot store, eviction clears slots and drops a chunk once all of it is
    evicted, a read is two index operations. No operation touches more than one chunk, so none
    stalls the event loop: an ``OrderedDict`` keyed by id, as this was, rebuilt its whole table
    now and then as ids came and went (9 ms in one insert at 130,000 entries, 61 ms at 260,000,
    with every transaction in flight waiting: the open loop's p99.9), and one flat list would
    reallocate (and fault in) megabytes at a time. Entries larger than a quarter of the budget
    are not cached (as the original): their slot holds None.
    """

    __slots__ = ("_data", "_checksums", "_base", "_head", "_end", "_max_item")

    def __init__(self, budget: CacheBudget) -> None:
        super().__init__(budget)
        self._data: deque[list[bytes | None]] = deque()
        self._checksums: deque[list[int]] = deque()
        self._base = 0  #: transaction id of the first slot of the first chunk
        self._head = 0  #: offset (from ``_base``) of the oldest entry still cached
        self._end = 0  #: offset of the slot the next entry goes to
        self._max_item = budget.limit // 4

    def put(self, transaction_id: int, data: bytes, checksum: int) -> None:
        """Cache the data of ``transaction_id``: the id after the newest, or the cache starts
        again from it (a new store session assigns ids anew)."""
        end = self._end
        if transaction_id != self._base + end:
            self.clear()
            self._base = transaction_id
            end = 0
        slot = end % DATA_CHUNK
        if slot == 0:
            self._data.append([None] * DATA_CHUNK)
            self._checksums.append([0] * DATA_CHUNK)
        size = len(data)
        if size > self._max_item:
            self._pending_bytes += SKIPPED_DATA_COST  # the slot stays None
        else:
            self._data[-1][slot] = data
            self._checksums[-1][slot] = checksum
            self._pending_bytes += size + DATA_ENTRY_OVERHEAD
        self._pending_count += 1
        self._end = end + 1

    def evict_oldest(self, count: int, nbytes: int) -> tuple[int, int]:
        head = self._head
        limit = min(count, self._end - head - self._pending_count)
        chunks = self._data
        n = freed = 0
        while n < limit and freed < nbytes:
            chunk = chunks[0]
            slot = head % DATA_CHUNK
            data = chunk[slot]
            if data is None:
                freed += SKIPPED_DATA_COST
            else:
                chunk[slot] = None
                freed += len(data) + DATA_ENTRY_OVERHEAD
            n += 1
            head += 1
            if slot == DATA_CHUNK - 1:  # the whole first chunk is evicted
                chunks.popleft()
                self._checksums.popleft()
                head -= DATA_CHUNK
                self._end -= DATA_CHUNK
                self._base += DATA_CHUNK
        self._head = head
        self._bytes -= freed
        return n, freed

    def get(self, transaction_id: int) -> tuple[bytes, int] | None:
        """(data, checksum) of ``transaction_id``, or None when it is not cached."""
        offset = transaction_id - self._base
        if offset < self._head or offset >= self._end:
            return None
        chunk, slot = divmod(offset, DATA_CHUNK)
        data = self._data[chunk][slot]
        return None if data is None else (data, self._checksums[chunk][slot])

    def clear(self) -> None:
        self._data.clear()
        self._checksums.clear()
        self._head = self._end = 0
        self._emptied()
