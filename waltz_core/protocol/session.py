"""The client side of one partition session, as a pure state machine (Waltz design, "Client-Server
Interactions" and "Detection of Failed Append Requests").

No I/O, no event loop, no clock: the driver (the client library, :mod:`waltz_core.testing.probe`,
the smoke test's :mod:`~waltz_core.testing.smoketest.workload`) tells a :class:`Session` what
happened - a request it sent, a message the server sent, a connection it lost - and reads back
what follows: the message to send, the state, the fate of its appends. Times are passed in.
The server side of the same rules is :mod:`waltz_core.server.partition`.

States
======

::

    event \\ state        UNMOUNTED   MOUNTING    READY       AHEAD       INACTIVE
    BIND (new owner)     UNMOUNTED   UNMOUNTED   UNMOUNTED   UNMOUNTED   -
    MOUNT (request sent) MOUNTING    MOUNTING    MOUNTING    MOUNTING    -
    answer READY         ·           READY       ·           ·           ·
    answer NOT_READY     ·           UNMOUNTED   ·           ·           ·
    answer CLIENT_AHEAD  ·           AHEAD       ·           ·           ·
    FEED_SUSPENDED       UNMOUNTED   UNMOUNTED   UNMOUNTED   UNMOUNTED   ·
    LINK_LOST            UNMOUNTED   UNMOUNTED   UNMOUNTED   AHEAD       -
    APPLY_FAILED         UNMOUNTED   UNMOUNTED   UNMOUNTED   UNMOUNTED   -
    DEACTIVATE           INACTIVE    INACTIVE    INACTIVE    INACTIVE    INACTIVE

``·``: a server message the state has no use for is ignored - a mount answer that is not for the
mount request in flight is stale, a dropped partition hears nothing; ``-``: a local event the
state does not allow is the driver's bug, :class:`SessionStateError`. :data:`TRANSITIONS` is
this table (without the ``·`` cells).

Appends are sent only in READY (the driver's rule: it waits for READY), but an append registered
in another state is legal - the link may drop between the decision and the send - and its fate is
decided like any other.

Rules
=====

Mount
    A mount asks for the feed from the client high-water mark (:attr:`Session.hwm`, the last
    transaction the application applied). The server answers READY once the feed reached its
    high-water mark of the moment it processed the mount, NOT_READY when it does not own the
    partition (yet) - mount again after :data:`NOT_READY_RETRY` - or CLIENT_AHEAD when the client
    high-water mark is above the log (the application's database is ahead: nothing to do until
    the partition is bound again). A partition is mounted again after a lost link, a new owner
    (generation), a suspended feed and an apply failure (after a backoff, :meth:`Session.apply_failed`:
    the feed from the client high-water mark delivers the failed transaction again).
Feed
    Records arrive in transaction-id order; after a re-mount the server starts again at the client
    high-water mark + 1, so ids up to :attr:`Session.received` may come again. An id beyond
    ``received + 1`` is a gap: :class:`~waltz_core.errors.ProtocolError`. An append of this client
    is recognised by its request id (client id and sequence number).
Flush
    A flush response carries the server's high-water mark after every append queued before the
    flush; once the feed reached it, every append sent before the flush that did not show up in
    the feed FAILED.
Fates of an append
    COMMITTED when it shows up in the feed (:meth:`Session.on_feed` returns it); every older append
    of this session still pending then FAILED, since a connection's appends are processed in order
    and a lock failure of an older one would have arrived first. LOCK-FAILED on a ``LockFailure``
    (:class:`LockFailed`). REFUSED on an ``AppendRefused`` (:class:`Refused`), for good. FAILED
    when a mount is answered READY (the server flushed its queue before answering, so nothing sent
    before the mount can commit any more) and by the flush rule.
    Appends still pending when the session is abandoned have an UNKNOWN fate (:meth:`Session.abandon`).

Decisions about other appends than the one an event names (older appends failed, flushes done)
are queued in :attr:`Session.failed` and :attr:`Session.flushed`; the driver takes them after each
event (both are empty almost always, so checking them costs one attribute test).

Sequence numbers (a ReqId's ``seq_num``) of a session's requests grow with the order they are
made, so "sent before" is "smaller sequence number". On the wire they are 31 bits and wrap (after
2**31 requests: under a day at 30,000 transactions per second); the session counts with unbounded
ints and maps a number from the server back to the request it names, which is never more than
2**31 requests old (serial-number arithmetic, RFC 1982).

Cost: :meth:`Session.on_feed` and :meth:`Session.append` run once per transaction and call no
hooks; an append allocates its :class:`PendingAppend`, a feed record of another client nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Final, Generic, TypeVar

import attrs

from ..errors import ProtocolError
from . import client as m
from .wire import ReqId

T = TypeVar("T")

SEQ_MASK: Final = 0x7FFFFFFF  #: sequence numbers are signed 32-bit on the wire
NOT_READY_RETRY: Final = 0.5  #: seconds before a NOT_READY mount (or a suspended feed) is mounted again (original)
APPLY_RETRY_INITIAL: Final = 0.05  #: seconds before the first re-mount after an apply failure
APPLY_RETRY_MAX: Final = 5.0  #: cap of the re-mount backoff after repeated apply failures


class SessionState(enum.Enum):
    """Where a partition session is (the values name it in logs and messages)."""

    UNMOUNTED = "unmounted"  #: no mount in flight: waiting for a link, an owner or a retry
    MOUNTING = "mounting"  #: a mount request is in flight
    READY = "ready"  #: mounted: appends may be sent
    AHEAD = "ahead"  #: the server answered CLIENT_AHEAD: the client high-water mark is above the log
    INACTIVE = "inactive"  #: the driver dropped the partition


class SessionEvent(enum.Enum):
    """What moves a session from one state to another (the rows of :data:`TRANSITIONS`)."""

    BIND = "bind"
    MOUNT = "mount"
    ANSWER_READY = "answer READY"
    ANSWER_NOT_READY = "answer NOT_READY"
    ANSWER_CLIENT_AHEAD = "answer CLIENT_AHEAD"
    LINK_LOST = "link lost"
    FEED_SUSPENDED = "feed suspended"
    APPLY_FAILED = "apply failed"
    DEACTIVATE = "deactivate"


_S = SessionState
_E = SessionEvent
_LIVE = (_S.UNMOUNTED, _S.MOUNTING, _S.READY, _S.AHEAD)

#: (state, event) -> next state; a pair that is missing is a local misuse (:class:`SessionStateError`).
TRANSITIONS: Final[Mapping[tuple[SessionState, SessionEvent], SessionState]] = {
    **{(s, _E.BIND): _S.UNMOUNTED for s in _LIVE},
    **{(s, _E.MOUNT): _S.MOUNTING for s in _LIVE},
    (_S.MOUNTING, _E.ANSWER_READY): _S.READY,
    (_S.MOUNTING, _E.ANSWER_NOT_READY): _S.UNMOUNTED,
    (_S.MOUNTING, _E.ANSWER_CLIENT_AHEAD): _S.AHEAD,
    **{(s, _E.LINK_LOST): _S.UNMOUNTED for s in (_S.UNMOUNTED, _S.MOUNTING, _S.READY)},
    (_S.AHEAD, _E.LINK_LOST): _S.AHEAD,  # stays: losing a link says nothing about the log's end
    **{(s, _E.FEED_SUSPENDED): _S.UNMOUNTED for s in _LIVE},
    **{(s, _E.APPLY_FAILED): _S.UNMOUNTED for s in _LIVE},
    **{(s, _E.DEACTIVATE): _S.INACTIVE for s in (*_LIVE, _S.INACTIVE)},
}


class SessionStateError(RuntimeError):
    """The driver did something the session's state does not allow (a bug in the driver, not a
    failure of the peer: it is not part of the :class:`~waltz_core.errors.WaltzError` tree)."""


class PendingAppend(Generic[T]):
    """An append sent and not yet decided. One per append: a slots class, not attrs, since it is
    made on the per-transaction path. ``item`` is the driver's (the client's transaction context)."""

    __slots__ = ("seq", "item", "attempts", "registered", "held")

    def __init__(self, seq: int, item: T, attempts: int, registered: float,
                 held: tuple[int, ...] | None = None) -> None:
        self.seq = seq
        self.item = item
        self.attempts = attempts  #: executions of the transaction so far, this one included
        self.registered = registered  #: the driver's clock when it was sent
        self.held = held  #: the driver's: the lock hashes it holds for this append until decided

    def __repr__(self) -> str:
        return f"PendingAppend(seq={self.seq}, attempts={self.attempts}, item={self.item!r})"


# ------------------------------------------------------------------------------------ actions


@attrs.frozen(slots=True)
class Mounted:
    """The mount was answered READY: appends may be sent. Appends sent before it failed (in
    :attr:`Session.failed`), flushes sent before it are done (in :attr:`Session.flushed`)."""


@attrs.frozen(slots=True)
class RemountLater:
    """Mount again after ``delay`` seconds (NOT_READY, or the server suspended the feed)."""

    delay: float
    reason: str


@attrs.frozen(slots=True)
class ClientAhead:
    """The server's log ends before the client high-water mark; appends would fail for ever."""

    client_high_water_mark: int


@attrs.define(slots=True)  # not frozen: a frozen attrs class costs a setattr call per field to make
class LockFailed(Generic[T]):
    """The append ``entry`` failed its lock check because of transaction ``transaction_id``.

    Executing it again makes sense once the client applied that transaction; ``applied`` says
    whether it already has (the client high-water mark reached it when the answer came)."""

    entry: PendingAppend[T]
    transaction_id: int
    applied: bool


@attrs.frozen(slots=True)
class Refused(Generic[T]):
    """The server refused the append ``entry`` for good (protocol 4's AppendRefused): fail its
    transaction with the error the code names; sending it again would be refused again."""

    entry: PendingAppend[T]
    error_code: int
    message: str


MOUNTED: Final = Mounted()

Action = Mounted | RemountLater | ClientAhead | LockFailed[T] | Refused[T]


# ------------------------------------------------------------------------------------ session


class Session(Generic[T]):
    """The client side of one partition session (see the module docstring for the rules).

    ``hwm`` is the client high-water mark: the driver advances it as the application applies
    transactions (the sync client does so from a consumer thread: a plain attribute write).
    ``received`` is the highest transaction id the feed delivered.
    """

    __slots__ = ("client_id", "partition_id", "generation", "state", "hwm", "received", "mount_req",
                 "apply_failures", "failed", "flushed", "_last", "_pending", "_flushes", "_flush_targets")

    def __init__(self, client_id: int, partition_id: int, high_water_mark: int = -1) -> None:
        self.client_id = client_id
        self.partition_id = partition_id
        self.generation = -1
        self.state = SessionState.UNMOUNTED
        self.hwm = high_water_mark  #: the client high-water mark (last transaction applied)
        self.received = high_water_mark  #: the highest transaction id received in the feed
        self.mount_req: ReqId | None = None  #: the mount request in flight (MOUNTING only)
        self.apply_failures = 0  #: apply failures in a row (the re-mount backoff)
        self.failed: list[PendingAppend[T]] = []  #: decided FAILED, for the driver to take
        self.flushed: list[int] = []  #: wire sequence numbers of flushes done, for the driver to take
        # Requests are counted with unbounded ints (the wire carries them modulo 2**31): the keys
        # below are these counts, so "sent before" stays "smaller" across a wrap of the wire number.
        self._last = 0  # the count of the last request made
        self._pending: dict[int, PendingAppend[T]] = {}  # insertion order == sequence order
        self._flushes: set[int] = set()  # flushes sent and not done
        self._flush_targets: list[tuple[int, int]] = []  # (flush count, high-water mark the feed must reach)

    def __repr__(self) -> str:
        return (f"Session(partition={self.partition_id}, {self.state.value}, generation={self.generation}, "
                f"hwm={self.hwm}, received={self.received}, pending={len(self._pending)})")

    # ------------------------------------------------------------------------------ state

    def _move(self, event: SessionEvent) -> None:
        try:
            self.state = TRANSITIONS[self.state, event]
        except KeyError:
            raise SessionStateError(f"partition {self.partition_id}: {event.value} in state "
                                    f"{self.state.value}") from None

    def _next_count(self) -> int:
        self._last += 1
        return self._last

    def _count_of(self, seq: int) -> int:
        """The count of the request whose wire sequence number is ``seq``: the latest one made with
        that number (a server only names requests it was sent)."""
        last = self._last
        return last - ((last - seq) & SEQ_MASK)

    def req_id(self, seq: int) -> ReqId:
        """The request id of this session's request ``seq`` (an append's, for drivers that send
        message objects; the client encodes appends from the fields directly)."""
        return ReqId(self.client_id, self.generation, self.partition_id, seq)

    # ------------------------------------------------------------------------- local events

    def bind(self, generation: int) -> None:
        """The partition has a new owner (or the same one at a new ``generation``): mount again.
        Pending appends stay pending; the next READY decides them."""
        self._move(SessionEvent.BIND)
        self.generation = generation
        self.mount_req = None

    def mount(self, network_seq: int) -> m.MountRequest:
        """The mount request to send now (from the client high-water mark). ``network_seq`` is the
        sequence number of the driver's connection: the server ignores mounts of older ones."""
        self._move(SessionEvent.MOUNT)
        req = self.mount_req = self.req_id(self._next_count() & SEQ_MASK)
        return m.MountRequest(req, self.hwm, network_seq)

    def link_lost(self) -> None:
        """The connection to the server is gone: mount again on the next one."""
        self._move(SessionEvent.LINK_LOST)
        self.mount_req = None

    def apply_failed(self) -> float:
        """The application failed to apply a transaction: the session goes UNMOUNTED; returns the
        seconds to wait before mounting again (doubling with failures in a row, capped)."""
        self._move(SessionEvent.APPLY_FAILED)
        self.mount_req = None
        self.apply_failures += 1
        return min(APPLY_RETRY_INITIAL * (1 << min(self.apply_failures - 1, 16)), APPLY_RETRY_MAX)

    def apply_succeeded(self) -> None:
        """Transactions were applied: the next apply failure starts the backoff again."""
        self.apply_failures = 0

    def deactivate(self) -> None:
        """The driver dropped the partition (it waited for its appends to be decided first)."""
        self._move(SessionEvent.DEACTIVATE)
        self.mount_req = None

    def abandon(self) -> list[PendingAppend[T]]:
        """The driver gives the session up (closing): every pending append, oldest first. Their
        fate is UNKNOWN - each may still commit. Flushes in flight are forgotten."""
        out = list(self._pending.values())
        self._pending.clear()
        self._flushes.clear()
        self._flush_targets.clear()
        return out

    def append(self, item: T, attempts: int, now: float, held: tuple[int, ...] | None = None) -> int:
        """An append is being sent: its sequence number (the ReqId ``seq_num`` to send it with).
        ``held``: kept on its entry for the driver (the locks it holds for the append)."""
        self._last = count = self._last + 1
        seq = count & SEQ_MASK
        self._pending[count] = PendingAppend(seq, item, attempts, now, held)
        return seq

    def flush(self) -> m.FlushRequest:
        """The flush request to send now: once answered and the feed reached the answer, every
        append sent before it is decided (its sequence number is :meth:`flush_done`'s key)."""
        count = self._next_count()
        self._flushes.add(count)
        return m.FlushRequest(self.req_id(count & SEQ_MASK))

    # ---------------------------------------------------------------------- server events

    def on_feed(self, client_id: int, seq: int, transaction_id: int) -> PendingAppend[T] | None:
        """A feed record (the fields of its ReqId that matter, and its transaction id): this
        session's append it committed, if any. Raises ProtocolError on a gap in the feed."""
        received = self.received
        if transaction_id > received + 1:
            raise ProtocolError(f"partition {self.partition_id}: the feed jumped from transaction {received} "
                                f"to {transaction_id}")
        entry = None
        if client_id == self.client_id:
            pending = self._pending
            last = self._last
            count = last - ((last - seq) & SEQ_MASK)  # _count_of, inline: once per own commit
            entry = pending.pop(count, None)
            if entry is not None and pending and next(iter(pending)) < count:
                self._fail_before(count)  # older appends of ours were skipped: they failed
        if transaction_id > received:
            self.received = transaction_id
            if self._flush_targets:
                self._check_flushes()
        return entry

    def receive(self, msg: object) -> Action[T] | None:
        """A stream message other than feed data (mount, flush and lock answers, a suspended
        feed): what the driver must do, None when nothing (stale, or decided in the outboxes)."""
        t = type(msg)
        if t is m.MountResponse:
            return self._on_mount_response(msg)  # type: ignore[arg-type]
        if t is m.LockFailure:
            return self._on_lock_failure(msg)  # type: ignore[arg-type]
        if t is m.FlushResponse:
            self._on_flush_response(msg)  # type: ignore[arg-type]
            return None
        if t is m.FeedSuspended:
            return self._on_feed_suspended(msg)  # type: ignore[arg-type]
        if t is m.AppendRefused:
            return self._on_append_refused(msg)  # type: ignore[arg-type]
        return None

    def _on_mount_response(self, msg: m.MountResponse) -> Action[T] | None:
        if msg.req_id != self.mount_req or self.state is not SessionState.MOUNTING:
            return None  # an answer to a superseded mount
        self.mount_req = None
        state = msg.state
        if state is m.PartitionState.READY:
            self._move(SessionEvent.ANSWER_READY)
            count = self._count_of(msg.req_id.seq_num)
            self._fail_before(count)
            self._finish_flushes_before(count)
            return MOUNTED
        if state is m.PartitionState.NOT_READY:
            self._move(SessionEvent.ANSWER_NOT_READY)
            return RemountLater(NOT_READY_RETRY, "the server does not own the partition yet")
        self._move(SessionEvent.ANSWER_CLIENT_AHEAD)
        return ClientAhead(self.hwm)

    def _on_lock_failure(self, msg: m.LockFailure) -> LockFailed[T] | None:
        q = msg.req_id
        return self.on_lock_failure(q.client_id, q.seq_num, msg.transaction_id)

    def on_lock_failure(self, client_id: int, seq: int, transaction_id: int) -> LockFailed[T] | None:
        """A LockFailure (the fields of its ReqId that matter, and its transaction id), without the
        message object: what :meth:`receive` does with one (the client's stream reader calls this)."""
        if client_id != self.client_id:
            return None
        entry = self._pending.pop(self._count_of(seq), None)
        if entry is None:
            return None  # decided already (a READY mount failed it)
        return LockFailed(entry, transaction_id, transaction_id <= self.hwm)

    def _on_append_refused(self, msg: m.AppendRefused) -> Refused[T] | None:
        q = msg.req_id
        if q.client_id != self.client_id:
            return None
        entry = self._pending.pop(self._count_of(q.seq_num), None)
        if entry is None:
            return None  # decided already (a READY mount failed it)
        return Refused(entry, msg.error_code, msg.message)

    def _on_flush_response(self, msg: m.FlushResponse) -> None:
        count = self._count_of(msg.req_id.seq_num)
        if count in self._flushes:
            self._flush_targets.append((count, msg.transaction_id))
            self._check_flushes()

    def _on_feed_suspended(self, msg: m.FeedSuspended) -> RemountLater | None:
        if msg.req_id.generation not in (0, self.generation) or self.state is SessionState.INACTIVE:
            return None  # about an older generation of the partition
        self._move(SessionEvent.FEED_SUSPENDED)
        self.mount_req = None
        return RemountLater(NOT_READY_RETRY, "the server suspended the feed")

    # ------------------------------------------------------------------------------ fates

    def _fail_before(self, count: int) -> None:
        """Every pending append sent before request ``count`` failed."""
        pending = self._pending
        if not pending or next(iter(pending)) >= count:
            return  # the usual case: appends commit in the order they were sent
        failed = self.failed
        for key in list(pending):
            if key >= count:
                break
            failed.append(pending.pop(key))

    def _check_flushes(self) -> None:
        """Flushes whose answer the feed reached are done; appends sent before them failed."""
        received = self.received
        keep = []
        for count, target in self._flush_targets:
            if received >= target:
                self._fail_before(count)
                self._flushes.discard(count)
                self.flushed.append(count & SEQ_MASK)
            else:
                keep.append((count, target))
        self._flush_targets = keep

    def _finish_flushes_before(self, count: int) -> None:
        """A READY mount settles every flush sent before it (the server flushed its queue)."""
        done = sorted(c for c in self._flushes if c < count)
        for c in done:
            self._flushes.discard(c)
        self.flushed.extend(c & SEQ_MASK for c in done)
        self._flush_targets = [(c, t) for c, t in self._flush_targets if c >= count]

    # ---------------------------------------------------------------------------- outboxes

    def take_failed(self) -> list[PendingAppend[T]]:
        """The appends decided FAILED since the last call, oldest first."""
        failed, self.failed = self.failed, []
        return failed

    def take_flushed(self) -> list[int]:
        """The sequence numbers of the flushes done since the last call."""
        flushed, self.flushed = self.flushed, []
        return flushed

    # ----------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        """Appends pending (sent, fate unknown)."""
        return len(self._pending)

    def pending(self) -> Iterator[PendingAppend[T]]:
        """The pending appends, oldest first (a snapshot)."""
        return iter(list(self._pending.values()))

    def oldest(self) -> float | None:
        """When the oldest pending append was sent (the driver's clock), None if none is pending."""
        for entry in self._pending.values():
            return entry.registered
        return None

    @property
    def flushing(self) -> bool:
        """A flush is in flight (sent, not done)."""
        return bool(self._flushes)

    def flush_done(self, seq: int) -> bool:
        """Whether the flush with (wire) sequence number ``seq`` is done (or unknown)."""
        return self._count_of(seq) not in self._flushes

    def wants_flush(self, now: float | None = None, threshold: float = 0.0) -> bool:
        """Whether a flush should be sent: the session is READY, appends are pending, no flush is in
        flight, and (with ``now``) the oldest append waited longer than ``threshold`` seconds."""
        if self.state is not SessionState.READY or self._flushes or not self._pending:
            return False
        if now is None:
            return True
        oldest = self.oldest()
        return oldest is not None and now - oldest > threshold


__all__ = [
    "APPLY_RETRY_INITIAL", "APPLY_RETRY_MAX", "MOUNTED", "NOT_READY_RETRY", "SEQ_MASK", "TRANSITIONS", "Action",
    "ClientAhead", "LockFailed", "Mounted", "PendingAppend", "RemountLater", "Session", "SessionEvent",
    "SessionState", "SessionStateError",
]
