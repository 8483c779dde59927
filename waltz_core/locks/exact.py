"""The ``exact`` lock table: a dict from lock hash to the id of its last commit.

No false conflicts and no spurious BUSY, at the price of memory that grows with the number of
distinct locks ever committed in the partition (about 100 bytes per lock). It is the oracle the
``hashed`` table is tested against, and a fine choice for partitions with a bounded lock set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Begin, LockRequest

if TYPE_CHECKING:
    from ..config import ServerConfig


class ExactLockTable:
    """:class:`~waltz_core.locks.base.LockTable` keeping every lock's exact last commit.

    Not thread-safe: owned by one partition's append task. Never blocks.
    """

    __slots__ = ("_base", "_last", "_busy", "_in_flight")

    def __init__(self, high_water_mark: int = -1) -> None:
        self._base = high_water_mark  # estimate of every lock not committed since the last reset
        self._last: dict[int, int] = {}
        self._busy: set[int] = set()  # write/append locks of in-flight requests
        self._in_flight = 0

    @classmethod
    def from_config(cls, config: ServerConfig, options: None = None) -> ExactLockTable:
        """The registry factory, ``factory(config, options)``: no options; the ``[server]`` keys
        ``lock_table_size`` and ``lock_hash_count`` do not apply."""
        return cls()

    def __repr__(self) -> str:
        return f"ExactLockTable(locks={len(self._last)}, in_flight={self._in_flight})"

    def lock_estimate(self, lock_hash: int) -> int:
        """The exact last commit of one lock (or the table's base high-water mark)."""
        return self._last.get(lock_hash, self._base)

    def _max(self, locks: tuple[int, ...], estimate: int) -> int:
        last = self._last
        base = self._base
        for lock in locks:
            v = last.get(lock, base)
            if v > estimate:
                estimate = v
        return estimate

    def begin(self, request: LockRequest) -> Begin:
        busy = self._busy
        writes = request.write_locks
        appends = request.append_locks
        if busy and (
            not busy.isdisjoint(writes) or not busy.isdisjoint(request.read_locks) or not busy.isdisjoint(appends)
        ):
            return Begin.BUSY
        if writes:
            busy.update(writes)
        if appends:
            busy.update(appends)
        self._in_flight += 1
        return Begin.OK

    def estimate(self, request: LockRequest) -> int:
        return self._max(request.read_locks, self._max(request.write_locks, -1))

    def check(self, request: LockRequest, client_high_water_mark: int) -> int | None:
        estimate = self._max(request.read_locks, self._max(request.write_locks, -1))
        return estimate if estimate > client_high_water_mark else None

    def commit(self, request: LockRequest, transaction_id: int) -> None:
        last = self._last
        busy = self._busy
        for locks in (request.write_locks, request.append_locks):
            for lock in locks:
                last[lock] = transaction_id
                busy.discard(lock)
        self._end()

    def abort(self, request: LockRequest) -> None:
        busy = self._busy
        if busy:
            busy.difference_update(request.write_locks)
            busy.difference_update(request.append_locks)
        self._end()

    def _end(self) -> None:
        # Tolerant on purpose, like the hashed table: see HashedLockTable._end.
        if self._in_flight:
            self._in_flight -= 1

    def reset(self, high_water_mark: int) -> None:
        self._base = high_water_mark
        self._last = {}
        self._busy = set()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight
