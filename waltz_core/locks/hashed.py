"""The ``hashed`` lock table: the original's array of L high-water marks with N hash functions.

Each lock hash maps to N slots through the original's linear congruential chain
(``h = h * 1103515245 + 12345`` in 32-bit arithmetic, slot ``(h & 0x3FFFFFFF) % L``, the first
slot after one step). A commit writes the transaction id into every slot of its write and append
locks; a lock's estimate is the minimum of its slots. Since commits arrive in increasing id order,
every slot holds at least the last commit of every lock mapped to it, so the minimum is never
below the lock's exact value: no false "safe", only false conflicts when all N slots were
overwritten by other locks. Memory is fixed: 8·L bytes of marks plus L bytes of in-flight flags.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from .base import Begin, LockRequest

if TYPE_CHECKING:
    from ..config import ServerConfig

_MULTIPLIER = 1103515245
_ADDER = 12345
_MASK32 = 0xFFFFFFFF
_INDEX_MASK = 0x3FFFFFFF

#: Lock hashes whose slot indices are kept; beyond it the cache is dropped and refilled
#: (cheaper than LRU bookkeeping on every hit, and a partition's hot set is far smaller).
SLOT_CACHE_SIZE = 65_536


def slot_indices(lock_hash: int, size: int, hash_count: int) -> tuple[int, ...]:
    """The ``hash_count`` slots of ``lock_hash`` in a table of ``size`` slots, as the original computes them.

    Java wraps ``int`` arithmetic at 32 bits; only the low 30 bits reach the index, so unsigned
    32-bit wrapping gives the same indices for negative hashes.
    """
    h = lock_hash & _MASK32
    slots = []
    for _ in range(hash_count):
        h = (h * _MULTIPLIER + _ADDER) & _MASK32
        slots.append((h & _INDEX_MASK) % size)
    return tuple(slots)


class HashedLockTable:
    """:class:`~waltz_core.locks.base.LockTable` over L signed 64-bit marks and N hash functions.

    Not thread-safe: owned by one partition's append task. Never blocks.
    """

    __slots__ = ("size", "hash_count", "_marks", "_busy", "_slot_cache", "_in_flight")

    def __init__(self, size: int = 30_000, hash_count: int = 3, high_water_mark: int = -1) -> None:
        if size < 1 or hash_count < 1:
            raise ValueError(f"hashed lock table needs size >= 1 and hash_count >= 1, got {size} x {hash_count}")
        self.size = size
        self.hash_count = hash_count
        self._marks = array("q", [high_water_mark]) * size
        self._busy = bytearray(size)  # 1 = a slot of an in-flight write/append lock
        self._slot_cache: dict[int, tuple[int, ...]] = {}
        self._in_flight = 0

    @classmethod
    def from_config(cls, config: ServerConfig, options: None = None) -> HashedLockTable:
        """The registry factory, ``factory(config, options)``: L and N are the seed's ``[server]``
        keys ``lock_table_size`` and ``lock_hash_count`` (the strategy has no options table)."""
        return cls(config.lock_table_size, config.lock_hash_count)

    def __repr__(self) -> str:
        return f"HashedLockTable(size={self.size}, hash_count={self.hash_count}, in_flight={self._in_flight})"

    # -------------------------------------------------------------------------------- internals

    def _slots_miss(self, lock_hash: int) -> tuple[int, ...]:
        slots = slot_indices(lock_hash, self.size, self.hash_count)
        cache = self._slot_cache
        if len(cache) >= SLOT_CACHE_SIZE:
            cache.clear()
        cache[lock_hash] = slots
        return slots

    def slots(self, lock_hash: int) -> tuple[int, ...]:
        """The slot indices of ``lock_hash`` (cached)."""
        return self._slot_cache.get(lock_hash) or self._slots_miss(lock_hash)

    def _any_busy(self, locks: tuple[int, ...]) -> bool:
        busy = self._busy
        cache = self._slot_cache
        for lock in locks:
            for s in cache.get(lock) or self._slots_miss(lock):
                if busy[s]:
                    return True
        return False

    def _set_busy(self, locks: tuple[int, ...], flag: int) -> None:
        busy = self._busy
        cache = self._slot_cache
        for lock in locks:
            for s in cache.get(lock) or self._slots_miss(lock):
                busy[s] = flag

    def _max_min(self, locks: tuple[int, ...], estimate: int) -> int:
        marks = self._marks
        cache = self._slot_cache
        for lock in locks:
            slots = cache.get(lock) or self._slots_miss(lock)
            low = marks[slots[0]]
            for s in slots:
                v = marks[s]
                if v < low:
                    low = v
            if low > estimate:
                estimate = low
        return estimate

    # ------------------------------------------------------------------------------- protocol

    def begin(self, request: LockRequest) -> Begin:
        writes = request.write_locks
        reads = request.read_locks
        appends = request.append_locks
        # Nothing in flight (the common case at low concurrency): nothing to collide with. Empty
        # lists are skipped before the call (most requests have one kind of lock).
        if self._in_flight and (
            (writes and self._any_busy(writes)) or (reads and self._any_busy(reads))
            or (appends and self._any_busy(appends))
        ):
            return Begin.BUSY
        if writes:
            self._set_busy(writes, 1)
        if appends:
            self._set_busy(appends, 1)
        self._in_flight += 1
        return Begin.OK

    def estimate(self, request: LockRequest) -> int:
        return self._max_min(request.read_locks, self._max_min(request.write_locks, -1))

    def check(self, request: LockRequest, client_high_water_mark: int) -> int | None:
        reads = request.read_locks
        estimate = self._max_min(request.write_locks, -1)
        if reads:
            estimate = self._max_min(reads, estimate)
        return estimate if estimate > client_high_water_mark else None

    def commit(self, request: LockRequest, transaction_id: int) -> None:
        marks = self._marks
        busy = self._busy
        cache = self._slot_cache
        for locks in (request.write_locks, request.append_locks):
            for lock in locks:
                for s in cache.get(lock) or self._slots_miss(lock):
                    marks[s] = transaction_id
                    busy[s] = 0
        if self._in_flight:  # _end() inlined: once per committed locked append
            self._in_flight -= 1

    def abort(self, request: LockRequest) -> None:
        if request.write_locks:
            self._set_busy(request.write_locks, 0)
        if request.append_locks:
            self._set_busy(request.append_locks, 0)
        self._end()

    def _end(self) -> None:
        # Tolerant on purpose: a commit that straddles a reset() still advances its locks (the
        # estimate must include it) and must not break the server's commit path.
        if self._in_flight:
            self._in_flight -= 1

    def reset(self, high_water_mark: int) -> None:
        self._marks = array("q", [high_water_mark]) * self.size
        self._busy = bytearray(self.size)
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight
