"""``AsyncWaltzClient``: the client library on one asyncio event loop (seed 001 "Waltz Client").

Per partition the client keeps: the client high-water mark (last transaction applied by the
application), the owner (server endpoint, generation), a :class:`~.monitor.TransactionMonitor`,
lock waits, the in-flight count (back pressure) and a feed queue consumed by one apply task, so
``apply_transaction`` runs strictly in transaction-id order per partition.

Fate of an append: decided from the stream only (see :mod:`.monitor`). A failed append's context
goes to the retry queue and is re-executed by a retry worker; a lock-failed one waits until the
client applied the conflicting transaction.

Reconnect (seed "Detection of Failed Append Requests"): a lost stream connection blocks appends
of its partitions, a new network client (higher sequence number) connects and re-mounts them;
when a mount is answered READY every append sent before it has failed (the server flushed its
queue before answering) and appends are unblocked. A partition that moves (assignment watch: new
endpoint or generation) goes through the same mount. ``apply_transaction`` raising re-mounts the
partition from the client high-water mark, so the transaction is delivered again.

Threading: everything here runs on the client's event loop. Application code is called through
a *dispatcher*: inline on the loop for the async client (``async def`` callbacks are awaited), or
on the sync client's consumer/retry threads (:mod:`.sync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Self, TypeGuard

from ..config import ClientProcessConfig
from ..coordination.recipes import PartitionOwner
from ..errors import (
    ClientAheadError,
    ClientClosedError,
    ClientError,
    ClientTimeoutError,
    ConfigError,
    TransportError,
)
from ..inbox import Inbox
from ..metrics import MetricsRegistry
from ..plugins import Registries, core_version
from ..protocol import client as m
from ..protocol.wire import ReqId
from ..transport import is_plaintext, open_transport
from .api import Transaction, TransactionBuilder, TransactionContext, WaltzClientCallbacks
from .discovery import CoordinationDiscovery, Discovery
from .link import ServerLink
from .monitor import LockWaits, PendingAppend, TransactionMonitor
from .readahead import DataReader

log = logging.getLogger("waltz.client")

_SEQ_MASK = 0x7FFFFFFF
APPLY_BATCH = 256  #: feed records handed to the application per consumer wake-up
FEED_QUEUE = 4096  #: feed records buffered per partition before the stream reader waits
NOT_READY_RETRY = 0.5  #: seconds before a NOT_READY mount is retried (original)
SLOT_WAIT = 10.0  #: seconds a submit waits for an in-flight slot before nudging with a flush (original)


def _awaitable(result: object) -> TypeGuard[Awaitable[Any]]:
    """``inspect.isawaitable`` with a fast answer for what callbacks usually return (None, a bool)."""
    return result is not None and result is not True and result is not False and inspect.isawaitable(result)


class InlineDispatcher:
    """Application code on the event loop; coroutine results are awaited."""

    threaded = False

    async def call(self, partition_id: int, fn: Callable[..., Any], *args: Any) -> Any:
        result = fn(*args)
        if _awaitable(result):
            result = await result
        return result

    async def call_retry(self, fn: Callable[..., Any], *args: Any) -> Any:
        result = fn(*args)
        if _awaitable(result):
            result = await result
        return result

    def close(self) -> None:
        pass


class _Own:
    """An own transaction seen committed and not yet applied."""

    __slots__ = ("context", "completed")

    def __init__(self, context: TransactionContext) -> None:
        self.context = context
        self.completed = False


#: A feed record waiting to be applied: (transaction id, header, req id, own transaction or None).
#: A plain tuple: one is made per transaction on the hot path.
_FeedItem = tuple[int, int, ReqId, "_Own | None"]


class _Partition:
    """Client-side state of one partition (event loop only, except ``hwm`` which the sync
    client's consumer thread advances)."""

    def __init__(self, partition_id: int) -> None:
        self.id = partition_id
        self.hwm = -1  #: client high-water mark (last applied)
        self.received = -1  #: highest transaction id received in the feed
        self.owner: PartitionOwner | None = None
        self.generation = -1
        self.link: ServerLink | None = None
        self.state = "unmounted"  # unmounted | mounting | ready | ahead | inactive
        self.ready = asyncio.Event()
        self.mount_req: ReqId | None = None
        self.mount_retry: asyncio.TimerHandle | None = None
        self._seq = itertools.count(1)
        self.monitor = TransactionMonitor()
        self.lock_waits = LockWaits()
        self.inflight = 0
        #: submitters waiting for an in-flight slot, first come first served; a waiter's future is
        #: set True when a released slot passes to it, False to make it re-check the partition
        self.slot_waiters: deque[asyncio.Future[bool]] = deque()
        self.feed: Inbox[_FeedItem] = Inbox(FEED_QUEUE)  #: received, not yet applied; the stream reader waits when full
        self.consumer: asyncio.Task[None] | None = None
        self.own: dict[int, _Own] = {}
        self.flushes: dict[int, asyncio.Future[None]] = {}
        self.flush_targets: list[tuple[int, int]] = []  # (flush seq, hwm to reach) awaiting the feed
        self.apply_failures = 0

    def next_seq(self) -> int:
        return next(self._seq) & _SEQ_MASK

    def high_water_mark(self) -> float:
        """The ``high_water_mark`` gauge's value."""
        return self.hwm

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

    def wake_slot_waiters(self) -> None:
        """Make every waiter re-check the partition (closed, unmounted), without a slot."""
        waiters, self.slot_waiters = self.slot_waiters, deque()
        for fut in waiters:
            if not fut.done():
                fut.set_result(False)


def _handed(slot: asyncio.Future[bool]) -> bool:
    """True if a released in-flight slot was passed to the waiter of ``slot``."""
    return slot.done() and not slot.cancelled() and slot.result()


class AsyncWaltzClient:
    """A Waltz client on the running asyncio event loop.

    ``AsyncWaltzClient(callbacks, config)`` then ``await client.start()`` (or ``async with``):
    discovers the servers through the coordination backend, gets a cluster-unique client id and
    mounts every partition (``client.auto_mount``) from ``callbacks.client_high_water_mark``.

    Threading: every method and every callback runs on the loop that called :meth:`start`;
    application callbacks may be plain functions (must not block) or ``async def``. Contexts are
    executed on the loop too (``execute`` may be ``async def``).
    """

    def __init__(self, callbacks: WaltzClientCallbacks, config: ClientProcessConfig | None = None, *,
                 discovery: Discovery | None = None, registries: Registries | None = None,
                 _dispatcher: Any = None) -> None:
        self.config = config or ClientProcessConfig()
        self.callbacks = callbacks
        self._registries = registries
        self._discovery = discovery or CoordinationDiscovery(self.config.coordination, registries)
        self._dispatch = _dispatcher or InlineDispatcher()
        cfg = self.config.client
        if cfg.max_concurrent_transactions < 1:
            raise ConfigError("client.max_concurrent_transactions must be at least 1")
        self._cap = cfg.max_concurrent_transactions
        self._partitions: dict[int, _Partition] = {}
        self._links: dict[str, ServerLink] = {}
        self._owners: dict[int, PartitionOwner] = {}
        self._net_seq = itertools.count(1)
        self._rpc_seq = itertools.count(1)
        self._retry_queue: asyncio.Queue[tuple[TransactionContext, int]] | None = None
        self._retrying = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self._changed: asyncio.Event | None = None  # created on the loop in start()
        self._client_id = -1
        self._num_partitions = 0
        self._started = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread_id: int | None = None
        self._transport: Any = None
        self._data_reader = DataReader(self)  #: data fetches: ranges and the sequential read-ahead
        #: this client's own metrics (``waltz_client_*``); an application exposes them with
        #: ``client.metrics.render_prometheus()``. Updated only where the event already costs work
        #: (a lock failure, a retry, an own commit); gauges are read when rendered.
        self.metrics = MetricsRegistry("waltz_client")
        self._m_lock_failures = self.metrics.counter(
            "lock_failures", "Appends of this client rejected by a server's lock table")
        self._m_retries = self.metrics.counter(
            "retries", "Transactions queued for re-execution (append failed or lock-failed)")
        self._m_commit_latency = self.metrics.histogram(
            "commit_latency_seconds", "Seconds from sending an append to seeing it committed in the feed")
        self.metrics.gauge("pending_appends", "Appends in flight, waiting for a lock retry or for re-execution",
                           fn=self._pending_count)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        """Connect to the cluster and mount the partitions (does not wait for the mounts)."""
        if self._started:
            return self
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._changed = asyncio.Event()
        self._retry_queue = asyncio.Queue()
        self._transport = open_transport(self.config.transport, self._registries)
        if is_plaintext(self._transport):
            log.warning("waltz client: links to the servers are not encrypted (development mode)")
        try:
            self._client_id, self._num_partitions = await self._discovery.start(self._on_owners)
        except BaseException:
            await self._transport.aclose()
            raise
        self._owners = self._discovery.owners
        for i in range(max(1, self.config.client.num_retry_workers)):
            self._tasks.append(self._loop.create_task(self._retry_worker(), name=f"waltz-client-retry-{i}"))
        self._tasks.append(self._loop.create_task(self._nudge_loop(), name="waltz-client-nudge"))
        if self.config.client.auto_mount:
            await self._activate(range(self._num_partitions))
        log.info("waltz client %d started (%d partitions)", self._client_id, self._num_partitions)
        return self

    async def close(self) -> None:
        """Stop everything. Contexts whose outcome is unknown (in flight, waiting for a retry) get
        ``on_exception(ClientClosedError)``; they may still have committed."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        unknown: list[TransactionContext] = []
        for p in self._partitions.values():
            unknown.extend(e.context for e in p.monitor.fail_all())
            unknown.extend(e.context for e in p.lock_waits.drain())
            p.ready.set()
            p.wake_slot_waiters()
            if p.mount_retry is not None:
                p.mount_retry.cancel()
        assert self._retry_queue is not None
        while not self._retry_queue.empty():
            unknown.append(self._retry_queue.get_nowait()[0])
        tasks = self._tasks + [p.consumer for p in self._partitions.values() if p.consumer is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in list(self._links.values()):
            await link.close()
        self._links.clear()
        await self._discovery.close()
        await self._transport.aclose()
        for ctx in unknown:
            await self._safe_retry_call(ctx.on_exception, ClientClosedError("the client was closed"))
        self._dispatch.close()
        log.info("waltz client %d closed", self._client_id)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def client_id(self) -> int:
        return self._client_id

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    @property
    def partitions(self) -> frozenset[int]:
        """The partitions this client has mounted (or is mounting)."""
        return frozenset(pid for pid, p in self._partitions.items() if p.state != "inactive")

    # ------------------------------------------------------------------------ partition set

    async def set_partitions(self, partition_ids: Iterable[int]) -> None:
        """Mount exactly these partitions (only with ``client.auto_mount = false``); partitions
        dropped wait for their pending appends to resolve first."""
        if self.config.client.auto_mount:
            raise ClientError("set_partitions() needs client.auto_mount = false")
        wanted = set(partition_ids)
        bad = [pid for pid in wanted if not 0 <= pid < self._num_partitions]
        if bad:
            raise ClientError(f"no such partitions: {sorted(bad)} (the cluster has {self._num_partitions})")
        for pid, p in list(self._partitions.items()):
            if pid not in wanted and p.state != "inactive":
                await self._deactivate(p)
        await self._activate(sorted(wanted))

    async def _activate(self, partition_ids: Iterable[int]) -> None:
        for pid in partition_ids:
            p = self._partitions.get(pid)
            if p is not None and p.state != "inactive":
                continue
            p = _Partition(pid)
            p.hwm = int(await self._dispatch.call(pid, self.callbacks.client_high_water_mark, pid))
            p.received = p.hwm
            self._partitions[pid] = p
            self.metrics.gauge("high_water_mark", "Client high-water mark: the last transaction applied",
                               {"partition": str(pid)}, fn=p.high_water_mark)
            assert self._loop is not None
            p.consumer = self._loop.create_task(self._consume(p), name=f"waltz-client-apply-p{pid}")
            self._bind(p, self._owners.get(pid))

    async def _deactivate(self, p: _Partition) -> None:
        while (len(p.monitor) or p.lock_waits or p.inflight) and not self._closed:
            if p.state == "ready" and not p.flushes:
                self._send_flush(p)
            await self._wait_change(0.05)
        p.state = "inactive"
        p.ready.clear()
        if p.consumer is not None:
            p.consumer.cancel()
            await asyncio.gather(p.consumer, return_exceptions=True)
        p.feed.clear()  # a stream reader waiting for room must not wait for a consumer that is gone
        self._unbind(p)
        self._data_reader.forget(p.id)
        self.metrics.remove({"partition": str(p.id)})

    # ---------------------------------------------------------------------- assignment / mount

    def _on_owners(self, owners: dict[int, PartitionOwner]) -> None:
        """Assignment watch (event loop): follow partitions that moved."""
        self._owners = owners
        if self._closed:
            return
        for pid, p in self._partitions.items():
            if p.state == "inactive":
                continue
            owner = owners.get(pid)
            if owner != p.owner:
                log.info("client %d: partition %d moves to %s", self._client_id, pid, owner)
                self._bind(p, owner)

    def _link_for(self, endpoint: str) -> ServerLink:
        link = self._links.get(endpoint)
        if link is None:
            cfg = self.config
            link = ServerLink(endpoint, self._transport, f"waltz-client-{self._client_id} {core_version()}",
                              connect_timeout=cfg.transport.connect_timeout,
                              reconnect_delay=cfg.client.reconnect_delay,
                              next_net_seq=lambda: next(self._net_seq), on_connected=self._on_link_connected,
                              on_message=self._on_stream, on_lost=self._on_link_lost, on_feed=self._on_feed_fields)
            self._links[endpoint] = link
        return link

    def _bind(self, p: _Partition, owner: PartitionOwner | None) -> None:
        """Attach ``p`` to its owner's stream and mount it there (block appends until READY)."""
        self._unbind(p)
        p.owner = owner
        p.ready.clear()
        p.state = "unmounted"
        if owner is None:
            return  # not assigned right now: wait for the watch
        p.generation = owner.generation
        link = self._link_for(owner.endpoint)
        link.partitions.add(p.id)
        p.link = link
        link.ensure_stream()
        if link.connected:
            self._mount(p)

    def _unbind(self, p: _Partition) -> None:
        if p.mount_retry is not None:
            p.mount_retry.cancel()
            p.mount_retry = None
        link = p.link
        p.link = None
        p.mount_req = None
        if link is not None:
            link.partitions.discard(p.id)

    def _mount(self, p: _Partition) -> None:
        link = p.link
        if link is None or not link.connected or self._closed:
            return
        p.mount_retry = None
        p.ready.clear()
        p.state = "mounting"
        req = ReqId(self._client_id, p.generation, p.id, p.next_seq())
        p.mount_req = req
        link.post(m.MountRequest(req, p.hwm, link.net_seq))

    def _remount_later(self, p: _Partition, delay: float) -> None:
        if p.mount_retry is not None:
            p.mount_retry.cancel()
        assert self._loop is not None
        p.mount_retry = self._loop.call_later(delay, self._mount, p)

    def _on_link_connected(self, link: ServerLink) -> None:
        for pid in sorted(link.partitions):
            p = self._partitions.get(pid)
            if p is not None and p.link is link:
                self._mount(p)

    def _on_link_lost(self, link: ServerLink) -> None:
        """Block the appends of the link's partitions; the link reconnects and re-mounts them."""
        for pid in link.partitions:
            p = self._partitions.get(pid)
            if p is not None and p.link is link and p.state != "ahead":
                p.state = "unmounted"
                p.ready.clear()
                p.mount_req = None

    # ------------------------------------------------------------------------ stream messages

    async def _on_stream(self, link: ServerLink, msg: Any) -> None:
        t = type(msg)
        p = self._partitions.get(msg.req_id.partition_id)
        if p is None or p.state == "inactive":
            return
        if t is m.MountResponse:
            self._on_mount_response(p, msg)
        elif t is m.LockFailure:
            self._on_lock_failure(p, msg)
        elif t is m.FlushResponse:
            self._on_flush_response(p, msg)
        elif t is m.FeedSuspended:
            if p.link is link and msg.req_id.generation in (0, p.generation):
                log.info("client %d: feed of partition %d suspended by %s", self._client_id, p.id, link.endpoint)
                p.state = "unmounted"
                p.ready.clear()
                p.mount_req = None
                self._remount_later(p, NOT_READY_RETRY)
        else:
            log.warning("client %d: unexpected %s on the stream from %s", self._client_id, t.__name__, link.endpoint)

    def _on_feed_fields(self, link: ServerLink, fields: tuple[int, int, int, int, int, int]
                        ) -> asyncio.Future[None] | None:
        """One feed record (the stream reader's fast path, no message object); returns a future
        to await when the partition's feed queue is full."""
        client_id, generation, pid, seq, tid, header = fields
        p = self._partitions.get(pid)
        if p is None or p.state == "inactive":
            return None
        own = None
        if client_id == self._client_id:
            entry, failed = p.monitor.on_feed(seq)
            if entry is not None:
                own = p.own[tid] = _Own(entry.context)
                p.release_slot()
                self._m_commit_latency.observe(time.monotonic() - entry.registered)
            if failed:
                self._fail(p, failed)
            if own is None:
                own = p.own.get(tid)
        if tid > p.received:
            p.received = tid
            if p.flush_targets:
                self._check_flushes(p)
        return p.feed.put((tid, header, ReqId(client_id, generation, pid, seq), own))

    def _on_mount_response(self, p: _Partition, msg: m.MountResponse) -> None:
        if msg.req_id != p.mount_req:
            return  # an answer to a superseded mount
        state = msg.state
        if state is m.PartitionState.READY:
            seq = msg.req_id.seq_num
            self._fail(p, p.monitor.fail_before(seq))
            self._complete_flushes(p, seq)
            p.state = "ready"
            p.ready.set()
            self._ping()
        elif state is m.PartitionState.NOT_READY:
            p.state = "unmounted"
            self._remount_later(p, NOT_READY_RETRY)
        else:
            log.error("client %d: partition %d: the client high-water mark %d is ahead of the server's",
                      self._client_id, p.id, p.hwm)
            p.state = "ahead"
            p.ready.set()  # wake submitters: they raise ClientAheadError

    def _on_lock_failure(self, p: _Partition, msg: m.LockFailure) -> None:
        entry = p.monitor.on_lock_failure(msg.req_id.seq_num)
        if entry is None:
            return
        p.release_slot()
        self._m_lock_failures.inc()
        self._spawn(self._safe_retry_call(entry.context.on_lock_failure))
        if msg.transaction_id <= p.hwm:
            self._retry(entry)
        else:
            p.lock_waits.add(msg.transaction_id, entry)
        self._ping()

    # ----------------------------------------------------------------------------- flushes

    def _send_flush(self, p: _Partition) -> asyncio.Future[None]:
        assert self._loop is not None
        seq = p.next_seq()
        fut: asyncio.Future[None] = self._loop.create_future()
        p.flushes[seq] = fut
        if p.link is None or not p.link.post(m.FlushRequest(ReqId(self._client_id, p.generation, p.id, seq))):
            pass  # disconnected: the next READY resolves it
        return fut

    def _on_flush_response(self, p: _Partition, msg: m.FlushResponse) -> None:
        seq = msg.req_id.seq_num
        if seq in p.flushes:
            p.flush_targets.append((seq, msg.transaction_id))
            self._check_flushes(p)

    def _check_flushes(self, p: _Partition) -> None:
        keep = []
        for seq, target in p.flush_targets:
            if p.received >= target:
                self._fail(p, p.monitor.fail_before(seq))
                fut = p.flushes.pop(seq, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            else:
                keep.append((seq, target))
        p.flush_targets = keep
        self._ping()

    def _complete_flushes(self, p: _Partition, before: int) -> None:
        for seq in [s for s in p.flushes if s < before]:
            fut = p.flushes.pop(seq)
            if not fut.done():
                fut.set_result(None)
        p.flush_targets = [(s, t) for s, t in p.flush_targets if s >= before]

    async def _nudge_loop(self) -> None:
        """Flush partitions whose oldest pending append waited longer than ``long_wait_threshold``."""
        threshold = self.config.client.long_wait_threshold
        period = min(max(threshold / 4, 0.01), 1.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for p in self._partitions.values():
                oldest = p.monitor.oldest()
                if oldest is not None and now - oldest > threshold and not p.flushes and p.state == "ready":
                    self._send_flush(p)

    # ---------------------------------------------------------------------- appends & retries

    def _fail(self, p: _Partition, failed: list[PendingAppend]) -> None:
        for entry in failed:
            p.release_slot()
            self._retry(entry)

    def _retry(self, entry: PendingAppend) -> None:
        assert self._retry_queue is not None
        if not self._closed:
            self._retry_queue.put_nowait((entry.context, entry.attempts))
            self._m_retries.inc()
            self._ping()

    async def _acquire(self, pid: int, timeout: float | None) -> _Partition:
        """Wait until the partition is mounted and has an in-flight slot; take the slot."""
        if self._closed:
            raise ClientClosedError("the client is closed")
        p = self._partitions.get(pid)
        if p is None or p.state == "inactive":
            raise ClientError(f"partition {pid} is not mounted by this client")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise ClientClosedError("the client is closed")
            if p.state == "ahead":
                raise ClientAheadError(f"partition {pid}: the client high-water mark {p.hwm} is ahead of the log")
            if p.state == "inactive":
                raise ClientError(f"partition {pid} is not mounted by this client")
            if not p.ready.is_set():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ClientTimeoutError(f"partition {pid} not mounted within {timeout}s")
                try:
                    await asyncio.wait_for(p.ready.wait(), remaining)
                except TimeoutError:
                    raise ClientTimeoutError(f"partition {pid} not mounted within {timeout}s") from None
                continue
            if p.inflight < self._cap:
                p.inflight += 1
                return p
            slot: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            p.slot_waiters.append(slot)
            try:
                await asyncio.wait_for(slot, SLOT_WAIT)
            except TimeoutError:
                if not p.flushes:  # original: after 10 s the client flushes and tries again
                    self._send_flush(p)
            except asyncio.CancelledError:
                if _handed(slot):
                    p.release_slot()  # handed a slot as we were cancelled: pass it on
                raise
            # Checked after a timeout too: a slot handed over as the timeout fired is ours.
            if _handed(slot):
                if not self._closed and p.ready.is_set() and p.state not in ("ahead", "inactive"):
                    return p  # inflight already counts the slot passed to us
                p.release_slot()  # the partition changed while we waited: re-check from the top

    def _send(self, p: _Partition, ctx: TransactionContext, builder: TransactionBuilder, attempts: int) -> None:
        """Send the append (the slot is taken); its fate comes from the stream."""
        if self._closed:
            p.release_slot()
            self._spawn(self._safe_retry_call(ctx.on_exception, ClientClosedError("the client is closed")))
            return
        seq = p.next_seq()
        p.monitor.register(seq, ctx, attempts, time.monotonic())
        if p.link is not None:
            p.link.post_frame(m.encode_append(self._client_id, p.generation, p.id, seq, builder.client_high_water_mark,
                                              builder.write_locks, builder.read_locks, builder.append_locks,
                                              builder.header, builder.data, builder.checksum))

    def _partition_of(self, ctx: TransactionContext) -> int:
        pid = ctx.partition_id(self._num_partitions)
        if not isinstance(pid, int) or not 0 <= pid < self._num_partitions:
            raise ClientError(f"{type(ctx).__name__}.partition_id() returned {pid!r}, "
                              f"not a partition in 0..{self._num_partitions - 1}")
        return pid

    async def submit(self, context: TransactionContext) -> None:
        """Execute ``context`` and send its append; returns once it is sent.

        Awaits while the partition is not mounted (``client.mount_timeout``, then
        ClientTimeoutError) and while ``client.max_concurrent_transactions`` appends of the
        partition are in flight (back pressure). If ``execute`` raises, ``on_exception`` is called
        and the exception re-raised. The outcome arrives through the context's callbacks.
        """
        self._check_open()
        if context._expired(0):
            await self._dispatch.call_retry(context.on_expiration)
            return
        pid = self._partition_of(context)
        p = self._partitions.get(pid)
        if p is not None and p.state == "ready" and p.inflight < self._cap and p.ready.is_set():
            p.inflight += 1  # _acquire's answer when the partition is mounted and has a free slot
        else:
            p = await self._acquire(pid, self.config.client.mount_timeout)
        builder = TransactionBuilder(pid, p.hwm)
        try:
            if self._dispatch.threaded:
                ok = await self._dispatch.call_retry(context.execute, builder)
            else:
                ok = context.execute(builder)
                if _awaitable(ok):
                    ok = await ok
        except BaseException as exc:
            p.release_slot()
            if isinstance(exc, Exception):
                await self._safe_retry_call(context.on_exception, exc)
            raise
        if not ok:
            p.release_slot()
            await self._safe_retry_call(context.on_completion, False)
            return
        self._send(p, context, builder, 1)

    async def _retry_worker(self) -> None:
        assert self._retry_queue is not None
        queue = self._retry_queue
        while True:
            ctx, attempts = await queue.get()
            self._retrying += 1
            try:
                await self._reexecute(ctx, attempts)
            except ClientClosedError:
                await self._safe_retry_call(ctx.on_exception, ClientClosedError("the client was closed"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - partition_id() raised, client ahead, ...: to on_exception
                await self._safe_retry_call(ctx.on_exception, exc)
            finally:
                self._retrying -= 1
                self._ping()

    async def _reexecute(self, ctx: TransactionContext, attempts: int) -> None:
        if ctx._expired(attempts):
            await self._safe_retry_call(ctx.on_expiration)
            return
        pid = self._partition_of(ctx)
        p = await self._acquire(pid, None)
        if ctx._expired(attempts):
            p.release_slot()
            await self._safe_retry_call(ctx.on_expiration)
            return
        builder = TransactionBuilder(pid, p.hwm)
        try:
            ok = await self._dispatch.call_retry(ctx.execute, builder)
        except Exception as exc:  # noqa: BLE001 - the application's execute(): to on_exception
            p.release_slot()
            await self._safe_retry_call(ctx.on_exception, exc)
            return
        if not ok:
            p.release_slot()
            await self._safe_retry_call(ctx.on_completion, False)
            return
        self._send(p, ctx, builder, attempts + 1)

    # ---------------------------------------------------------------------------- applying

    async def _consume(self, p: _Partition) -> None:
        """The partition's apply task: strictly in order, ids other than hwm + 1 ignored."""
        feed = p.feed
        while True:
            if not feed:
                await feed.wait()
            batch = feed.take(APPLY_BATCH)
            if self._dispatch.threaded:
                failure = await self._dispatch.call(p.id, self._apply_batch_sync, p, batch)
            else:
                failure = await self._apply_batch_async(p, batch)
            if p.lock_waits:
                for entry in p.lock_waits.release(p.hwm):
                    self._retry(entry)
            self._ping()
            if failure is not None:
                await self._after_apply_failure(p)
            else:
                p.apply_failures = 0

    async def _apply_batch_async(self, p: _Partition, batch: list[_FeedItem]) -> BaseException | None:
        # Callbacks are called inline (this path runs only with the inline dispatcher), not through
        # _safe_retry_call: two coroutine layers per callback were a visible cost per transaction.
        apply = self.callbacks.apply_transaction
        for tid, header, req_id, own in batch:
            if tid != p.hwm + 1:
                continue
            if own is None:
                own = p.own.get(tid)
            if own is not None and not own.completed:
                own.completed = True
                pending = _call_logged(own.context.on_completion, True)
                if pending is not None:
                    await _await_logged(pending, own.context.on_completion)
            txn = Transaction(p.id, tid, header, req_id, self)
            try:
                result = apply(txn)
                if _awaitable(result):
                    await result
            except Exception as exc:  # noqa: BLE001 - the application's: to uncaught_exception
                log.warning("client %d: apply_transaction(partition %d, transaction %d) failed: %r",
                            self._client_id, p.id, tid, exc)
                await self._safe_retry_call(self.callbacks.uncaught_exception, p.id, tid, exc)
                return exc
            p.hwm = tid
            if own is not None:
                p.own.pop(tid, None)
                pending = _call_logged(own.context.on_application)
                if pending is not None:
                    await _await_logged(pending, own.context.on_application)
        return None

    def _apply_batch_sync(self, p: _Partition, batch: list[_FeedItem]) -> BaseException | None:
        """The same on a consumer thread of the sync client."""
        apply = self.callbacks.apply_transaction
        for tid, header, req_id, own in batch:
            if tid != p.hwm + 1:
                continue
            if own is None:
                own = p.own.get(tid)
            if own is not None and not own.completed:
                own.completed = True
                _call_logged(own.context.on_completion, True)
            txn = Transaction(p.id, tid, header, req_id, self)
            try:
                apply(txn)
            except Exception as exc:  # noqa: BLE001 - the application's: to uncaught_exception
                log.warning("client %d: apply_transaction(partition %d, transaction %d) failed: %r",
                            self._client_id, p.id, tid, exc)
                _call_logged(self.callbacks.uncaught_exception, p.id, tid, exc)
                return exc
            p.hwm = tid
            if own is not None:
                p.own.pop(tid, None)
                _call_logged(own.context.on_application)
        return None

    async def _after_apply_failure(self, p: _Partition) -> None:
        """Drop what is queued and re-mount from the client high-water mark (redelivery)."""
        p.feed.clear()
        # p.received stays: flush() waits until the redelivered transactions are applied
        p.apply_failures += 1
        delay = min(0.05 * 2 ** (p.apply_failures - 1), 5.0)
        p.state = "unmounted"
        p.ready.clear()
        p.mount_req = None
        await asyncio.sleep(delay)
        if p.state == "unmounted" and p.link is not None:
            self._mount(p)

    # ----------------------------------------------------------------------------- queries

    def _pending_count(self) -> int:
        """For the pending-appends gauge, from any thread (the partition list is copied first)."""
        queued = self._retry_queue.qsize() if self._retry_queue is not None else 0
        return sum(len(p.monitor) + len(p.lock_waits) for p in list(self._partitions.values())) + queued + self._retrying

    def has_pending(self) -> bool:
        """True while appends are in flight, waiting for a lock retry or queued for re-execution."""
        if self._retrying or (self._retry_queue is not None and not self._retry_queue.empty()):
            return True
        return any(p.inflight or p.lock_waits for p in self._partitions.values())

    async def flush(self) -> None:
        """Wait until nothing is pending (every append sent before resolved, retries done) and
        every transaction received has been applied. Must not be awaited from a callback."""
        self._check_open()
        while True:
            self._check_open()
            busy = False
            for p in self._partitions.values():
                if p.state == "inactive":
                    continue
                if len(p.monitor):
                    busy = True
                    if p.state == "ready" and not p.flushes:
                        self._send_flush(p)
                if p.inflight or p.lock_waits or p.hwm < p.received:
                    busy = True
            if not busy and not self._retrying and (self._retry_queue is None or self._retry_queue.empty()):
                return
            await self._wait_change(0.05)

    async def wait_mounted(self, timeout: float | None = None) -> None:
        """Wait until every partition of this client is mounted (READY)."""
        async def all_ready() -> None:
            for p in list(self._partitions.values()):
                if p.state != "inactive":
                    await p.ready.wait()
        try:
            await asyncio.wait_for(all_ready(), timeout)
        except TimeoutError:
            waiting = sorted(pid for pid, p in self._partitions.items() if p.state != "inactive" and not p.ready.is_set())
            raise ClientTimeoutError(f"not mounted within {timeout}s: partitions {waiting}") from None

    async def high_water_mark(self, partition_id: int) -> int:
        """The server's committed high-water mark of a partition (RPC)."""
        deadline = time.monotonic() + self.config.client.rpc_timeout
        backoff = 0.01
        while True:
            try:
                resp = await self._rpc(partition_id, lambda q: m.HighWaterMarkRequest(q))
                if resp.transaction_id >= -1:
                    return int(resp.transaction_id)
                error: Exception = ClientError(f"partition {partition_id} is not on the server")
            except (TransportError, TimeoutError, ClientTimeoutError) as exc:
                error = exc
            self._check_open()
            if time.monotonic() > deadline:
                raise ClientTimeoutError(f"high-water mark of partition {partition_id}: {error}") from None
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _rpc(self, partition_id: int, make: Callable[[ReqId], Any]) -> Any:
        self._check_open()
        if not 0 <= partition_id < self._num_partitions:
            raise ClientError(f"no partition {partition_id}")
        owner = self._owners.get(partition_id)
        if owner is None:
            raise ClientTimeoutError(f"partition {partition_id} has no server right now")
        link = self._link_for(owner.endpoint)
        req = ReqId(self._client_id, owner.generation, partition_id, next(self._rpc_seq) & _SEQ_MASK)
        return await link.rpc(make(req), self.config.client.rpc_timeout)

    async def fetch_data_range(self, partition_id: int, first: int, count: int) -> list[bytes]:
        """The data of transactions ``first .. first + count - 1`` of a partition, in order, in as
        few RPCs as the server allows (it caps each answer at 1024 transactions and a few MB).

        Every transaction's CRC-32 is checked (``client.data_fetch_attempts`` attempts on a
        mismatch); RPC failures, and transactions not committed yet, are retried with backoff
        (10 ms doubling to 5 s) until ``client.data_fetch_timeout`` per RPC, then
        ClientTimeoutError. A server speaking only protocol version 1 is asked one transaction
        per RPC. ``Transaction.fetch_data`` uses ranges by itself for sequential readers.
        """
        return await self._data_reader.fetch_range(partition_id, first, count)

    async def _fetch_data(self, partition_id: int, transaction_id: int) -> bytes:
        """One transaction's data by RPC: CRC checked (``data_fetch_attempts`` attempts on a mismatch),
        RPC failures retried with backoff 10 ms -> 5 s until ``data_fetch_timeout`` (the range
        fetch's retry loop, asking for one transaction)."""
        return (await self._data_reader.fetch_range_once(partition_id, transaction_id, 1, 1))[0]

    # ----------------------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("the client is closed")
        if not self._started:
            raise ClientError("the client is not started (await client.start() or use 'async with')")

    def _ping(self) -> None:
        ev = self._changed
        if ev is not None:
            ev.set()

    async def _wait_change(self, timeout: float) -> None:
        ev = self._changed
        assert ev is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), timeout)
        ev.clear()

    def _spawn(self, coro: Any) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    async def _safe_retry_call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call an application callback; its exceptions are logged, never propagated."""
        try:
            await self._dispatch.call_retry(fn, *args)
        except Exception:
            log.exception("client %d: %s raised", self._client_id, getattr(fn, "__qualname__", fn))


def _call_logged(fn: Callable[..., Any], *args: Any) -> Awaitable[Any] | None:
    """Call an application callback; its exception is logged, never raised. Returns the awaitable
    an ``async def`` callback gave (for :func:`_await_logged` on the loop), else None."""
    try:
        result = fn(*args)
    except Exception:
        log.exception("%s raised", getattr(fn, "__qualname__", fn))
        return None
    return result if _awaitable(result) else None


async def _await_logged(pending: Awaitable[Any], fn: Callable[..., Any]) -> None:
    try:
        await pending
    except Exception:
        log.exception("%s raised", getattr(fn, "__qualname__", fn))

