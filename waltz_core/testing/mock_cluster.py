"""An in-memory Waltz cluster for application unit tests (the original's ``MockDriver``).

:class:`MockCluster` is one server speaking the real client protocol over the built-in
``memory`` transport, and it *is* the server's code: each partition is the server's own
:class:`~waltz_core.server.partition.Partition` (append task, lock table, feeds, caches, data RPCs),
over a :class:`~waltz_core.testing.memory_store.MemoryStore` instead of replicated storage, and
client connections are read by the server's own dispatch
(:func:`~waltz_core.server.dispatch.read_client_messages`). The lock table is the ``exact`` one
by default (the server's rules, without the ``hashed`` table's rare false conflicts); pass
``lock_table`` (a factory taking the high-water mark) to test against another. What an
application tests against is what it runs against. The clients are the real
:class:`~waltz_core.client.WaltzClient` / :class:`~waltz_core.client.AsyncWaltzClient` with
all their code paths (mount, feed, monitor, retries, reconnects, data RPCs). No storage nodes,
no coordination, no sockets.

Several clients share one cluster (distinct client ids), as with ``MockServerPartition``::

    with MockCluster(num_partitions=4) as cluster:
        with cluster.client(MyCallbacks()) as client:     # a WaltzClient
            client.submit(MyContext(...))
            client.flush()

    async with MockCluster(4) as cluster:                 # on the running loop
        async with cluster.async_client(MyCallbacks()) as client: ...

Fault injection (safe from any thread) sits around the server's code, never in a copy of it:

* :meth:`set_fault_rate`, :meth:`force_next_append_fail` - the inbound link loses the append
  before it reaches the partition, as a network does; the client's monitor finds out.
* :meth:`force_next_lock_fail` - the inbound link answers the next append with a ``LockFailure``
  naming the partition's high-water mark instead of passing it on. (The partition consults its
  lock table only for appends that carry locks; this fault hits any append, as the original's.)
* :meth:`set_max_delay` - the store commits each append after a random delay, in transaction-id
  order. Appends stay in flight meanwhile, so colliding ones serialize in the partition as on a
  server.
* :meth:`suspend_feed` / :meth:`resume_feed` - the outbound link holds back feed records and
  mount answers (appends still commit; clients cannot see them), then sends them in order.
* :meth:`corrupt_next_data` - the outbound link flips the checksum of the next data answers.
* :meth:`disconnect_clients` - every client connection is closed (clients reconnect, re-mount).
* :meth:`move_partition` - the partition object is replaced by one of the next generation over
  the same log, as a reassignment does: a new lock table at the high-water mark, ``FeedSuspended``
  to the old generation's clients, the new owner announced to every client.

Inspection: :meth:`transactions` (the committed log, with each append's locks and client
high-water mark, seen on the inbound link), :meth:`high_water_mark`, the counters
``dropped_appends`` and ``lock_failures``, the data RPCs served (``data_requests``,
``data_range_requests``), and ``partitions`` (the live ``Partition`` objects).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Self

import attrs

from ..config import ClientConfig, ClientProcessConfig, ServerConfig, TransportConfig
from ..coordination.recipes import PartitionOwner
from ..errors import ConnectionClosedError, ProtocolError, TransportError, WaltzError
from ..locks.base import LockTable
from ..locks.exact import ExactLockTable
from ..protocol import CLIENT
from ..protocol import client as m
from ..protocol.wire import Record, ReqId
from ..server.caches import CacheBudget
from ..server.dispatch import read_client_messages
from ..server.link import ClientLink
from ..server.partition import Partition
from ..transport import MessageChannel
from ..transport.base import Connection, Listener
from ..transport.memory import MemoryTransport
from .memory_store import MemoryLog, MemoryStore

if TYPE_CHECKING:
    from ..client.api import WaltzClientCallbacks
    from ..client.core import AsyncWaltzClient
    from ..client.discovery import StaticDiscovery
    from ..client.sync import WaltzClient

log = logging.getLogger("waltz.testing.mock_cluster")

_CORRUPTION = 0x5A5A5A5A  # xor-ed into a checksum by corrupt_next_data


@attrs.frozen(slots=True)
class LoggedTransaction:
    """One committed transaction of the mock log."""

    transaction_id: int
    req_id: ReqId
    header: int
    data: bytes
    checksum: int
    client_high_water_mark: int
    write_locks: tuple[int, ...]
    read_locks: tuple[int, ...]
    append_locks: tuple[int, ...]


@attrs.frozen(slots=True)
class _AppendLocks:
    """What the store does not keep of an append, kept for :meth:`MockCluster.transactions`."""

    client_high_water_mark: int
    write_locks: tuple[int, ...]
    read_locks: tuple[int, ...]
    append_locks: tuple[int, ...]


@attrs.frozen(slots=True)
class _InboundLink:
    """Stands in front of one partition for the connection reader: inbound faults and records."""

    #: ``route(partition_id, msg, link)``: the cluster's inbound faults, then the partition
    route: Callable[[int, Any, ClientLink], asyncio.Future[None] | None]
    partition_id: int

    def offer(self, msg: Any, link: ClientLink) -> asyncio.Future[None] | None:
        return self.route(self.partition_id, msg, link)


@attrs.define(slots=True)
class _OutboundFaults:
    """The outbound faults of a :class:`MockCluster`, shared by its :class:`_FaultyLink` objects.

    Set by the cluster's fault methods; read by the links as they post (which count ``corrupt_data`` down).
    """

    feed_suspended: bool = False  #: hold back feed records and mount answers
    corrupt_data: int = 0  #: transaction data answers still to damage


class _FaultyLink(ClientLink):
    """The server's :class:`ClientLink` with the outbound faults: held feeds, corrupted data."""

    __slots__ = ("_faults", "_held")

    def __init__(self, faults: _OutboundFaults, channel: MessageChannel, config: ServerConfig,
                 max_frame_size: int) -> None:
        super().__init__(channel, inbound_high_water=config.inbound_high_water,
                         inbound_low_water=config.inbound_low_water,
                         limits=(max_frame_size, config.max_locks_per_transaction))
        self._faults = faults
        self._held: list[bytes] = []  # feed frames and mount answers held back while the feed is suspended

    def post(self, msg: Any) -> None:
        faults = self._faults
        t = type(msg)
        if faults.feed_suspended and (t is m.FeedData or t is m.MountResponse):
            # A mount answer goes with the feed: READY must not overtake the records before it.
            if not self.closed:
                self._held.append(self.channel.family.encode(msg))
            return
        if faults.corrupt_data > 0:
            if t is m.TransactionDataResponse and msg.error is None:
                faults.corrupt_data -= 1
                msg = attrs.evolve(msg, checksum=msg.checksum ^ _CORRUPTION)
            elif t is m.TransactionDataRangeResponse and msg.error is None and msg.checksums:
                faults.corrupt_data -= 1  # the first transaction of the answer arrives damaged
                msg = attrs.evolve(msg, checksums=(msg.checksums[0] ^ _CORRUPTION, *msg.checksums[1:]))
        super().post(msg)

    def post_many(self, msgs: Iterable[Any]) -> None:
        for msg in msgs:
            self.post(msg)

    def post_frames(self, frames: list[bytes]) -> None:
        # Only feeds post pre-encoded frames (FeedData).
        if self._faults.feed_suspended:
            if not self.closed:
                self._held.extend(frames)
            return
        super().post_frames(frames)

    def release(self) -> None:
        """Send what the suspended feed held back, in order."""
        held, self._held = self._held, []
        if held:
            super().post_frames(held)


class MockCluster:
    """An in-memory cluster; see the module docstring.

    ``async with`` starts it on the running loop; ``with`` runs it on its own loop thread (and
    the sync clients it hands out share that loop, as the memory transport needs).
    ``lock_table`` makes a partition's lock table from its high-water mark, as the server's
    ``server.lock_table`` strategy does (default: ``exact``); partitions otherwise run with the
    server's default settings.
    """

    def __init__(self, num_partitions: int = 1, *, seed: int | None = None,
                 client_config: ClientConfig | None = None,
                 lock_table: Callable[[int], LockTable] = ExactLockTable) -> None:
        if num_partitions < 1:
            raise ValueError("num_partitions must be at least 1")
        self.num_partitions = num_partitions
        self._rng = random.Random(seed)
        self._client_config = client_config or ClientConfig(long_wait_threshold=0.3, mount_timeout=10.0,
                                                           reconnect_delay=0.05, rpc_timeout=5.0)
        self._server_config = ServerConfig()
        self._lock_table = lock_table
        self._transport_config = TransportConfig(name="memory")
        self._budgets = (CacheBudget(self._server_config.feed_cache_budget),
                         CacheBudget(self._server_config.data_cache_budget))
        # faults (set from any thread, read on the loop)
        self._fault_rate = 0.0
        self._fail_next_append = False
        self._fail_next_lock = False
        self._max_delay = 0.0
        self._outbound = _OutboundFaults()
        #: Data RPCs served, in order: (partition, transaction) and (partition, first, max count).
        self.data_requests: list[tuple[int, int]] = []
        self.data_range_requests: list[tuple[int, int, int]] = []
        self.dropped_appends = 0
        self._forced_lock_failures = 0
        self._appends: dict[ReqId, _AppendLocks] = {}  # every append that reached a partition
        self._logs = {pid: MemoryLog() for pid in range(num_partitions)}
        #: The live partitions (the server's Partition objects), by id.
        self.partitions: dict[int, Partition] = {}
        self._retired: list[Partition] = []  # earlier generations (their lock-failure counts still count)
        self._inbound_links = {pid: _InboundLink(self._inbound, pid) for pid in range(num_partitions)}
        self._client_ids = itertools.count(1)
        self._views: list[StaticDiscovery] = []
        self._links: set[_FaultyLink] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._listener: Listener | None = None
        self.address = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        self.loop = asyncio.get_running_loop()
        self.partitions = {pid: self._new_partition(pid, 1) for pid in range(self.num_partitions)}
        await asyncio.gather(*(p.open() for p in self.partitions.values()))
        self._transport = MemoryTransport(self._transport_config.max_frame_size)
        self._listener = await self._transport.listen("mock-waltz", 0, self._serve)
        self.address = self._listener.address
        return self

    async def stop(self) -> None:
        for view in self._views:
            await view.close()  # no owner changes reach the clients any more
        for link in list(self._links):
            await link.close()
        if self._listener is not None:
            await self._listener.close()
        # Moves and link closes end on their own, quickly; a move cut short could leave a store
        # session open. Cancel only what is stuck.
        if self._tasks:
            _done, stuck = await asyncio.wait(self._tasks, timeout=5)
            for t in stuck:
                t.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        partitions = [*self._retired, *self.partitions.values()]
        await asyncio.gather(*(p.close() for p in partitions), return_exceptions=True)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __enter__(self) -> Self:
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="waltz-mock-cluster", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.start(), loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        loop = self.loop
        assert loop is not None and self._thread is not None
        asyncio.run_coroutine_threadsafe(self.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        loop.close()
        self._thread = None

    def _new_partition(self, partition_id: int, generation: int) -> Partition:
        cfg = self._server_config
        # The in-flight window of the server's ReplicatedStore.
        store = MemoryStore(self._logs[partition_id], window=max(4 * cfg.max_batch_size, 64),
                            commit_delay=self._commit_delay)
        return Partition(partition_id, generation, store, self._lock_table, cfg,
                         max_frame_size=self._transport_config.max_frame_size, budgets=self._budgets)

    def _commit_delay(self) -> float:
        return self._rng.uniform(0.0, self._max_delay) if self._max_delay > 0 else 0.0

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -------------------------------------------------------------------------------- clients

    def client_process_config(self) -> ClientProcessConfig:
        return ClientProcessConfig(client=self._client_config, transport=self._transport_config)

    def discovery(self) -> StaticDiscovery:
        """A discovery view for one client (shares the cluster's client-id counter)."""
        from ..client.discovery import StaticDiscovery

        view = StaticDiscovery(self.num_partitions, self._owners(), self._client_ids)
        self._views.append(view)
        return view

    def _owners(self) -> dict[int, PartitionOwner]:
        return {pid: PartitionOwner(self.address, p.generation, 1) for pid, p in self.partitions.items()}

    def client(self, callbacks: WaltzClientCallbacks, config: ClientProcessConfig | None = None) -> WaltzClient:
        """A started :class:`~waltz_core.client.WaltzClient` on this cluster (``with MockCluster`` mode)."""
        from ..client.sync import WaltzClient

        if self._thread is None:
            raise RuntimeError("sync clients need the cluster's own loop thread: use 'with MockCluster(...)'")
        return WaltzClient(callbacks, config or self.client_process_config(), discovery=self.discovery(), loop=self.loop)

    def async_client(self, callbacks: WaltzClientCallbacks, config: ClientProcessConfig | None = None) -> AsyncWaltzClient:
        """An unstarted :class:`~waltz_core.client.AsyncWaltzClient` (``async with`` it)."""
        from ..client.core import AsyncWaltzClient

        return AsyncWaltzClient(callbacks, config or self.client_process_config(), discovery=self.discovery())

    # ------------------------------------------------------------------------ fault injection

    def _soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the cluster's loop: at once on it, waiting for it from another thread."""
        loop = self.loop
        assert loop is not None, "the cluster is not started"
        if self._thread is not None and threading.current_thread() is not self._thread:
            asyncio.run_coroutine_threadsafe(_call(fn), loop).result(10)
        else:
            fn()

    def set_fault_rate(self, rate: float) -> None:
        """Drop each append with this probability (0 <= rate <= 1)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError("fault rate must be within [0, 1]")
        self._fault_rate = rate

    def force_next_append_fail(self) -> None:
        """Drop the next append (the client's monitor finds out)."""
        self._fail_next_append = True

    def force_next_lock_fail(self) -> None:
        """Answer the next append with a lock failure (conflicting transaction = the current high-water mark)."""
        self._fail_next_lock = True

    def set_max_delay(self, seconds: float) -> None:
        """Delay the commit of every append by up to ``seconds`` (uniformly random), order kept."""
        self._max_delay = max(0.0, seconds)

    def corrupt_next_data(self, count: int = 1) -> None:
        """The next ``count`` transaction data answers carry a wrong checksum."""
        self._outbound.corrupt_data = count

    def suspend_feed(self) -> None:
        """Hold back feed records and mount answers to every client (appends still commit)."""
        def suspend() -> None:
            self._outbound.feed_suspended = True
        self._soon(suspend)

    def resume_feed(self) -> None:
        """Send what :meth:`suspend_feed` held back, and feed as usual again."""
        def resume() -> None:
            self._outbound.feed_suspended = False
            for link in self._links:
                link.release()
        self._soon(resume)

    def disconnect_clients(self) -> None:
        """Close every client connection (clients reconnect and re-mount)."""
        def close_all() -> None:
            for link in list(self._links):
                self._spawn(link.close())
        self._soon(close_all)

    def move_partition(self, partition_id: int) -> None:
        """Give the partition a new generation (as a reassignment does) and tell the clients.

        The new generation's partition takes messages at once (they wait in its queue until it
        has opened); the old one closes, its clients hear ``FeedSuspended``.
        """
        def move() -> None:
            old = self.partitions[partition_id]
            new = self._new_partition(partition_id, old.generation + 1)
            self.partitions[partition_id] = new
            self._retired.append(old)
            self._spawn(self._replace(old, new))
            owners = self._owners()
            for view in self._views:
                view.set_owners(owners)
        self._soon(move)

    async def _replace(self, old: Partition, new: Partition) -> None:
        await old.close()  # first: a store session must end before the next one opens on its log
        try:
            await new.open()
        except WaltzError as exc:
            log.warning("mock partition %d (generation %d) could not open: %s", new.partition_id, new.generation, exc)

    # ---------------------------------------------------------------------------- inspection

    @property
    def lock_failures(self) -> int:
        """Appends answered with a lock failure: by the partitions' lock tables, and forced ones."""
        partitions = [*self._retired, *self.partitions.values()]
        return self._forced_lock_failures + sum(p.lock_failures for p in partitions)

    def high_water_mark(self, partition_id: int) -> int:
        return self._logs[partition_id].high_water_mark

    def transactions(self, partition_id: int) -> list[LoggedTransaction]:
        """The committed log of a partition (a copy)."""
        appends = self._appends
        return [_logged(r, appends[r.req_id]) for r in self._logs[partition_id].committed()]

    # -------------------------------------------------------------------------------- serving

    async def _serve(self, conn: Connection) -> None:
        try:
            channel = await MessageChannel.open(conn, CLIENT, "waltz-mock-cluster")
        except WaltzError:
            await conn.close()
            return
        link = _FaultyLink(self._outbound, channel, self._server_config, self._transport_config.max_frame_size)
        self._links.add(link)
        try:
            await read_client_messages(link, self._inbound_links, _ignore_admin)
        except (ConnectionClosedError, ProtocolError, TransportError) as exc:
            log.debug("mock cluster: connection from %s ended: %s", link.peer, exc)
        finally:
            self._links.discard(link)
            for partition in list(self.partitions.values()):
                partition.disconnect(link)
            await link.close()

    def _inbound(self, partition_id: int, msg: Any, link: ClientLink) -> asyncio.Future[None] | None:
        """One message on its way to partition ``partition_id``: the inbound faults, then the partition."""
        partition = self.partitions[partition_id]
        t = type(msg)
        if t is m.AppendRequest:
            if self._fail_next_append or (self._fault_rate > 0 and self._rng.random() < self._fault_rate):
                self._fail_next_append = False
                self.dropped_appends += 1
                return None  # lost on the way, as with a connection: the client's monitor finds out
            if self._fail_next_lock:
                self._fail_next_lock = False
                self._forced_lock_failures += 1
                link.post(m.LockFailure(msg.req_id, partition.high_water_mark))
                return None
            self._appends[msg.req_id] = _AppendLocks(msg.client_high_water_mark, msg.write_locks, msg.read_locks,
                                                     msg.append_locks)
        elif t is m.TransactionDataRequest:
            self.data_requests.append((partition_id, msg.transaction_id))
        elif t is m.TransactionDataRangeRequest:
            self.data_range_requests.append((partition_id, msg.first_transaction_id, msg.max_count))
        return partition.offer(msg, link)


def _logged(record: Record, locks: _AppendLocks) -> LoggedTransaction:
    return LoggedTransaction(record.transaction_id, record.req_id, record.header, record.data, record.checksum,
                             locks.client_high_water_mark, locks.write_locks, locks.read_locks, locks.append_locks)


def _ignore_admin(msg: Any, link: ClientLink) -> None:
    # No cluster manager and no storage nodes here: the admin requests have nothing to act on.
    log.debug("mock cluster: %s from %s ignored", type(msg).__name__, link.peer)


async def _call(fn: Callable[[], None]) -> None:
    fn()
