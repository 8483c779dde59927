"""``AsyncWaltzClient``: the client library on one asyncio event loop (seed 001 "Waltz Client").

The class is a facade: it starts and stops the client and wires its parts, each in a module of
its own (the ``Client`` section of docs/design.md draws who calls whom):

* :mod:`waltz_core.protocol.session` - the rules of a partition session, a pure state machine:
  mounts, the feed, flushes, the fate of every append;
* :mod:`.partition` - a partition's runtime state around its session (link, ``ready``, in-flight
  slots, lock waits, feed queue);
* :mod:`.stream` - partitions bound to their servers' streams, mounts, stream messages into the
  sessions (the feed's fast path);
* :mod:`.sender` - the one submit path (slot, build, send) and re-executions of failed and
  lock-failed appends;
* :mod:`.applier` - the apply loop, in order per partition, for the async and the sync client alike;
* :mod:`.rpc` and :mod:`.readahead` - high-water marks and transaction data by RPC;
* :mod:`.context` - what the parts share; :mod:`.dispatch` - where application code runs.

Per partition the client keeps the client high-water mark (last transaction applied by the
application), the owner (server endpoint, generation), its pending appends, lock waits, the
in-flight count (back pressure) and a feed queue the applier drains in order, so
``apply_transaction`` runs strictly in transaction-id order per partition.

Fate of an append: decided from the stream only (see :mod:`waltz_core.protocol.session`). A
failed append's context goes to the retry queue and is re-executed by a retry worker; a
lock-failed one waits until the client applied the conflicting transaction.

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
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, Self

from ..config import ClientProcessConfig
from ..coordination.recipes import PartitionOwner
from ..errors import ClientClosedError, ClientError, ClientTimeoutError, ConfigError
from ..metrics import MetricsRegistry
from ..plugins import core_version
from ..protocol.session import SessionState
from ..runtime import Runtime
from ..timeouts import wait_for
from ..transport import is_plaintext, open_transport
from .api import TransactionContext, WaltzClientCallbacks
from .applier import Applier
from .context import ClientContext
from .discovery import CoordinationDiscovery, Discovery
from .dispatch import Dispatcher, InlineDispatcher
from .link import Links
from .partition import Partition
from .readahead import DataReader
from .rpc import Rpc
from .sender import Sender
from .stream import Streams

log = logging.getLogger("waltz.client")

_INACTIVE = SessionState.INACTIVE


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
                 discovery: Discovery | None = None, runtime: Runtime | None = None,
                 _dispatcher: Dispatcher | None = None) -> None:
        self.config = config or ClientProcessConfig()
        self.callbacks = callbacks
        self._runtime = runtime or Runtime.load()  # an application with many clients passes one runtime
        self._discovery = discovery or CoordinationDiscovery(self.config.coordination, self._runtime.registries)
        if self.config.client.max_concurrent_transactions < 1:
            raise ConfigError("client.max_concurrent_transactions must be at least 1")
        ctx = self._ctx = ClientContext(self.config, callbacks, _dispatcher or InlineDispatcher())
        self._partitions = ctx.partitions
        self._transport: Any = None
        self._mount_timeout = self.config.client.mount_timeout
        #: this client's own metrics (``waltz_client_*``); an application exposes them with
        #: ``client.metrics.render_prometheus()``. Updated only where the event already costs work
        #: (a lock failure, a retry, an own commit); gauges are read when rendered.
        self.metrics = MetricsRegistry("waltz_client")
        lock_failures = self.metrics.counter(
            "lock_failures", "Appends of this client rejected by a server's lock table")
        lock_waits = self.metrics.counter(
            "lock_waits", "Transactions held back, not sent, because an own append not yet applied advances one of "
                          "their locks (executed again once it is applied or failed)")
        retries = self.metrics.counter(
            "retries", "Transactions queued for re-execution (append failed or lock-failed)")
        commit_latency = self.metrics.histogram(
            "commit_latency_seconds", "Seconds from sending an append to seeing it committed in the feed")
        self._sender = Sender(ctx, lock_failures=lock_failures, lock_waits=lock_waits, retries=retries)
        self._streams = Streams(ctx, self._sender, commit_latency)
        self._rpc = Rpc(ctx)
        self._data_reader = DataReader(ctx, self._rpc)  #: data fetches: ranges and the sequential read-ahead
        self._applier = Applier(ctx, self._sender, self._streams.mount, self._data_reader)
        self.metrics.gauge("pending_appends", "Appends in flight, waiting for a lock retry or for re-execution",
                           fn=self._sender.pending_count)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        """Connect to the cluster and mount the partitions (does not wait for the mounts)."""
        ctx = self._ctx
        if ctx.started:
            return self
        ctx.start()
        self._transport = open_transport(self.config.transport, self._runtime.registries)
        if is_plaintext(self._transport):
            log.warning("waltz client: links to the servers are not encrypted (development mode)")
        try:
            ctx.client_id, ctx.num_partitions = await self._discovery.start(self._on_owners)
        except BaseException:
            await self._transport.aclose()
            raise
        ctx.owners = self._discovery.owners
        cfg = self.config
        streams = self._streams
        ctx.links = Links(self._transport, f"waltz-client-{ctx.client_id} {core_version()}",
                          connect_timeout=cfg.transport.connect_timeout, reconnect_delay=cfg.client.reconnect_delay,
                          on_connected=streams.on_connected, on_message=streams.on_message,
                          on_feed=streams.on_feed, on_lock_failure=streams.on_lock_failure,
                          on_lost=streams.on_lost)
        self._sender.start()
        if cfg.client.auto_mount:
            await self._activate(range(ctx.num_partitions))
        log.info("waltz client %d started (%d partitions)", ctx.client_id, ctx.num_partitions)
        return self

    async def close(self) -> None:
        """Stop everything. Contexts whose outcome is unknown (in flight, waiting for a retry) get
        ``on_exception(ClientClosedError)``; they may still have committed."""
        ctx = self._ctx
        if ctx.closed or not ctx.started:
            ctx.closed = True
            return
        ctx.closed = True
        unknown = self._sender.abandon()
        for p in self._partitions.values():
            p.wake()
            if p.mount_retry is not None:
                p.mount_retry.cancel()
        tasks = ctx.tasks + [p.consumer for p in self._partitions.values() if p.consumer is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if ctx.links is not None:
            await ctx.links.close()
        await self._discovery.close()
        await self._transport.aclose()
        for context in unknown:
            await ctx.notify(context.on_exception, ClientClosedError("the client was closed"))
        ctx.dispatcher.close()
        log.info("waltz client %d closed", ctx.client_id)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def client_id(self) -> int:
        return self._ctx.client_id

    @property
    def num_partitions(self) -> int:
        return self._ctx.num_partitions

    @property
    def partitions(self) -> frozenset[int]:
        """The partitions this client has mounted (or is mounting)."""
        return frozenset(pid for pid, p in self._partitions.items() if p.state is not _INACTIVE)

    # ------------------------------------------------------------------------ partition set

    async def set_partitions(self, partition_ids: Iterable[int]) -> None:
        """Mount exactly these partitions (only with ``client.auto_mount = false``); partitions
        dropped wait for their pending appends to resolve first."""
        if self.config.client.auto_mount:
            raise ClientError("set_partitions() needs client.auto_mount = false")
        wanted = set(partition_ids)
        num_partitions = self._ctx.num_partitions
        bad = [pid for pid in wanted if not 0 <= pid < num_partitions]
        if bad:
            raise ClientError(f"no such partitions: {sorted(bad)} (the cluster has {num_partitions})")
        for pid, p in list(self._partitions.items()):
            if pid not in wanted and p.state is not _INACTIVE:
                await self._deactivate(p)
        await self._activate(sorted(wanted))

    async def _activate(self, partition_ids: Iterable[int]) -> None:
        ctx = self._ctx
        for pid in partition_ids:
            p = self._partitions.get(pid)
            if p is not None and p.state is not _INACTIVE:
                continue
            hwm = int(await ctx.dispatcher.call(pid, self.callbacks.client_high_water_mark, pid))
            p = Partition(pid, ctx.client_id, hwm)
            self._partitions[pid] = p
            self.metrics.gauge("high_water_mark", "Client high-water mark: the last transaction applied",
                               {"partition": str(pid)}, fn=p.high_water_mark)
            self._applier.start(p)
            self._streams.bind(p, ctx.owners.get(pid))

    async def _deactivate(self, p: Partition) -> None:
        ctx = self._ctx
        while (len(p.session) or p.lock_waits or p.held or p.inflight) and not ctx.closed:
            if p.session.wants_flush():
                self._sender.send_flush(p)
            await ctx.wait_change(0.05)
        p.deactivate()
        if p.consumer is not None:
            p.consumer.cancel()
            await asyncio.gather(p.consumer, return_exceptions=True)
        p.feed.clear()  # a stream reader waiting for room must not wait for a consumer that is gone
        self._streams.unbind(p)
        self._data_reader.forget(p.id)
        self.metrics.remove({"partition": str(p.id)})

    def _on_owners(self, owners: dict[int, PartitionOwner]) -> None:
        """Assignment watch (event loop): follow partitions that moved."""
        ctx = self._ctx
        ctx.owners = owners
        if not ctx.closed:
            self._streams.follow(owners)

    # ----------------------------------------------------------------------------- appends

    def submit(self, context: TransactionContext) -> Coroutine[Any, Any, None]:
        """Execute ``context`` and send its append; returns once it is sent (a coroutine: ``await
        client.submit(context)``).

        Awaits while the partition is not mounted (``client.mount_timeout``, then
        ClientTimeoutError) and while ``client.max_concurrent_transactions`` appends of the
        partition are in flight (back pressure). If ``execute`` raises, ``on_exception`` is called
        and the exception re-raised. The outcome arrives through the context's callbacks.
        """
        # The sender's coroutine itself, not one awaiting it: a coroutine less per transaction.
        return self._sender.submit(context, 0, self._mount_timeout)

    def has_pending(self) -> bool:
        """True while appends are in flight, waiting for a lock retry or queued for re-execution."""
        return self._sender.has_pending()

    async def flush(self) -> None:
        """Wait until nothing is pending (every append sent before resolved, retries done) and
        every transaction received has been applied. Must not be awaited from a callback."""
        ctx = self._ctx
        ctx.check_open()
        sender = self._sender
        while True:
            ctx.check_open()
            busy = False
            for p in self._partitions.values():
                session = p.session
                if session.state is _INACTIVE:
                    continue
                if len(session):
                    busy = True
                    if session.wants_flush():
                        sender.send_flush(p)
                if p.inflight or p.lock_waits or p.held or session.hwm < session.received:
                    busy = True
            if not busy and sender.idle():
                return
            await ctx.wait_change(0.05)

    async def wait_mounted(self, timeout: float | None = None) -> None:
        """Wait until every partition of this client is mounted (READY)."""
        async def all_ready() -> None:
            for p in list(self._partitions.values()):
                if p.state is not _INACTIVE:
                    await p.ready.wait()
        try:
            await wait_for(all_ready(), timeout)
        except TimeoutError:
            waiting = sorted(pid for pid, p in self._partitions.items()
                             if p.state is not _INACTIVE and not p.ready.is_set())
            raise ClientTimeoutError(f"not mounted within {timeout}s: partitions {waiting}") from None

    # --------------------------------------------------------------------------------- rpc

    async def high_water_mark(self, partition_id: int) -> int:
        """The server's committed high-water mark of a partition (RPC)."""
        return await self._rpc.high_water_mark(partition_id)

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
