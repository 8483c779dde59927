"""The transaction monitor of one partition (Waltz design, "Detection of Failed Append Requests").

Pure bookkeeping, no I/O, no clock of its own (times are passed in): the client's event loop
calls it when it sends an append and when the stream tells something about one.

* a feed record carrying one of our ReqIds: that append succeeded, and every append of ours
  registered before it in this partition failed (the server processes one connection's appends
  in order, and a lock failure for an older one would have arrived before this feed record);
* a mount answered READY or a flush completed: every append registered before that request
  failed (the server flushed its queue before answering, so none of them can commit any more);
* a lock failure: the append is out; it waits in :class:`LockWaits` until the client consumed
  the transaction that caused the conflict, then it is re-executed.

Sequence numbers (the ReqId ``seq_num`` of the partition's requests) grow with registration
order, so "registered before" is "smaller sequence number".
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from .api import TransactionContext


@attrs.define(slots=True, eq=False)
class PendingAppend:
    """An append sent and not yet resolved."""

    seq: int
    context: TransactionContext
    attempts: int  #: executions of the context so far, this one included
    registered: float  #: monotonic time it was sent


class TransactionMonitor:
    """Appends of this client in one partition whose fate is not known yet."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: dict[int, PendingAppend] = {}  # insertion order == sequence order

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[PendingAppend]:
        return iter(list(self._pending.values()))

    def register(self, seq: int, context: TransactionContext, attempts: int, now: float) -> PendingAppend:
        last = next(reversed(self._pending), None)
        if last is not None and seq <= last:
            raise ValueError(f"sequence number {seq} is not above the last registered {last}")
        entry = PendingAppend(seq, context, attempts, now)
        self._pending[seq] = entry
        return entry

    def on_feed(self, seq: int) -> tuple[PendingAppend | None, list[PendingAppend]]:
        """Our append ``seq`` committed: (its entry, the older entries that therefore failed).

        ``(None, [])`` when ``seq`` is not pending (someone else's request, or already resolved).
        """
        pending = self._pending
        entry = pending.pop(seq, None)
        if entry is None:
            return None, []
        return entry, self.fail_before(seq)

    def on_lock_failure(self, seq: int) -> PendingAppend | None:
        """The server rejected append ``seq`` on a lock conflict; None if it is not pending."""
        return self._pending.pop(seq, None)

    def fail_before(self, seq: int) -> list[PendingAppend]:
        """Remove and return every entry registered before ``seq`` (they can no longer commit)."""
        pending = self._pending
        oldest = next(iter(pending), None)
        if oldest is None or oldest >= seq:
            return []  # the usual case: appends commit in the order they were sent
        failed = []
        for key in list(pending):
            if key >= seq:
                break
            failed.append(pending.pop(key))
        return failed

    def fail_all(self) -> list[PendingAppend]:
        failed = list(self._pending.values())
        self._pending.clear()
        return failed

    def oldest(self) -> float | None:
        """Registration time of the oldest pending append."""
        for entry in self._pending.values():
            return entry.registered
        return None


class LockWaits:
    """Lock-failed appends waiting for the client high-water mark to reach the conflicting transaction."""

    __slots__ = ("_heap", "_tie")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, PendingAppend]] = []
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, conflicting_txn: int, entry: PendingAppend) -> None:
        heapq.heappush(self._heap, (conflicting_txn, next(self._tie), entry))

    def release(self, client_high_water_mark: int) -> list[PendingAppend]:
        """Entries whose conflicting transaction the client has consumed (in conflict order)."""
        heap = self._heap
        out = []
        while heap and heap[0][0] <= client_high_water_mark:
            out.append(heapq.heappop(heap)[2])
        return out

    def drain(self) -> list[PendingAppend]:
        out = [e for _, _, e in sorted(self._heap)]
        self._heap.clear()
        return out
