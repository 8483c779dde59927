"""The applier: the feed of every partition handed to the application, in order per partition.

``apply_transaction`` runs strictly in transaction-id order per partition, without gaps: records
other than client high-water mark + 1 (delivered again after a re-mount) are skipped. For an own
transaction, ``on_completion(True)`` comes first (once, even if the apply is repeated), then the
apply, then ``on_application``. The client high-water mark (``session.hwm``) advances after each
successful apply; lock-failed appends waiting for a transaction the application has now applied
go back to the sender after each batch.

If ``apply_transaction`` raises: ``uncaught_exception``, the rest of the queue is dropped and the
partition is mounted again from the client high-water mark after a backoff, so the transaction
is delivered again.

One apply loop serves both clients. :meth:`Applier._apply` is a generator over one batch of feed
records that yields only when application code returned an awaitable. A batch costs one
generator; a transaction costs nothing extra when the callbacks are plain functions.

* The async client applies every partition from **one task** (:meth:`Applier._pump`): a
  partition whose feed queue gets records is queued for it (:meth:`Inbox.arm
  <waltz_core.inbox.Inbox.arm>`), and the task applies a batch of each queued partition in turn.
  A task per partition cost a future and a task wake-up per partition and commit, the largest
  item of a client with many partitions (docs/performance.md). A partition whose application
  code returned an awaitable, or whose apply failed, goes on in a task of its own
  (``p.consumer``: the awaitable is awaited and its outcome sent back in; a failure waits out its
  backoff) and comes back to the shared task when that is done, so it never holds up the others.
* The sync client drives :meth:`_apply` on the partition's consumer thread through the
  dispatcher (:meth:`Applier._apply_threaded`: an awaitable there is an ``async def`` callback
  given to the blocking client, an error), from a task per partition (:meth:`Applier._consume`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any

from ..errors import ClientError
from ..inbox import Inbox
from ..protocol.session import SessionState
from .api import Transaction
from .dispatch import call_logged, is_awaitable, name_of

if TYPE_CHECKING:
    from .api import TransactionDataSource
    from .context import ClientContext
    from .partition import FeedItem, Partition
    from .sender import Sender

log = logging.getLogger("waltz.client")

_INACTIVE = SessionState.INACTIVE

APPLY_BATCH = 256  #: feed records handed to the application per consumer wake-up

#: What :meth:`Applier._apply` yields (an awaitable some application code returned) and returns
#: (the exception of a failed apply, or None).
_Batch = Generator[Awaitable[Any], Any, "BaseException | None"]


def _logged(pending: Awaitable[Any], fn: Callable[..., Any]) -> Generator[Awaitable[Any], Any, None]:
    """Yield an outcome callback's awaitable; its exception is logged, never raised."""
    try:
        yield pending
    except Exception:
        log.exception("%s raised", name_of(fn))


class Applier:
    """Applies the feed of every partition of one client (see the module docstring)."""

    def __init__(self, ctx: ClientContext, sender: Sender, remount: Callable[[Partition], None],
                 source: TransactionDataSource) -> None:
        self._ctx = ctx
        self._sender = sender
        self._remount = remount
        self._source = source  #: where Transaction.fetch_data gets the data
        #: the async client's partitions with records to apply, in the order they got them (each
        #: at most once: the queue never fills)
        self._ready: Inbox[Partition] = Inbox(sys.maxsize)
        self._pump_task: asyncio.Task[None] | None = None

    def start(self, p: Partition) -> None:
        """Start applying the partition's feed."""
        ctx = self._ctx
        if ctx.dispatcher.threaded:
            loop = ctx.loop
            assert loop is not None
            p.consumer = loop.create_task(self._consume(p), name=f"waltz-client-apply-p{p.id}")
            return
        if self._pump_task is None:
            self._pump_task = ctx.spawn(self._pump(), name=f"waltz-client-{ctx.client_id}-apply")
        p.feed.arm(functools.partial(self._ready_to_apply, p))

    # ------------------------------------------------------------- the async client: one task

    def _ready_to_apply(self, p: Partition) -> None:
        """A put into the partition's armed feed queue (called by the stream reader)."""
        self._ready.put(p)

    async def _pump(self) -> None:
        ready = self._ready
        while True:
            if ready:
                await asyncio.sleep(0)  # a pass left partitions with more: let the loop read in between
            else:
                await ready.wait()
            for _ in range(len(ready)):  # those queued now; a partition with more goes to the back
                p = ready.popleft()
                try:
                    self._apply_next(p)
                except Exception:  # a bug: this partition stops, the others go on
                    log.exception("client %d: applying partition %d failed", self._ctx.client_id, p.id)

    def _apply_next(self, p: Partition) -> None:
        """Apply one batch of the partition's feed queue, on the shared task if the application
        code returns no awaitable; then queue the partition again or arm its feed queue."""
        if p.state is _INACTIVE or p.consumer is not None:
            return  # deactivated, or going on in its own task (which queues it again when done)
        feed = p.feed
        if not feed:
            feed.arm(functools.partial(self._ready_to_apply, p))
            return
        run = self._apply(p, feed.take(APPLY_BATCH))
        try:
            pending = next(run)
        except StopIteration as stop:
            failure: BaseException | None = stop.value
        else:
            loop = self._ctx.loop
            assert loop is not None
            p.consumer = loop.create_task(self._apply_rest(p, run, pending), name=f"waltz-client-apply-p{p.id}")
            return
        if self._batch_done(p, failure):
            self._after_batch(p)
        else:
            loop = self._ctx.loop
            assert loop is not None
            p.consumer = loop.create_task(self._recover(p), name=f"waltz-client-apply-p{p.id}")

    def _after_batch(self, p: Partition) -> None:
        """Queue the partition for the shared task again if its feed queue has more, else arm it."""
        if p.feed:
            self._ready_to_apply(p)  # from the shared task: its current pass leaves p for the next
        else:
            p.feed.arm(functools.partial(self._ready_to_apply, p))

    async def _apply_rest(self, p: Partition, run: _Batch, pending: Awaitable[Any]) -> None:
        """The rest of a batch whose application code returned an awaitable, in the partition's own task."""
        try:
            failure = await self._drive(run, pending)
            if not self._batch_done(p, failure):
                await self._after_failure(p)
        finally:
            p.consumer = None
        if p.state is not _INACTIVE:
            self._after_batch(p)

    async def _recover(self, p: Partition) -> None:
        """A failed apply: the backoff and the re-mount, in the partition's own task."""
        try:
            await self._after_failure(p)
        finally:
            p.consumer = None
        if p.state is not _INACTIVE:
            self._after_batch(p)

    def _batch_done(self, p: Partition, failure: BaseException | None) -> bool:
        """What follows each batch; False if the apply failed (the caller recovers)."""
        if p.lock_waits:
            self._sender.release_lock_waits(p)
        if p.held.applying:
            self._sender.release_applied(p)
        self._ctx.ping()
        if failure is not None:
            return False
        p.session.apply_succeeded()
        return True

    # -------------------------------------------------------------- the sync client: per partition

    async def _consume(self, p: Partition) -> None:
        dispatcher = self._ctx.dispatcher
        feed = p.feed
        while True:
            if not feed:
                await feed.wait()
            failure = await dispatcher.call(p.id, self._apply_threaded, p, feed.take(APPLY_BATCH))
            if not self._batch_done(p, failure):
                await self._after_failure(p)

    # ------------------------------------------------------------------------ the apply loop

    def _apply(self, p: Partition, batch: list[FeedItem]) -> _Batch:
        """Apply one batch (see the module docstring); returns the apply failure, if any."""
        callbacks = self._ctx.callbacks
        apply = callbacks.apply_transaction
        session = p.session
        owns = p.own
        completed = p.completed
        source = self._source
        pid = p.id
        for fields in batch:
            tid = fields[4]
            if tid != session.hwm + 1:
                continue
            context = owns.get(tid) if owns else None
            if context is not None and not (completed and tid in completed):
                # call_logged, inline: once per own transaction
                try:
                    pending = context.on_completion(True)
                except Exception:
                    log.exception("%s raised", name_of(context.on_completion))
                else:
                    if pending is not None and is_awaitable(pending):
                        yield from _logged(pending, context.on_completion)
            try:
                result = apply(Transaction(pid, tid, fields[5], fields, source))
                if result is not None and is_awaitable(result):
                    yield result
            except Exception as exc:  # noqa: BLE001 - the application's: to uncaught_exception
                if context is not None:
                    completed.add(tid)  # on_completion(True) is not called again on the redelivery
                log.warning("client %d: apply_transaction(partition %d, transaction %d) failed: %r",
                            self._ctx.client_id, pid, tid, exc)
                pending = call_logged(callbacks.uncaught_exception, pid, tid, exc)
                if pending is not None:
                    yield from _logged(pending, callbacks.uncaught_exception)
                return exc
            session.hwm = tid
            if context is not None:
                owns.pop(tid, None)
                if completed:
                    completed.discard(tid)
                try:
                    pending = context.on_application()
                except Exception:
                    log.exception("%s raised", name_of(context.on_application))
                else:
                    if pending is not None and is_awaitable(pending):
                        yield from _logged(pending, context.on_application)
        return None

    @staticmethod
    async def _drive(run: _Batch, pending: Awaitable[Any]) -> BaseException | None:
        """Drive :meth:`_apply` on the loop from its first awaitable: each is awaited, its outcome sent back in."""
        try:
            while True:
                try:
                    result = await pending
                except Exception as exc:  # noqa: BLE001 - thrown into the apply loop, which decides
                    pending = run.throw(exc)
                else:
                    pending = run.send(result)
        except StopIteration as stop:
            failure: BaseException | None = stop.value
            return failure

    def _apply_threaded(self, p: Partition, batch: list[FeedItem]) -> BaseException | None:
        """Drive :meth:`_apply` on a consumer thread of the sync client."""
        run = self._apply(p, batch)
        try:
            pending = next(run)
            while True:
                if inspect.iscoroutine(pending):
                    pending.close()  # never awaited: not a warning on top of the error
                pending = run.throw(ClientError("an async callback was given to WaltzClient: use AsyncWaltzClient "
                                                "for async callbacks"))
        except StopIteration as stop:
            failure: BaseException | None = stop.value
            return failure

    async def _after_failure(self, p: Partition) -> None:
        """Drop what is queued and mount again from the client high-water mark (redelivery)."""
        if p.state is SessionState.INACTIVE:
            return
        delay = p.apply_failed()
        await asyncio.sleep(delay)
        if p.state is SessionState.UNMOUNTED and p.link is not None:
            self._remount(p)
