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
3.11): a 29-byte feed frame in a deque is 70 bytes; a data entry is its data copied into a chunk plus
DATA_ENTRY_OVERHEAD bytes.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate

#: Bytes one cached feed frame costs (29-byte FeedData payload plus object and deque overhead).
FRAME_COST = 72
#: Bytes one cached data entry costs beyond its data: its end and checksum in two arrays (16, and
#: their spare room, measured); the chunk being filled may hold up to an eighth more.
DATA_ENTRY_OVERHEAD = 24
#: Bytes the slot of an entry too large to cache costs (its end and checksum).
SKIPPED_DATA_COST = 16
#: Most entries, and about the most data bytes, in one chunk of a :class:`DataCache`: a partition
#: holds at most one chunk of evicted data until its last entry is evicted too.
DATA_CHUNK = 512
DATA_CHUNK_BYTES = 128 * 1024
#: :meth:`DataCache.put_many` joins batches of this many entries or more; smaller ones go through
#: :meth:`DataCache.put` (measured: it costs less below about 4)
PUT_MANY_FROM = 4
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


class _Chunk:
    """Consecutive cached entries: their data end to end in one ``bytearray``, the end of each
    entry and its checksum (-1: the entry is not cached) in arrays. None of the three is a
    container the garbage collector tracks, so a cache of any size costs a collection nothing."""

    __slots__ = ("first", "data", "ends", "checksums")

    def __init__(self, first: int) -> None:
        self.first = first  #: transaction id of the first entry
        #: a bytearray while the chunk fills, then bytes of exactly its size (a growing bytearray
        #: keeps up to an eighth of spare room)
        self.data: bytearray | bytes = bytearray()
        self.ends = array("q")
        self.checksums = array("q")

    def seal(self) -> None:
        """The chunk is full: keep its data without spare room."""
        self.data = bytes(self.data)


class DataCache(_BudgetedCache):
    """Recent transaction data of one partition, contiguous by transaction id, oldest first.

    Entries are copied into chunks (:class:`_Chunk`) of at most :data:`DATA_CHUNK` entries or
    :data:`DATA_CHUNK_BYTES` bytes; an evicted entry is gone at once for readers and its chunk's
    memory is freed when the last entry of the chunk is evicted (so a partition holds at most one
    chunk's bytes beyond what the budget counts). Nothing here is a Python object per entry:
    a dict or list of per-entry objects made every collection of the garbage collector walk the
    cache (a 1.8 ms young collection every 180,000 transactions with lists of slots; an
    ``OrderedDict`` keyed by id also rebuilt its table now and then, 9 ms in one insert at
    130,000 entries and 61 ms at 260,000, with every transaction in flight waiting: the open
    loop's p99.9). Entries larger than a quarter of the budget are not cached (as the original).
    """

    __slots__ = ("_chunks", "_firsts", "_start", "_head", "_next", "_max_item")

    def __init__(self, budget: CacheBudget) -> None:
        super().__init__(budget)
        self._chunks: list[_Chunk | None] = []  #: from ``_start`` on; dropped ones are None until compacted
        self._firsts: list[int] = []  #: first transaction id of each chunk (for bisect)
        self._start = 0  #: index of the oldest chunk still held
        self._head = 0  #: transaction id of the oldest entry still cached
        self._next = 0  #: transaction id the next entry must have
        self._max_item = budget.limit // 4

    def put(self, transaction_id: int, data: bytes, checksum: int) -> None:
        """Cache the data of ``transaction_id``: the id after the newest, or the cache starts
        again from it (a new store session assigns ids anew)."""
        if transaction_id != self._next:
            self.clear()
            self._head = transaction_id
        chunk = self._open_chunk(transaction_id)
        size = len(data)
        if size > self._max_item:
            chunk.checksums.append(-1)
            self._pending_bytes += SKIPPED_DATA_COST
        else:
            chunk.data += data  # the chunk being filled is a bytearray
            chunk.checksums.append(checksum)
            self._pending_bytes += size + DATA_ENTRY_OVERHEAD
        chunk.ends.append(len(chunk.data))
        self._pending_count += 1
        self._next = transaction_id + 1

    def put_many(self, first_transaction_id: int, data: list[bytes], checksums: list[int]) -> None:
        """:meth:`put` of ``first_transaction_id, first_transaction_id + 1, ...`` (a commit
        batch): each chunk's share of them is joined once and its ends and checksums extended
        together; the chunks are cut where :meth:`put` would cut them."""
        n = len(data)
        if n < PUT_MANY_FROM:  # one record a commit (many partitions, low load): put() costs less
            for i in range(n):
                self.put(first_transaction_id + i, data[i], checksums[i])
            return
        sizes = list(map(len, data))
        if max(sizes) > self._max_item:  # some are too large to cache: one at a time
            for i in range(n):
                self.put(first_transaction_id + i, data[i], checksums[i])
            return
        if first_transaction_id != self._next:
            self.clear()
            self._head = first_transaction_id
        i = 0
        while i < n:
            chunk = self._open_chunk(first_transaction_id + i)
            j = min(n, i + DATA_CHUNK - len(chunk.ends))
            # ends[k]: the chunk's bytes before entry i + k; put() adds an entry while they are
            # under DATA_CHUNK_BYTES, so the chunk takes the entries before the first end at or
            # over it (at least one: an open chunk is under it)
            ends = list(accumulate(sizes[i:j], initial=len(chunk.data)))
            k = bisect_left(ends, DATA_CHUNK_BYTES, 0, j - i)
            chunk.data += b"".join(data[i:i + k])  # the chunk being filled is a bytearray
            chunk.ends.extend(ends[1:k + 1])
            chunk.checksums.extend(checksums[i:i + k])
            i += k
        self._pending_count += n
        self._pending_bytes += sum(sizes) + n * DATA_ENTRY_OVERHEAD
        self._next = first_transaction_id + n

    def _open_chunk(self, transaction_id: int) -> _Chunk:
        """The chunk being filled, or a new one from ``transaction_id`` when there is none or it
        is full (sealing it)."""
        chunks = self._chunks
        chunk = chunks[-1] if len(chunks) > self._start else None
        if chunk is None or len(chunk.ends) >= DATA_CHUNK or len(chunk.data) >= DATA_CHUNK_BYTES:
            if chunk is not None:
                chunk.seal()
            chunk = _Chunk(transaction_id)
            chunks.append(chunk)
            self._firsts.append(transaction_id)
        return chunk

    def evict_oldest(self, count: int, nbytes: int) -> tuple[int, int]:
        limit = min(count, self._next - self._head - self._pending_count)
        chunks = self._chunks
        n = freed = 0
        head = self._head
        while n < limit and freed < nbytes:
            chunk = chunks[self._start]
            assert chunk is not None
            k = head - chunk.first
            ends = chunk.ends
            if k >= len(ends):  # every entry of the oldest chunk is evicted: its memory goes
                self._drop_oldest_chunk()
                continue
            if chunk.checksums[k] < 0:
                freed += SKIPPED_DATA_COST
            else:
                freed += ends[k] - (ends[k - 1] if k else 0) + DATA_ENTRY_OVERHEAD
            n += 1
            head += 1
        if chunks and self._start < len(chunks):
            oldest = chunks[self._start]
            if oldest is not None and head - oldest.first >= len(oldest.ends) and oldest is not chunks[-1]:
                self._drop_oldest_chunk()  # the last eviction emptied it
        self._head = head
        self._bytes -= freed
        return n, freed

    def _drop_oldest_chunk(self) -> None:
        chunks, start = self._chunks, self._start
        chunks[start] = None
        start += 1
        if start >= 64 and start * 2 >= len(chunks):  # cut the dropped prefix (a move of pointers)
            del chunks[:start]
            del self._firsts[:start]
            start = 0
        self._start = start

    def _chunk_index(self, transaction_id: int) -> int:
        """Index in ``_chunks`` of the chunk holding ``transaction_id``, or -1 when it is not
        cached (evicted, or not yet put)."""
        if transaction_id < self._head or transaction_id >= self._next:
            return -1
        return bisect_right(self._firsts, transaction_id, self._start) - 1

    def get(self, transaction_id: int) -> tuple[bytes, int] | None:
        """(data, checksum) of ``transaction_id`` (a copy of the data), or None when it is not cached."""
        index = self._chunk_index(transaction_id)
        if index < 0:
            return None
        chunk = self._chunks[index]
        assert chunk is not None
        k = transaction_id - chunk.first
        checksum = chunk.checksums[k]
        if checksum < 0:
            return None
        ends = chunk.ends
        return bytes(chunk.data[ends[k - 1] if k else 0 : ends[k]]), checksum

    def holds(self, transaction_id: int) -> bool:
        """``transaction_id``'s data is cached (:meth:`get` would return it)."""
        index = self._chunk_index(transaction_id)
        if index < 0:
            return False
        chunk = self._chunks[index]
        assert chunk is not None
        return chunk.checksums[transaction_id - chunk.first] >= 0

    def get_run(self, first: int, max_count: int, max_bytes: int, item_overhead: int) -> tuple[list[bytes], list[int], int]:
        """Data and checksums of ``first, first + 1, ...`` (one lookup, not one per entry): at
        most ``max_count``, up to the first one not cached, and while the sum of their sizes
        plus ``item_overhead`` each stays within ``max_bytes`` (the first is always included).
        The third value is that sum."""
        data: list[bytes] = []
        checksums: list[int] = []
        size = 0
        index = self._chunk_index(first)
        if index < 0:
            return data, checksums, size
        end = min(self._next, first + max_count)
        chunks = self._chunks
        txn = first
        while txn < end:
            chunk = chunks[index]
            assert chunk is not None
            k = txn - chunk.first
            ends, sums, buf = chunk.ends, chunk.checksums, chunk.data
            start = ends[k - 1] if k else 0
            stop = min(len(ends), k + end - txn)
            while k < stop:
                checksum = sums[k]
                if checksum < 0:
                    return data, checksums, size
                item_end = ends[k]
                size += item_end - start + item_overhead
                if size > max_bytes and data:
                    return data, checksums, size - (item_end - start + item_overhead)
                data.append(bytes(buf[start:item_end]))
                checksums.append(checksum)
                start = item_end
                k += 1
                txn += 1
            index += 1
        return data, checksums, size

    def clear(self) -> None:
        self._chunks = []
        self._firsts = []
        self._start = 0
        self._next = self._head = 0
        self._emptied()
