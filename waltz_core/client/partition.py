"""The client's runtime state of one partition, around its :class:`~waltz_core.protocol.session.Session`.

The session (pure) holds the protocol state: mount state, generation, client high-water mark,
what the feed delivered, pending appends and flushes. :class:`Partition` adds what lives on the
event loop: the server link, the ``ready`` event submitters wait on, in-flight slots (back
pressure), lock-failed appends waiting for their conflict, the feed queue the applier drains,
and own transactions seen committed but not applied yet.

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


class Partition:
    """One partition of one client (see the module docstring)."""

    __slots__ = ("id", "session", "owner", "link", "ready", "mount_retry", "inflight", "slot_waiters", "feed",
                 "consumer", "own", "completed", "lock_waits")

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
