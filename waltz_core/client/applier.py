"""The applier: one task per partition handing the feed to the application, in order.

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
records that yields only when application code returned an awaitable. The async client drives
it on the loop (:meth:`Applier._apply_async`: the awaitable is awaited and its outcome sent back
in); the sync client drives it on the partition's consumer thread through the dispatcher
(:meth:`Applier._apply_threaded`: an awaitable there is an ``async def`` callback given to the
blocking client, an error). A batch costs one generator; a transaction costs nothing extra when
the callbacks are plain functions.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any

from ..errors import ClientError
from ..protocol.session import SessionState
from .api import Transaction
from .dispatch import call_logged, is_awaitable, name_of

if TYPE_CHECKING:
    from .api import TransactionDataSource
    from .context import ClientContext
    from .partition import FeedItem, Partition
    from .sender import Sender

log = logging.getLogger("waltz.client")

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

    def start(self, p: Partition) -> None:
        """Start the partition's apply task (stored in ``p.consumer``)."""
        loop = self._ctx.loop
        assert loop is not None
        p.consumer = loop.create_task(self._consume(p), name=f"waltz-client-apply-p{p.id}")

    async def _consume(self, p: Partition) -> None:
        ctx = self._ctx
        dispatcher = ctx.dispatcher
        feed = p.feed
        while True:
            if not feed:
                await feed.wait()
            batch = feed.take(APPLY_BATCH)
            if dispatcher.threaded:
                failure = await dispatcher.call(p.id, self._apply_threaded, p, batch)
            else:
                failure = await self._apply_async(p, batch)
            if p.lock_waits:
                self._sender.release_lock_waits(p)
            ctx.ping()
            if failure is not None:
                await self._after_failure(p)
            else:
                p.session.apply_succeeded()

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

    async def _apply_async(self, p: Partition, batch: list[FeedItem]) -> BaseException | None:
        """Drive :meth:`_apply` on the loop: awaitables are awaited, their outcome sent back in."""
        run = self._apply(p, batch)
        try:
            pending = next(run)
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
