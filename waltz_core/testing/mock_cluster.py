"""An in-memory Waltz cluster for application unit tests (the original's ``MockDriver``).

:class:`MockCluster` is a fake *server* speaking the real client protocol over the built-in
``memory`` transport: the clients it serves are the real :class:`~waltz_core.client.WaltzClient`
/ :class:`~waltz_core.client.AsyncWaltzClient` with all their code paths (mount, feed, monitor,
retries, reconnects, data RPCs). Each partition keeps its log in memory and checks locks with the
exact lock table (:class:`~waltz_core.locks.ExactLockTable`), so lock semantics are the server's
without false conflicts. No storage, no coordination, no sockets.

Several clients share one cluster (distinct client ids), as with ``MockServerPartition``::

    with MockCluster(num_partitions=4) as cluster:
        with cluster.client(MyCallbacks()) as client:     # a WaltzClient
            client.submit(MyContext(...))
            client.flush()

    async with MockCluster(4) as cluster:                 # on the running loop
        async with cluster.async_client(MyCallbacks()) as client: ...

Fault injection (safe from any thread): :meth:`set_fault_rate` (appends silently dropped with
that probability, found out by the client's monitor as on a real network), :meth:`force_next_append_fail`,
:meth:`force_next_lock_fail`, :meth:`set_max_delay` (random commit delay, order kept),
:meth:`suspend_feed` / :meth:`resume_feed`, :meth:`corrupt_next_data`, :meth:`disconnect_clients`
(every client reconnects and re-mounts) and :meth:`move_partition` (new generation: clients follow
the assignment change).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
from collections.abc import Callable
from typing import Any, Self

import attrs

from ..config import ClientConfig, ClientProcessConfig, TransportConfig
from ..coordination.recipes import PartitionOwner
from ..errors import ConnectionClosedError, ProtocolError, TransportError, WaltzError
from ..locks.base import NO_LOCKS, Begin, LockRequest
from ..locks.exact import ExactLockTable
from ..protocol import CLIENT
from ..protocol import client as m
from ..protocol.wire import ReqId
from ..server.link import ClientLink
from ..transport import MessageChannel
from ..transport.base import Connection
from ..transport.memory import MemoryTransport

log = logging.getLogger("waltz.testing.mock_cluster")


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


@attrs.define(eq=False)
class _Slot:
    seq_num: int
    link: ClientLink
    feed: asyncio.Task[None] | None = None


class _MockPartition:
    def __init__(self, cluster: MockCluster, partition_id: int) -> None:
        self.cluster = cluster
        self.id = partition_id
        self.generation = 1
        self.log: list[LoggedTransaction] = []
        self.locks = ExactLockTable(-1)
        self.clients: dict[int, _Slot] = {}
        self.queue: asyncio.Queue[tuple[Any, ClientLink]] = asyncio.Queue()
        self.committed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"mock-partition-{partition_id}")

    @property
    def hwm(self) -> int:
        return len(self.log) - 1

    def wake(self) -> None:
        self.committed.set()
        self.committed = asyncio.Event()

    async def _run(self) -> None:
        while True:
            msg, link = await self.queue.get()
            try:
                if type(msg) is m.AppendRequest:
                    await self._append(msg, link)
                elif type(msg) is m.MountRequest:
                    self._mount(msg, link)
                elif type(msg) is m.FlushRequest and msg.req_id.generation == self.generation:
                    link.post(m.FlushResponse(msg.req_id, self.hwm))
            except Exception:
                log.exception("mock partition %d: error handling %s", self.id, type(msg).__name__)

    def _current(self, q: ReqId, link: ClientLink) -> bool:
        slot = self.clients.get(q.client_id)
        return q.generation == self.generation and slot is not None and slot.link is link

    async def _append(self, req: m.AppendRequest, link: ClientLink) -> None:
        c = self.cluster
        if c._max_delay > 0:
            await asyncio.sleep(c._rng.uniform(0, c._max_delay))
        if not self._current(req.req_id, link):
            return
        if c._fail_next_append or (c._fault_rate > 0 and c._rng.random() < c._fault_rate):
            c._fail_next_append = False
            c.dropped_appends += 1
            return  # dropped, as a request lost with a connection: the client's monitor finds out
        if c._fail_next_lock:
            c._fail_next_lock = False
            c.lock_failures += 1
            link.post(m.LockFailure(req.req_id, self.hwm))
            return
        request = LockRequest.from_append(req) if (req.write_locks or req.read_locks or req.append_locks) else NO_LOCKS
        if request is not NO_LOCKS:
            assert self.locks.begin(request) is Begin.OK  # commits are immediate: nothing is ever in flight
            conflict = self.locks.check(request, req.client_high_water_mark)
            if conflict is not None:
                self.locks.abort(request)
                c.lock_failures += 1
                link.post(m.LockFailure(req.req_id, conflict))
                return
        txn = len(self.log)
        self.log.append(LoggedTransaction(txn, req.req_id, req.header, req.data, req.checksum,
                                          req.client_high_water_mark, req.write_locks, req.read_locks, req.append_locks))
        if request is not NO_LOCKS:
            self.locks.commit(request, txn)
        self.wake()

    def _mount(self, msg: m.MountRequest, link: ClientLink) -> None:
        q = msg.req_id
        if q.generation != self.generation:
            link.post(m.MountResponse(q, m.PartitionState.NOT_READY))
            return
        slot = self.clients.get(q.client_id)
        if slot is not None and msg.seq_num < slot.seq_num:
            return
        if slot is not None and slot.feed is not None:
            slot.feed.cancel()
        if msg.client_high_water_mark > self.hwm:
            self.clients.pop(q.client_id, None)
            link.post(m.MountResponse(q, m.PartitionState.CLIENT_AHEAD))
            return
        slot = _Slot(msg.seq_num, link)
        self.clients[q.client_id] = slot
        slot.feed = asyncio.get_running_loop().create_task(self._feed(link, q, msg.client_high_water_mark, self.hwm))

    async def _feed(self, link: ClientLink, q: ReqId, client_hwm: int, mount_until: int | None) -> None:
        next_id = client_hwm + 1
        c = self.cluster
        while not link.closed:
            if c._feed_resumed.is_set() and next_id <= self.hwm:
                batch = self.log[next_id:next_id + 256]
                link.post_many([m.FeedData(t.req_id, t.transaction_id, t.header) for t in batch])
                next_id += len(batch)
                await link.wait_writable()
                continue
            if mount_until is not None and next_id > mount_until:
                link.post(m.MountResponse(q, m.PartitionState.READY))
                mount_until = None
                continue
            waiter = self.committed if c._feed_resumed.is_set() else c._feed_resumed
            await waiter.wait()

    def serve_data(self, msg: m.TransactionDataRequest, link: ClientLink) -> None:
        txn = msg.transaction_id
        self.cluster.data_requests.append((self.id, txn))
        if not 0 <= txn <= self.hwm:
            link.post(m.TransactionDataResponse(msg.req_id, txn, None, 0, f"transaction {txn} is not committed"))
            return
        record = self.log[txn]
        checksum = record.checksum
        if self.cluster._corrupt_data > 0:
            self.cluster._corrupt_data -= 1
            checksum ^= 0x5A5A5A5A
        link.post(m.TransactionDataResponse(msg.req_id, txn, record.data, checksum, None))

    def serve_data_range(self, msg: m.TransactionDataRangeRequest, link: ClientLink) -> None:
        first = msg.first_transaction_id
        self.cluster.data_range_requests.append((self.id, first, msg.max_count))
        if not 0 <= first <= self.hwm or msg.max_count < 1:
            link.post(m.TransactionDataRangeResponse(msg.req_id, first, (), (), f"transaction {first} is not committed"))
            return
        records = self.log[first:min(self.hwm + 1, first + msg.max_count)]
        checksums = [r.checksum for r in records]
        if self.cluster._corrupt_data > 0:  # the first transaction of the answer arrives damaged
            self.cluster._corrupt_data -= 1
            checksums[0] ^= 0x5A5A5A5A
        link.post(m.TransactionDataRangeResponse(msg.req_id, first, tuple(r.data for r in records),
                                                 tuple(checksums), None))

    def bump_generation(self) -> None:
        self.generation += 1
        for slot in self.clients.values():
            if slot.feed is not None:
                slot.feed.cancel()
            slot.link.post(m.FeedSuspended(ReqId(0, self.generation - 1, self.id, 0)))
        self.clients.clear()

    def disconnect(self, link: ClientLink) -> None:
        for cid, slot in list(self.clients.items()):
            if slot.link is link:
                if slot.feed is not None:
                    slot.feed.cancel()
                del self.clients[cid]


class MockCluster:
    """An in-memory cluster; see the module docstring.

    ``async with`` starts it on the running loop; ``with`` runs it on its own loop thread (and
    the sync clients it hands out share that loop, as the memory transport needs).
    """

    def __init__(self, num_partitions: int = 1, *, seed: int | None = None,
                 client_config: ClientConfig | None = None) -> None:
        if num_partitions < 1:
            raise ValueError("num_partitions must be at least 1")
        self.num_partitions = num_partitions
        self._rng = random.Random(seed)
        self._client_config = client_config or ClientConfig(long_wait_threshold=0.3, mount_timeout=10.0,
                                                           reconnect_delay=0.05, rpc_timeout=5.0)
        self._fault_rate = 0.0
        self._fail_next_append = False
        self._fail_next_lock = False
        self._max_delay = 0.0
        self._corrupt_data = 0
        #: Data RPCs served, in order: (partition, transaction) and (partition, first, max count).
        self.data_requests: list[tuple[int, int]] = []
        self.data_range_requests: list[tuple[int, int, int]] = []
        self.dropped_appends = 0
        self.lock_failures = 0
        self._client_ids = itertools.count(1)
        self._views: list[Any] = []
        self.partitions: dict[int, _MockPartition] = {}
        self._links: set[ClientLink] = set()
        self._listener: Any = None
        self.address = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._feed_resumed: asyncio.Event = None  # type: ignore[assignment]  # created on the loop

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        self.loop = asyncio.get_running_loop()
        self._feed_resumed = asyncio.Event()
        self._feed_resumed.set()
        self.partitions = {pid: _MockPartition(self, pid) for pid in range(self.num_partitions)}
        self._transport = MemoryTransport()
        self._listener = await self._transport.listen("mock-waltz", 0, self._serve)
        self.address = self._listener.address
        return self

    async def stop(self) -> None:
        for view in self._views:
            view._listeners.clear()
        for link in list(self._links):
            await link.close()
        if self._listener is not None:
            await self._listener.close()
        tasks = [p.task for p in self.partitions.values()]
        tasks += [s.feed for p in self.partitions.values() for s in p.clients.values() if s.feed is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

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

    # -------------------------------------------------------------------------------- clients

    def client_process_config(self) -> ClientProcessConfig:
        return ClientProcessConfig(client=self._client_config, transport=TransportConfig(name="memory"))

    def discovery(self) -> Any:
        """A discovery view for one client (shares the cluster's client-id counter)."""
        from ..client.discovery import StaticDiscovery

        view = StaticDiscovery(self.num_partitions, self._owners(), self._client_ids)
        self._views.append(view)
        return view

    def _owners(self) -> dict[int, PartitionOwner]:
        return {pid: PartitionOwner(self.address, p.generation, 1) for pid, p in self.partitions.items()}

    def client(self, callbacks: Any, config: ClientProcessConfig | None = None) -> Any:
        """A started :class:`~waltz_core.client.WaltzClient` on this cluster (``with MockCluster`` mode)."""
        from ..client.sync import WaltzClient

        if self._thread is None:
            raise RuntimeError("sync clients need the cluster's own loop thread: use 'with MockCluster(...)'")
        return WaltzClient(callbacks, config or self.client_process_config(), discovery=self.discovery(), loop=self.loop)

    def async_client(self, callbacks: Any, config: ClientProcessConfig | None = None) -> Any:
        """An unstarted :class:`~waltz_core.client.AsyncWaltzClient` (``async with`` it)."""
        from ..client.core import AsyncWaltzClient

        return AsyncWaltzClient(callbacks, config or self.client_process_config(), discovery=self.discovery())

    # ------------------------------------------------------------------------ fault injection

    def _soon(self, fn: Callable[[], None]) -> None:
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
        self._fail_next_append = True

    def force_next_lock_fail(self) -> None:
        """Answer the next append with a lock failure (conflicting transaction = the current high-water mark)."""
        self._fail_next_lock = True

    def set_max_delay(self, seconds: float) -> None:
        """Delay every append by up to ``seconds`` (uniformly random) before it commits."""
        self._max_delay = max(0.0, seconds)

    def corrupt_next_data(self, count: int = 1) -> None:
        """The next ``count`` transaction data answers carry a wrong checksum."""
        self._corrupt_data = count

    def suspend_feed(self) -> None:
        self._soon(self._feed_resumed.clear)

    def resume_feed(self) -> None:
        self._soon(self._feed_resumed.set)

    def disconnect_clients(self) -> None:
        """Close every client connection (clients reconnect and re-mount)."""
        def close_all() -> None:
            for link in list(self._links):
                asyncio.get_running_loop().create_task(link.close())
        self._soon(close_all)

    def move_partition(self, partition_id: int) -> None:
        """Give the partition a new generation (as a reassignment does) and tell the clients."""
        def move() -> None:
            self.partitions[partition_id].bump_generation()
            owners = self._owners()
            for view in self._views:
                view.set_owners(owners)
        self._soon(move)

    # ---------------------------------------------------------------------------- inspection

    def high_water_mark(self, partition_id: int) -> int:
        return self.partitions[partition_id].hwm

    def transactions(self, partition_id: int) -> list[LoggedTransaction]:
        """The committed log of a partition (a copy)."""
        return list(self.partitions[partition_id].log)

    # -------------------------------------------------------------------------------- serving

    async def _serve(self, conn: Connection) -> None:
        try:
            channel = await MessageChannel.open(conn, CLIENT, "waltz-mock-cluster")
        except WaltzError:
            await conn.close()
            return
        link = ClientLink(channel)
        self._links.add(link)
        try:
            while True:
                msg = await channel.recv()
                t = type(msg)
                p = self.partitions.get(msg.req_id.partition_id)
                if p is None:
                    continue
                if t in (m.AppendRequest, m.MountRequest, m.FlushRequest):
                    await p.queue.put((msg, link))
                elif t is m.TransactionDataRequest:
                    p.serve_data(msg, link)
                elif t is m.TransactionDataRangeRequest:
                    p.serve_data_range(msg, link)
                elif t is m.HighWaterMarkRequest:
                    link.post(m.HighWaterMarkResponse(msg.req_id, p.hwm))
        except (ConnectionClosedError, ProtocolError, TransportError):
            pass
        finally:
            self._links.discard(link)
            for p in self.partitions.values():
                p.disconnect(link)
            await link.close()


async def _call(fn: Callable[[], None]) -> None:
    fn()
