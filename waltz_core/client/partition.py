"""The client's runtime state of one partition, around its :class:`~waltz_core.protocol.session.Session`.

The session (pure) holds the protocol state: mount state, generation, client high-water mark,
what the feed delivered, pending appends and flushes. :class:`Partition` adds what lives on the
event loop: the server link, the ``ready`` event submitters wait on, in-flight slots (back
pressure), lock-failed appends waiting for their conflict, the locks own appends will advance
(and transactions held back on them), the feed queue the applier drains, and own transactions
seen committed but not applied yet.

The state comes from the session only. Every event that can change it goes through a method of
:class:`Partition` (:meth:`~Partition.bind`, :meth:`~Partition.mount`, :meth:`~Partition.receive`,
...) which then sets ``ready`` from the new state: the event is in step with the session by
construction, not by each caller remembering to set it.

Threading: event loop only, except ``session.hwm``, which the sync client's consumer thread
advances as it applies (a plain attribute write), and :meth:`Partition.high_water_mark` (gauge).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from typing import TYPE_CHECKING, Final

from ..inbox import Inbox
from ..protocol import client as m
from ..protocol.session import Action, PendingAppend, Session, SessionState

if TYPE_CHECKING:
    from ..coordination.recipes import PartitionOwner
    from .api import TransactionContext
    from .link import ServerLink

FEED_QUEUE = 4096  #: feed records buffered per partition before the stream reader waits

#: states in which submitters waiting for ``ready`` must look again: appends may go (READY), or
#: they never will (AHEAD, INACTIVE: the submitter raises)
_SETTLED: Final = frozenset({SessionState.READY, SessionState.AHEAD, SessionState.INACTIVE})

Pending = PendingAppend["TransactionContext"]


#: A feed record waiting to be applied: the fields of its FeedData as the stream reader unpacked
#: them, ``(client id, generation, partition id, seq num, transaction id, header)``. The tuple
#: :func:`~waltz_core.protocol.client.unpack_feed_data` made, queued as it is: nothing is made per
#: record on the way to the applier (own transactions are found in :attr:`Partition.own`).
FeedItem = tuple[int, int, int, int, int, int]


class LockWaits:
    """Lock-failed appends waiting for the client high-water mark to reach the conflicting transaction."""

    __slots__ = ("_heap", "_tie")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Pending]] = []
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, conflicting_txn: int, entry: Pending) -> None:
        heapq.heappush(self._heap, (conflicting_txn, next(self._tie), entry))

    def release(self, client_high_water_mark: int) -> list[Pending]:
        """Entries whose conflicting transaction the client has applied (in conflict order)."""
        heap = self._heap
        out = []
        while heap and heap[0][0] <= client_high_water_mark:
            out.append(heapq.heappop(heap)[2])
        return out

    def drain(self) -> list[Pending]:
        out = [e for _, _, e in sorted(self._heap, key=lambda item: item[:2])]
        self._heap.clear()
        return out


class HeldLocks:
    """The locks this client's own appends will advance (their write and append locks) while they
    are in flight, or committed and not yet applied; and the transactions held back on them.

    A transaction that writes or reads such a lock was executed before that append was applied,
    so the server's lock check would fail it for certain once that append commits: it is not
    sent. It waits here until the append is applied (or failed), then is executed again. Lock
    failures between this client's own transactions so cost neither a server's decision nor a
    round trip; conflicts with other clients' transactions are still the server's to find.

    A freed lock goes to the oldest transaction waiting for it, reserved to it until its next
    execution ends: the others would only be held back again, each execution a waste. So one
    client's transactions on a hot lock go one at a time, each executed twice, not all again
    after every commit. A reservation holds back only transactions that have none: one that
    has a reservation waits only for appends. Otherwise two of them, each reserved a lock the
    other needs, would hand their locks on and execute again for ever.
    """

    __slots__ = ("locks", "reserved", "commits", "_applied", "_waits", "_waiting", "_tie")

    def __init__(self) -> None:
        #: lock hash -> own appends that will advance it (in flight, or committed and not applied)
        self.locks: dict[int, int] = {}
        #: lock hash -> transactions it is reserved to (one, but for a lock a holder took back)
        self.reserved: dict[int, int] = {}
        #: (transaction id, locks) of own appends committed, in feed order
        self.commits: deque[tuple[int, tuple[int, ...]]] = deque()
        #: (transaction id, tie, locks): locks kept until another transaction is applied (a heap)
        self._applied: list[tuple[int, int, tuple[int, ...]]] = []
        self._waits: dict[int, deque[tuple[TransactionContext, int]]] = {}
        self._waiting = 0  #: transactions in _waits (a plain int: the pending gauge reads it from any thread)
        self._tie = itertools.count()

    def __len__(self) -> int:
        """Transactions held back."""
        return self._waiting

    def __bool__(self) -> bool:
        return bool(self._waits)

    def conflict(self, write_locks: tuple[int, ...], read_locks: tuple[int, ...], has_reservation: bool = False) -> int | None:
        """A lock of the transaction that an own append will advance, or that is reserved to
        another transaction (unless this one ``has_reservation``), if any."""
        locks = self.locks
        reserved = None if has_reservation or not self.reserved else self.reserved
        for lock in write_locks:
            if lock in locks or (reserved is not None and lock in reserved):
                return lock
        for lock in read_locks:
            if lock in locks or (reserved is not None and lock in reserved):
                return lock
        return None

    def hold(self, locks: tuple[int, ...]) -> None:
        """An append that advances ``locks`` is being sent."""
        held = self.locks
        for lock in locks:
            held[lock] = held.get(lock, 0) + 1

    def wait(self, lock: int, context: TransactionContext, attempts: int) -> None:
        """Hold ``context`` (executed ``attempts`` times) back until ``lock`` is released to it."""
        self._waiters(lock).append((context, attempts))

    def wait_first(self, lock: int, context: TransactionContext, attempts: int) -> None:
        """Like :meth:`wait`, ahead of the others: for the holder of ``lock`` whose append failed
        its lock check (it is older than every transaction it held back)."""
        self._waiters(lock).appendleft((context, attempts))

    def _waiters(self, lock: int) -> deque[tuple[TransactionContext, int]]:
        """The queue of ``lock``, made if needed, for one more waiter."""
        self._waiting += 1
        waiting = self._waits.get(lock)
        if waiting is None:
            waiting = self._waits[lock] = deque()
        return waiting

    def committed(self, transaction_id: int, locks: tuple[int, ...]) -> None:
        """The append holding ``locks`` committed as ``transaction_id`` (in feed order): they
        are released once it is applied."""
        self.commits.append((transaction_id, locks))

    def held_until(self, transaction_id: int, locks: tuple[int, ...]) -> None:
        """Keep ``locks`` until ``transaction_id`` (not an own one: any order) is applied."""
        heapq.heappush(self._applied, (transaction_id, next(self._tie), locks))

    @property
    def applying(self) -> bool:
        """Locks wait for a transaction to be applied."""
        return bool(self.commits or self._applied)

    def release_applied(self, client_high_water_mark: int) -> list[tuple[TransactionContext, int, int]]:
        """Release the locks of the appends the application applied (see :meth:`release`)."""
        out: list[tuple[TransactionContext, int, int]] = []
        commits = self.commits
        held = self.locks
        waits = self._waits
        # release(), inline: once per own locked transaction
        while commits and commits[0][0] <= client_high_water_mark:
            for lock in commits.popleft()[1]:
                n = held.get(lock, 0) - 1
                if n > 0:
                    held[lock] = n
                else:
                    held.pop(lock, None)
                    if lock in waits:
                        self._pass(lock, out)
        applied = self._applied
        while applied and applied[0][0] <= client_high_water_mark:
            out.extend(self.release(heapq.heappop(applied)[2]))
        return out

    def release(self, locks: tuple[int, ...]) -> list[tuple[TransactionContext, int, int]]:
        """An append that held ``locks`` failed or was applied. For each lock that is free now
        (no append, no reservation) and that a transaction waits for: ``(context, attempts,
        lock)`` of the oldest one, which the lock is now reserved to; the caller executes it
        again and then ends the reservation with :meth:`end_reservation`."""
        held = self.locks
        out: list[tuple[TransactionContext, int, int]] = []
        for lock in locks:
            n = held.get(lock, 0) - 1
            if n > 0:
                held[lock] = n
                continue
            held.pop(lock, None)
            self._pass(lock, out)
        return out

    def end_reservation(self, lock: int) -> list[tuple[TransactionContext, int, int]]:
        """An execution of the transaction ``lock`` was reserved to ended; what :meth:`release`
        returns (its append, if it took the lock, holds it now)."""
        reserved = self.reserved
        n = reserved.get(lock, 0) - 1
        if n > 0:
            reserved[lock] = n
            return []
        reserved.pop(lock, None)
        out: list[tuple[TransactionContext, int, int]] = []
        self._pass(lock, out)
        return out

    def _pass(self, lock: int, out: list[tuple[TransactionContext, int, int]]) -> None:
        """Reserve ``lock`` to its oldest waiter, if it is free and somebody waits."""
        if lock in self.locks or lock in self.reserved:
            return
        waiting = self._waits.get(lock)
        if not waiting:
            return
        context, attempts = waiting.popleft()
        self._waiting -= 1
        if not waiting:
            del self._waits[lock]
        self.reserved[lock] = 1
        out.append((context, attempts, lock))

    def drain(self) -> list[TransactionContext]:
        """Closing: the transactions held back; everything is forgotten."""
        out = [context for waiting in self._waits.values() for context, _ in waiting]
        self._waits.clear()
        self._waiting = 0
        self.locks.clear()
        self.reserved.clear()
        self.commits.clear()
        self._applied.clear()
        return out


class Partition:
    """One partition of one client (see the module docstring)."""

    __slots__ = ("id", "session", "owner", "link", "ready", "mount_retry", "inflight", "slot_waiters", "feed",
                 "consumer", "own", "completed", "lock_waits", "held")

    def __init__(self, partition_id: int, client_id: int, high_water_mark: int) -> None:
        self.id = partition_id
        self.session: Session[TransactionContext] = Session(client_id, partition_id, high_water_mark)
        self.owner: PartitionOwner | None = None
        self.link: ServerLink | None = None
        self.ready = asyncio.Event()  #: set while the state is settled (READY, AHEAD, INACTIVE) or the client closed
        self.mount_retry: asyncio.TimerHandle | None = None
        self.inflight = 0  #: in-flight slots taken (appends sent or being built)
        #: submitters waiting for an in-flight slot, first come first served; a waiter's future is
        #: set True when a released slot passes to it, False to make it re-check the partition
        self.slot_waiters: deque[asyncio.Future[bool]] = deque()
        self.feed: Inbox[FeedItem] = Inbox(FEED_QUEUE)  #: received, not yet applied; the stream reader waits when full
        #: the sync client's apply task; the async client's while this partition applies apart (applier.py)
        self.consumer: asyncio.Task[None] | None = None
        #: own transactions seen committed and not yet applied: transaction id -> context
        self.own: dict[int, TransactionContext] = {}
        #: those of :attr:`own` whose ``on_completion(True)`` was called and whose apply failed
        #: (called once, even if the apply is repeated)
        self.completed: set[int] = set()
        self.lock_waits = LockWaits()
        #: locks own appends will advance, and the transactions held back on them
        self.held = HeldLocks()

    def __repr__(self) -> str:
        return f"Partition({self.session!r}, inflight={self.inflight})"

    @property
    def state(self) -> SessionState:
        return self.session.state

    def high_water_mark(self) -> float:
        """The ``high_water_mark`` gauge's value (any thread)."""
        return self.session.hwm

    # ----------------------------------------------------------------- state changes (session)

    def _settle(self) -> None:
        if self.session.state in _SETTLED:
            self.ready.set()
        else:
            self.ready.clear()

    def bind(self, owner: PartitionOwner | None) -> None:
        """A new owner (or none): mount again there."""
        self.owner = owner
        self.session.bind(owner.generation if owner is not None else self.session.generation)
        self._settle()

    def mount(self, network_seq: int) -> m.MountRequest:
        """The mount request to post now."""
        if self.mount_retry is not None:
            self.mount_retry.cancel()
            self.mount_retry = None
        request = self.session.mount(network_seq)
        self._settle()
        return request

    def link_lost(self) -> None:
        self.session.link_lost()
        self._settle()

    def receive(self, msg: object) -> Action[TransactionContext] | None:
        """A stream message for the session (mount, flush and lock answers, a suspended feed)."""
        action = self.session.receive(msg)
        self._settle()
        return action

    def apply_failed(self) -> float:
        """The application failed to apply: drop what is queued; seconds before mounting again."""
        self.feed.clear()  # session.received stays: flush() waits until the redelivered ones are applied
        delay = self.session.apply_failed()
        self._settle()
        return delay

    def deactivate(self) -> None:
        self.session.deactivate()
        self._settle()

    def wake(self) -> None:
        """The client is closing: wake every submitter so it sees that."""
        self.ready.set()
        self.wake_slot_waiters()

    # --------------------------------------------------------------------------------- slots

    def release_slot(self) -> None:
        """Pass the slot to the oldest waiter, if any, else free it. One wake-up per released slot:
        waking every waiter made each release cost O(waiters), and a burst above the in-flight
        cap collapsed the client (measured: 11 transactions/s offered 12,000/s with 64 slots)."""
        waiters = self.slot_waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():  # done: it timed out or was cancelled; skip it
                fut.set_result(True)
                return
        self.inflight -= 1

    def forget_slot_waiter(self, slot: asyncio.Future[bool]) -> None:
        """A waiter gave up (its timeout, a cancel): take its future out of the queue now. Left
        for :meth:`release_slot` to skip, one would pile up per try while no slot is released."""
        try:
            self.slot_waiters.remove(slot)
        except ValueError:
            pass  # already taken out: a release or a wake-up passed it

    def wake_slot_waiters(self) -> None:
        """Make every waiter re-check the partition (closed, unmounted), without a slot."""
        waiters, self.slot_waiters = self.slot_waiters, deque()
        for fut in waiters:
            if not fut.done():
                fut.set_result(False)


def handed(slot: asyncio.Future[bool]) -> bool:
    """True if a released in-flight slot was passed to the waiter of ``slot``."""
    return slot.done() and not slot.cancelled() and slot.result()
