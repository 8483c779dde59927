"""The sender: the one path a transaction takes to the server, and back when it must go again.

:meth:`Sender.submit` is that path, for a first attempt (``AsyncWaltzClient.submit``,
``WaltzClient.submit``) and for every re-execution (the retry workers) alike:

1. refuse an expired context (``on_expiration``) and resolve its partition;
2. take an in-flight slot of the partition (:meth:`Sender.acquire`): wait until the partition is
   mounted (READY) and fewer than ``client.max_concurrent_transactions`` appends are in flight;
   slots are handed to waiters first come, first served;
3. build: a :class:`~.api.TransactionBuilder` at the client high-water mark, filled by
   ``execute`` - where the dispatcher says (first attempts: where ``submit`` was called;
   re-executions: the retry side);
4. send: register the append in the partition's session and post it on the stream (dropped if
   the link is down: the next READY decides it).

An append's fate comes back through the stream (:mod:`.stream`, decided by the session): committed
(the slot is released), failed (released, queued for re-execution), lock-failed (released, waits in
the partition's :class:`~.partition.LockWaits` until the application applied the conflicting
transaction, then queued). A transaction that writes or reads a lock an own append in flight
(or not yet applied) will advance is not sent: it waits in the partition's
:class:`~.partition.HeldLocks` until that append is applied or failed, then is queued. The retry
workers (``client.num_retry_workers``) take the queue and run the same path with ``attempts`` > 0.
The nudge loop flushes a partition whose oldest pending append waited longer than
``client.long_wait_threshold`` (the flush rule then decides it).

Event loop only. The per-transaction part (fast path of step 2, steps 3 and 4) makes no coroutine
other than ``submit`` itself when application code runs on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from ..errors import (
    ClientAheadError,
    ClientClosedError,
    ClientError,
    ClientTimeoutError,
    TransactionTooLargeError,
    error_from_wire,
)
from ..protocol import client as m
from ..protocol.session import LockFailed, Refused, SessionState
from ..timeouts import wait_for
from .api import TransactionBuilder, TransactionContext
from .dispatch import is_awaitable
from .partition import Partition, Pending, handed

if TYPE_CHECKING:
    from ..metrics import Counter
    from .context import ClientContext
    from .link import ServerLink

log = logging.getLogger("waltz.client")

SLOT_WAIT = 10.0  #: seconds a submit waits for an in-flight slot before nudging with a flush (original)

_READY = SessionState.READY
_AHEAD = SessionState.AHEAD
_INACTIVE = SessionState.INACTIVE


def _append_body(builder: TransactionBuilder) -> int:
    """What a transaction's append carries that the frame's headroom does not: data and locks."""
    return len(builder.data) + m.APPEND_LOCK_SIZE * (len(builder.write_locks) + len(builder.read_locks) +
                                                     len(builder.append_locks))


def _expired(context: TransactionContext, attempts: int) -> bool:
    # The expiry check is the context's own (it knows its clock); its name is private because the
    # public names of a TransactionContext belong to the application's subclass.
    return context._expired(attempts)  # noqa: SLF001 - the client is the one caller of this hook


class Sender:
    """Submits, sends and re-executes the transactions of one client (see the module docstring)."""

    def __init__(self, ctx: ClientContext, *, lock_failures: Counter, lock_waits: Counter, retries: Counter) -> None:
        self._ctx = ctx
        self._partitions = ctx.partitions
        self._cap = ctx.config.client.max_concurrent_transactions
        #: the data and locks a transaction may carry (the frames that carry it need the headroom)
        self._max_frame = ctx.config.transport.max_frame_size
        self._max_append_body = self._max_frame - m.TRANSACTION_FRAME_HEADROOM
        #: transactions that ended refused (a server's smaller limits, its refusals): logged 1st, 2nd, 4th, ...
        self._refusals = 0
        self._m_lock_failures = lock_failures
        self._m_lock_waits = lock_waits
        self._m_retries = retries
        #: contexts to execute again, with their executions so far: a deque the retry workers
        #: take from, woken one per queued context (an asyncio.Queue costs a coroutine per get)
        self._queue: deque[tuple[TransactionContext, int]] = deque()
        self._idle_workers: deque[asyncio.Future[None]] | None = None  #: set by start()
        self._retrying = 0  #: contexts a retry worker took and has not finished with
        #: id(context) -> (partition, lock): a freed lock reserved to a held-back transaction
        #: until its next execution ends
        self._reserved: dict[int, tuple[Partition, int]] = {}

    def start(self) -> None:
        """Start the retry workers and the nudge loop (on the client's loop)."""
        ctx = self._ctx
        self._idle_workers = deque()
        for i in range(max(1, ctx.config.client.num_retry_workers)):
            ctx.spawn(self._retry_worker(), name=f"waltz-client-retry-{i}")
        ctx.spawn(self._nudge_loop(), name="waltz-client-nudge")

    # ---------------------------------------------------------------------------- submitting

    def partition_of(self, context: TransactionContext) -> int:
        return self._checked_partition(context, context.partition_id(self._ctx.num_partitions))

    def _checked_partition(self, context: TransactionContext, pid: object) -> int:
        num_partitions = self._ctx.num_partitions
        if not isinstance(pid, int) or not 0 <= pid < num_partitions:
            raise ClientError(f"{type(context).__name__}.partition_id() returned {pid!r}, "
                              f"not a partition in 0..{num_partitions - 1}")
        return pid

    async def submit(self, context: TransactionContext, attempts: int, timeout: float | None) -> None:
        """Run one attempt of ``context`` (``attempts`` executions done so far) up to the send.

        ``timeout`` bounds the wait for the partition to mount (ClientTimeoutError). On a first
        attempt an exception of ``execute`` is re-raised after ``on_exception``; on a
        re-execution it ends there.
        """
        ctx = self._ctx
        if ctx.closed or not ctx.started:
            ctx.check_open()
        first = attempts == 0
        # _expired only when the context has a limit (most have none: two attribute reads, no call)
        if (context.max_retries is not None or context.timeout is not None) and _expired(context, attempts):
            await (ctx.notify_submitter if first else ctx.notify)(context.on_expiration)
            return
        num_partitions = ctx.num_partitions
        pid = context.partition_id(num_partitions)
        if type(pid) is not int or not 0 <= pid < num_partitions:
            pid = self._checked_partition(context, pid)  # raises unless an int subclass in range
        p = self._partitions.get(pid)
        if p is not None and p.session.state is _READY and p.inflight < self._cap:
            p.inflight += 1  # acquire()'s answer when the partition is mounted and has a free slot
        else:
            p = await self.acquire(pid, timeout)
            if not first and _expired(context, attempts):  # the wait may have been long
                p.release_slot()
                await ctx.notify(context.on_expiration)
                return
        builder = TransactionBuilder(pid, p.session.hwm)
        dispatcher = ctx.dispatcher
        try:
            if not dispatcher.threaded:
                ok = context.execute(builder)
                if ok is not True and is_awaitable(ok):
                    ok = await ok
                if ok:
                    self._check_size(context, builder)
            elif first:
                ok = await dispatcher.call_submitter(self._execute, context, builder, final_if_true=True)
            else:
                ok = await dispatcher.call_retry(self._execute, context, builder)
        except BaseException as exc:
            p.release_slot()
            if isinstance(exc, Exception):
                await (ctx.notify_submitter if first else ctx.notify)(context.on_exception, exc)
                if not first:
                    return
            raise
        if not ok:
            p.release_slot()
            await (ctx.notify_submitter if first else ctx.notify)(context.on_completion, False)
            return
        self.send(p, context, builder, attempts + 1)

    def _execute(self, context: TransactionContext, builder: TransactionBuilder) -> object:
        """``execute`` then the size check, on an application thread: a refusal is an exception of
        that thread's call, which ``WaltzClient.submit`` raises (it returns once execute said yes)."""
        ok = context.execute(builder)
        if ok and not is_awaitable(ok):  # an awaitable is refused by the dispatcher
            self._check_size(context, builder)
        return ok

    def _check_size(self, context: TransactionContext, builder: TransactionBuilder) -> None:
        """TransactionTooLargeError for data and locks that no frame could carry: sent, the append
        would break the link (a frame that cannot be written) or the partition (a record no
        replica link can carry), and neither would tell the submitter."""
        body = _append_body(builder)
        if body > self._max_append_body:
            raise TransactionTooLargeError(
                f"{type(context).__name__} (partition {builder.partition_id}) carries {len(builder.data)} bytes "
                f"of data and {body - len(builder.data)} of locks; with transport.max_frame_size = "
                f"{self._max_frame} a transaction may carry {self._max_append_body}. Split the data over several "
                f"transactions, or raise max_frame_size on every client, server and storage node")

    async def acquire(self, pid: int, timeout: float | None) -> Partition:
        """Wait until the partition is mounted and has an in-flight slot; take the slot."""
        ctx = self._ctx
        if ctx.closed:
            raise ClientClosedError("the client is closed")
        p = self._partitions.get(pid)
        if p is None or p.session.state is _INACTIVE:
            raise ClientError(f"partition {pid} is not mounted by this client")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if ctx.closed:
                raise ClientClosedError("the client is closed")
            state = p.session.state
            if state is _AHEAD:
                raise ClientAheadError(f"partition {pid}: the client high-water mark {p.session.hwm} is ahead of the log")
            if state is _INACTIVE:
                raise ClientError(f"partition {pid} is not mounted by this client")
            if state is not _READY:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ClientTimeoutError(f"partition {pid} not mounted within {timeout}s")
                try:
                    await wait_for(p.ready.wait(), remaining)
                except TimeoutError:
                    raise ClientTimeoutError(f"partition {pid} not mounted within {timeout}s") from None
                continue
            if p.inflight < self._cap:
                p.inflight += 1
                return p
            slot: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            p.slot_waiters.append(slot)
            try:
                await wait_for(slot, SLOT_WAIT)
            except TimeoutError:
                p.forget_slot_waiter(slot)
                if not p.session.flushing:  # original: after 10 s the client flushes and tries again
                    self.send_flush(p)
            except asyncio.CancelledError:
                if handed(slot):
                    p.release_slot()  # handed a slot as we were cancelled: pass it on
                else:
                    p.forget_slot_waiter(slot)
                raise
            # Checked after a timeout too: a slot handed over as the timeout fired is ours.
            if handed(slot):
                if not ctx.closed and p.session.state is _READY:
                    return p  # inflight already counts the slot passed to us
                p.release_slot()  # the partition changed while we waited: re-check from the top

    def send(self, p: Partition, context: TransactionContext, builder: TransactionBuilder, attempts: int) -> None:
        """Register the append in the session and post it (the slot is taken); its fate comes from the stream."""
        ctx = self._ctx
        if ctx.closed:
            p.release_slot()
            ctx.spawn(ctx.notify(context.on_exception, ClientClosedError("the client is closed")))
            return
        link = p.link
        if link is not None:
            limit = link.max_append_body
            if limit is not None and limit < self._max_append_body and self._over(p, link, context, builder, limit):
                return
        w, r, a = builder.write_locks, builder.read_locks, builder.append_locks
        advances = None
        if w or r or a:
            held = p.held
            if w or r:
                commits = held.commits
                if commits and commits[0][0] <= p.session.hwm:
                    # Appends applied since the last apply batch ended hold nothing (the sync
                    # client applies on its consumer threads, and an application may submit
                    # from on_application).
                    self._reserve(p, held.release_applied(p.session.hwm))
                if held.locks or held.reserved:
                    reservation = self._reserved.get(id(context)) if self._reserved else None
                    lock = held.conflict(w, r, reservation is not None and reservation[0] is p)
                    if lock is not None:
                        self._hold_back(p, context, attempts, lock)
                        return
            advances = (w + a if a else w) or None
            if advances is not None:
                locks = held.locks  # held.hold(advances), inline: once per locked transaction
                for lock in advances:
                    locks[lock] = locks.get(lock, 0) + 1
        session = p.session
        seq = session.append(context, attempts, time.monotonic(), advances)
        if link is not None:
            link.post_frame(m.encode_append(session.client_id, session.generation, p.id, seq,
                                            builder.client_high_water_mark, w, r, a, builder.header, builder.data,
                                            builder.checksum))

    def _hold_back(self, p: Partition, context: TransactionContext, attempts: int, lock: int) -> None:
        """Not sent: an own append will advance ``lock``, which this transaction (executed before
        that append was applied) writes or reads, so the server would fail it for certain. It
        goes again once that append is applied or has failed (see :class:`~.partition.HeldLocks`)."""
        p.release_slot()
        self._m_lock_waits.inc()
        ctx = self._ctx
        ctx.notify_soon(context.on_lock_failure)
        p.held.wait(lock, context, attempts)
        ctx.ping()

    def _over(self, p: Partition, link: ServerLink, context: TransactionContext, builder: TransactionBuilder,
              limit: int) -> bool:
        """True, and the transaction ends with TransactionTooLargeError, if it carries more than the
        partition's server takes (it allows smaller frames than this client): the frame would close
        the stream connection, again at every retry."""
        body = _append_body(builder)
        if body <= limit:
            return False
        p.release_slot()
        exc = TransactionTooLargeError(
            f"{type(context).__name__} (partition {p.id}) carries {body} bytes of data and locks; the server "
            f"{link.endpoint} takes {limit} (its transport.max_frame_size is smaller than this "
            f"client's {self._max_frame}: keep it the same on every client, server and storage node)")
        self._log_refusal("%s", exc)
        self._ctx.notify_soon(context.on_exception, exc)
        return True

    def send_flush(self, p: Partition) -> None:
        """Ask the partition's server for a flush; if the link is down, the next READY settles it."""
        request = p.session.flush()
        if p.link is not None:
            p.link.post(request)

    # ----------------------------------------------------------------------------- fates

    def failed(self, p: Partition, entries: list[Pending]) -> None:
        """Appends the session decided FAILED: free their slots and execute them again."""
        for entry in entries:
            p.release_slot()
            if entry.held is not None:
                self._release(p, entry)
            self.retry(entry)

    def _release(self, p: Partition, entry: Pending) -> None:
        """The append of ``entry`` will not commit: release its locks."""
        held, entry.held = entry.held, None
        assert held is not None
        self._reserve(p, p.held.release(held))

    def _reserve(self, p: Partition, released: list[tuple[TransactionContext, int, int]]) -> None:
        """Execute again the transactions a freed lock was reserved to; each reservation ends
        when that execution does (:meth:`_end_reservation`)."""
        for context, attempts, lock in released:
            self._reserved[id(context)] = (p, lock)
            self._requeue(context, attempts)

    def _end_reservation(self, context: TransactionContext) -> None:
        """An execution of ``context`` ended (sent, held back, refused by ``execute``, failed): the
        lock reserved to it goes on to the next waiter unless its append now holds it."""
        reservation = self._reserved.pop(id(context), None)
        if reservation is not None:
            p, lock = reservation
            self._reserve(p, p.held.end_reservation(lock))

    def lock_failed(self, p: Partition, decision: LockFailed[TransactionContext]) -> None:
        """An append failed its lock check: retry once the client applied the conflicting transaction."""
        entry = decision.entry
        p.release_slot()
        self._m_lock_failures.inc()
        ctx = self._ctx
        ctx.notify_soon(entry.item.on_lock_failure)
        held = entry.held
        if decision.applied:
            if held is not None:
                self._release(p, entry)
            self.retry(entry)
        elif held is not None:
            # What it held back would be as stale as it was: its locks stay held until the
            # conflicting transaction is applied, and then go to it first.
            entry.held = None
            p.held.held_until(decision.transaction_id, held)
            p.held.wait_first(held[0], entry.item, entry.attempts)
        else:
            p.lock_waits.add(decision.transaction_id, entry)
        ctx.ping()

    def refused(self, p: Partition, decision: Refused[TransactionContext]) -> None:
        """The server will never take this append: its transaction ends with the error, no retry."""
        p.release_slot()
        if decision.entry.held is not None:
            self._release(p, decision.entry)
        exc = error_from_wire(decision.error_code, decision.message)
        self._log_refusal("partition %d refused an append of %s: %s", p.id, type(decision.entry.item).__name__, exc)
        self._ctx.notify_soon(decision.entry.item.on_exception, exc)
        self._ctx.ping()

    def _log_refusal(self, text: str, *args: object) -> None:
        """Log a transaction ended for its size or locks: the 1st, 2nd, 4th, 8th, ... (the
        application hears each one in ``on_exception``; an application that keeps making them
        must not flood the log)."""
        self._refusals += 1
        if self._refusals & (self._refusals - 1) == 0:
            log.warning("client %d: " + text + " (%d such transactions so far)", self._ctx.client_id, *args,
                        self._refusals)

    def release_lock_waits(self, p: Partition) -> None:
        """After an apply batch: lock-failed appends whose conflict the application applied go again."""
        for entry in p.lock_waits.release(p.session.hwm):
            self.retry(entry)

    def release_applied(self, p: Partition) -> None:
        """After an apply batch: the locks of own appends applied are free; what waited goes again."""
        self._reserve(p, p.held.release_applied(p.session.hwm))

    def retry(self, entry: Pending) -> None:
        self._requeue(entry.item, entry.attempts)

    def _requeue(self, context: TransactionContext, attempts: int) -> None:
        ctx = self._ctx
        if not ctx.closed:
            idle = self._idle_workers
            assert idle is not None
            self._queue.append((context, attempts))
            if idle:
                self._wake_one(idle)
            self._m_retries.inc()
            ctx.ping()

    @staticmethod
    def _wake_one(idle: deque[asyncio.Future[None]]) -> None:
        """Wake one waiting retry worker (as asyncio.Queue.put_nowait wakes one getter)."""
        while idle:
            waiter = idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _retry_worker(self) -> None:
        idle = self._idle_workers
        assert idle is not None
        queue = self._queue
        ctx = self._ctx
        loop = asyncio.get_running_loop()
        while True:
            while not queue:
                waiter: asyncio.Future[None] = loop.create_future()
                idle.append(waiter)
                try:
                    await waiter
                except asyncio.CancelledError:
                    if waiter.done() and not waiter.cancelled() and queue:
                        self._wake_one(idle)  # woken as we were cancelled: pass the wake-up on
                    elif waiter in idle:
                        idle.remove(waiter)
                    raise
            context, attempts = queue.popleft()
            self._retrying += 1
            try:
                await self.submit(context, attempts, None)
            except ClientClosedError:
                await ctx.notify(context.on_exception, ClientClosedError("the client was closed"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - partition_id() raised, client ahead, ...: to on_exception
                await ctx.notify(context.on_exception, exc)
            finally:
                self._retrying -= 1
                if self._reserved:
                    self._end_reservation(context)
                ctx.ping()

    async def _nudge_loop(self) -> None:
        """Flush partitions whose oldest pending append waited longer than ``long_wait_threshold``."""
        threshold = self._ctx.config.client.long_wait_threshold
        period = min(max(threshold / 4, 0.01), 1.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for p in self._partitions.values():
                if p.session.wants_flush(now, threshold):
                    self.send_flush(p)

    # ---------------------------------------------------------------------------- queries

    def idle(self) -> bool:
        """No re-execution queued or running."""
        return not self._retrying and not self._queue

    def has_pending(self) -> bool:
        """Appends in flight, waiting for a lock retry, or queued for re-execution."""
        if not self.idle():
            return True
        return any(p.inflight or p.lock_waits or p.held for p in self._partitions.values())

    def pending_count(self) -> int:
        """For the pending-appends gauge, from any thread (the partition list is copied first)."""
        queued = len(self._queue)
        return sum(len(p.session) + len(p.lock_waits) + len(p.held)
                   for p in list(self._partitions.values())) + queued + self._retrying

    def abandon(self) -> list[TransactionContext]:
        """Closing: every context whose outcome is unknown (in flight, waiting for a lock retry,
        queued for re-execution), for ``on_exception(ClientClosedError)``."""
        unknown: list[TransactionContext] = []
        for p in self._partitions.values():
            unknown.extend(e.item for e in p.session.abandon())
            unknown.extend(e.item for e in p.lock_waits.drain())
            unknown.extend(p.held.drain())
        self._reserved.clear()
        queue = self._queue
        while queue:
            unknown.append(queue.popleft()[0])
        return unknown
