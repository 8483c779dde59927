"""The Waltz server process (seed 000): client connections, partitions, cluster membership.

Backends are resolved by name once, at start (transport, coordination, lock table), from the
registries of the :class:`~waltz_core.runtime.Runtime` the server is given, and its lifecycle
hooks (``waltz_process_started``, ``waltz_partition_opened``, ...) and the commit rule
(``waltz_commit_quorum``, once per partition) are called on that runtime's plugin manager;
nothing on the per-transaction path goes through a hook. Each client connection is read by one task that
decodes messages and hands them to their partition; a full partition queue stops that read
(back pressure to the client's socket). Bytes that do not decode close that connection only.
Partitions open and close as the cluster manager's assignment changes; a new generation of a
partition this server already owns replaces the old object (its pending appends fail, the
clients re-mount).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ..config import ServerProcessConfig
from ..coordination import open_coordination
from ..coordination.metadata import ServerDescriptor
from ..coordination.recipes import ClusterManager, ReplicaAssignmentWatcher, ServerAssignment, StoreMetadata
from ..errors import ConnectionClosedError, ProtocolError, TransportError, WaltzError
from ..eventloop import loop_name
from ..http import HttpEndpoint
from ..locks.open import open_lock_table
from ..memlimit import server_shortfall
from ..metrics import Gauge, MetricsRegistry
from ..plugins import core_version
from ..protocol import CLIENT
from ..protocol import client as m
from ..protocol.wire import INT32_MAX
from ..transport import MessageChannel, check_plaintext_allowed, is_plaintext, open_transport
from ..transport.base import Connection, Listener
from ..transport.expiry import CertificateWatch
from .caches import CacheBudget
from .dispatch import read_client_messages
from .glue import CoordinationMetadata, StorageConnector
from .link import ClientLink
from .partition import Partition
from .store import ReplicatedStore, ReplicationBudget, StreamPump
from .vote import quorum_of

if TYPE_CHECKING:
    from ..runtime import Runtime

log = logging.getLogger("waltz.server")

#: seconds of per-partition gauge refreshes between the metrics loop's yields to the event loop
METRICS_SLICE = 0.0005


class WaltzServer:
    def __init__(self, config: ServerProcessConfig, runtime: Runtime) -> None:
        self.config = config
        self.runtime = runtime
        self.registries = runtime.registries
        self.partitions: dict[int, Partition] = {}
        self._stores: dict[int, ReplicatedStore] = {}  #: the replicated store of each partition in self.partitions
        self._replica_watcher: ReplicaAssignmentWatcher | None = None
        self.metrics = MetricsRegistry("waltz_server")
        self._partition_gauges = PartitionGauges(self.metrics)
        self.name = "waltz-server"
        self._listener: Listener | None = None
        self._http: HttpEndpoint | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._links: set[ClientLink] = set()
        self._assignment_lock = asyncio.Lock()
        self._closed = False
        self._certificates = CertificateWatch(None)  #: the transport's, once start() opened it
        # One budget per kind for the whole server, whatever the number of partitions it owns.
        self.feed_budget = CacheBudget(config.server.feed_cache_budget)
        self.data_budget = CacheBudget(config.server.data_cache_budget)
        self.replication_budget = ReplicationBudget(config.server.replication_buffer_budget)
        self.stream_pump = StreamPump()
        # Resolve the lock-table strategy now so a bad name fails at start, not at the first partition.
        self.registries.resolve("lock_table", config.server.lock_table)

    # ----------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        cfg = self.config
        self.runtime.warn_unsafe(log, "this server")
        self.transport = open_transport(cfg.transport, self.registries)
        check_plaintext_allowed(self.transport, cfg.server.host, cfg.security.insecure, "server.host")
        self._certificates = CertificateWatch(self.transport)
        self.coordination = open_coordination(cfg.coordination, self.registries)
        await self.coordination.start()
        self.store_metadata = StoreMetadata(self.coordination, cfg.coordination.root)
        params = await self.store_metadata.get_store_params()
        self.num_partitions = params.num_partitions
        self.connector = StorageConnector(self.transport, params.cluster_key, params.num_partitions,
                                          f"{self.name} {core_version()}", cfg.transport.connect_timeout,
                                          cfg.server.storage_request_timeout)
        self._metadata = CoordinationMetadata(self.store_metadata)
        self._listener = await self.transport.listen(cfg.server.host, cfg.server.port, self._serve)
        self.address = self._listener.address
        self.cluster = ClusterManager(
            self.coordination, cfg.coordination.root,
            ServerDescriptor(address=self.address, preferred_partitions=tuple(cfg.server.preferred_partitions)),
            on_assignment=self._on_assignment,
        )
        await self.cluster.start()
        self.name = f"waltz-server-{self.cluster.server_id}"
        self._replica_watcher = ReplicaAssignmentWatcher(self.coordination, cfg.coordination.root,
                                                         self._on_replica_assignment)
        await self._replica_watcher.start()
        self._register_metrics()
        if cfg.http.port:
            self._http = HttpEndpoint(service_name="waltz-server", version=core_version(), metrics=self.metrics,
                                      health=self.health)
            self._certificates.register(self._http.process_metrics)
            await self._http.start(cfg.http.host, cfg.http.port)
        if is_plaintext(self.transport):
            log.warning("server %s: client and storage links are not encrypted (development mode)", self.address)
        self._check_memory()
        self._certificates.log_at_start(f"server {self.address}")
        log.info("%s listening on %s (transport %s, coordination %s)", self.name, self.address,
                 cfg.transport.name, cfg.coordination.name)
        self.runtime.hook.waltz_process_started(kind="server", name=self.name, address=self.address)

    def _check_memory(self) -> None:
        """Warn at start when the caches, once full, would not fit the process's memory limit."""
        cfg = self.config.server
        short = server_shortfall({"feed_cache_budget": cfg.feed_cache_budget,
                                  "data_cache_budget": cfg.data_cache_budget,
                                  "replication_buffer_budget": cfg.replication_buffer_budget},
                                 self.num_partitions, cfg.lock_table_size if cfg.lock_table == "hashed" else 0)
        if short is not None:
            log.warning("server %s: %s", self.address, short)

    async def stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.runtime.hook.waltz_process_stopping(kind="server", name=self.name)
        if self._replica_watcher is not None:
            await self._replica_watcher.close()
        await self.cluster.close()
        if self._listener is not None:
            await self._listener.close()
        for link in list(self._links):
            await link.close()
        await asyncio.gather(*(self._close_partition(pid) for pid in list(self.partitions)), return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.connector.close()
        if self._http is not None:
            await self._http.close()
        await self.coordination.close()
        await self.transport.aclose()

    @property
    def http_address(self) -> str | None:
        return self._http.address if self._http is not None else None

    # --------------------------------------------------------------------- partition ownership

    async def _on_assignment(self, assignment: ServerAssignment) -> None:
        async with self._assignment_lock:
            wanted = dict(assignment.partitions)
            for pid in list(self.partitions):
                if wanted.get(pid) != self.partitions[pid].generation:
                    await self._close_partition(pid)
            for pid, generation in wanted.items():
                if pid not in self.partitions and not self._closed:
                    self._open_partition(pid, generation)

    def _open_partition(self, pid: int, generation: int) -> None:
        # A plugin's commit rule, asked once per partition; the majority when no plugin has one.
        commit_quorum = self.runtime.hook.waltz_commit_quorum(server_name=self.name, partition_id=pid) or quorum_of
        store = ReplicatedStore(pid, generation, self._metadata, self.connector, self.config.server,
                                self.replication_budget, commit_quorum, self.stream_pump,
                                max_frame_size=self.config.transport.max_frame_size)
        server_cfg, regs = self.config.server, self.registries
        labels = {"partition": str(pid)}
        latency = self.metrics.histogram("commit_latency_seconds", "Seconds from hand-off to storage to quorum commit",
                                         labels)
        partition = Partition(pid, generation, store, lambda hwm: open_lock_table(server_cfg, hwm, regs), server_cfg,
                              latency, max_frame_size=self.config.transport.max_frame_size,
                              budgets=(self.feed_budget, self.data_budget))
        # The partition counts in plain ints on its append path; these read them at scrape time.
        self.metrics.counter("appends", "Appends accepted (handed to the store) since the partition opened here",
                             labels, fn=lambda: partition.appends)
        self.metrics.counter("lock_failures", "Appends rejected by the lock table since the partition opened here",
                             labels, fn=lambda: partition.lock_failures)
        self.metrics.counter("appends_refused", "Appends refused for good (too large, too many locks) since the "
                             "partition opened here", labels, fn=lambda: partition.refused)
        self.partitions[pid] = partition
        self._stores[pid] = store
        log.info("%s: opening partition %d (generation %d)", self.name, pid, generation)

        async def run() -> None:
            try:
                await partition.open()
            except WaltzError as exc:
                log.warning("%s: partition %d could not open: %s", self.name, pid, exc)
                return
            log.info("%s: partition %d ready at high-water mark %d", self.name, pid, partition.high_water_mark)
            self.runtime.hook.waltz_partition_opened(
                server_name=self.name, partition_id=pid, high_water_mark=partition.high_water_mark)

        partition.open_task = asyncio.get_running_loop().create_task(run(), name=f"open-p{pid}")
        self._tasks.add(partition.open_task)
        partition.open_task.add_done_callback(self._tasks.discard)

    async def _close_partition(self, pid: int) -> None:
        partition = self.partitions.pop(pid, None)
        self._stores.pop(pid, None)
        if partition is None:
            return
        await partition.close()
        self.metrics.remove({"partition": str(pid)})
        self._partition_gauges.forget(pid)  # a partition opened again meanwhile gets its gauges back
        log.info("%s: closed partition %d", self.name, pid)
        self.runtime.hook.waltz_partition_closed(server_name=self.name, partition_id=pid)

    def _on_replica_assignment(self, by_partition: dict[int, list[str]]) -> None:
        """``waltz cluster assign-partition`` / ``unassign-partition`` changed the replicas: each
        partition this server owns starts its next session on its new set."""
        for pid, store in self._stores.items():
            store.replicas_assigned(by_partition.get(pid, []))
        self.connector.keep_only({endpoint for endpoints in by_partition.values() for endpoint in endpoints})

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------------- connections

    async def _serve(self, conn: Connection) -> None:
        try:
            channel = await MessageChannel.open(conn, CLIENT, f"{self.name} {core_version()}")
        except WaltzError as exc:
            log.warning("%s: handshake with %s failed: %s", self.name, conn.peer, exc)
            await conn.close()
            return
        cfg = self.config.server
        # The smallest frame limit of this server and its storage nodes connected now: a client
        # of protocol 4 checks against it before sending (a node connected later with a smaller
        # one, or whose partition is elsewhere, refuses through the partition: AppendRefused).
        frame = self.connector.smallest_frame_limit(self.config.transport.max_frame_size)
        link = ClientLink(channel, inbound_high_water=cfg.inbound_high_water, inbound_low_water=cfg.inbound_low_water,
                          limits=(min(frame, INT32_MAX), cfg.max_locks_per_transaction))
        self._links.add(link)
        partitions = self.partitions
        try:
            await read_client_messages(link, partitions, lambda msg, peer: self._spawn(self._admin(msg, peer)))
        except ConnectionClosedError:
            pass
        except ProtocolError as exc:
            log.warning("%s: closing connection from %s: %s", self.name, link.peer, exc)
        except TransportError as exc:
            log.info("%s: connection from %s failed: %s", self.name, link.peer, exc)
        finally:
            self._links.discard(link)
            for partition in list(partitions.values()):
                partition.disconnect(link)
            await link.close()

    async def _admin(self, msg: Any, link: ClientLink) -> None:
        q = msg.req_id
        t = type(msg)
        if t is m.ServerPartitionsAssignmentRequest:
            link.post(m.ServerPartitionsAssignmentResponse(q, tuple(sorted(self.partitions))))
        elif t is m.ServerPartitionsHealthStatRequest:
            link.post(m.ServerPartitionsHealthStatResponse(q, tuple((pid, p.healthy) for pid, p in sorted(self.partitions.items()))))
        elif t is m.CheckStorageConnectivityRequest:
            assignments = await self.store_metadata.get_replica_assignments()
            endpoints = sorted(assignments)
            results = await asyncio.gather(*(self.connector.check(ep) for ep in endpoints))
            link.post(m.CheckStorageConnectivityResponse(q, tuple(zip(endpoints, results, strict=True))))
        elif t in (m.AddPreferredPartitionRequest, m.RemovePreferredPartitionRequest):
            ids = set(msg.partition_ids)
            ok = all(0 <= pid < self.num_partitions for pid in ids)
            if ok:
                current = set(self.cluster.descriptor.preferred_partitions)
                new = current | ids if t is m.AddPreferredPartitionRequest else current - ids
                try:
                    await self.cluster.set_preferred_partitions(sorted(new))
                except WaltzError as exc:
                    log.warning("%s: preferred partitions not updated: %s", self.name, exc)
                    ok = False
            resp = m.AddPreferredPartitionResponse if t is m.AddPreferredPartitionRequest else m.RemovePreferredPartitionResponse
            link.post(resp(q, ok))

    # ---------------------------------------------------------------------------- observability

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Ready (``/readyz``, ``/health``) when the coordination session is connected and every owned
        partition is open, has a store session and reaches a quorum of its storage replicas: then
        its appends can commit. ``reasons`` say what is missing."""
        from ..coordination.base import SessionState

        state = self.coordination.session_state
        reasons = ["server is stopping"] if self._closed else []
        if state is not SessionState.CONNECTED:
            reasons.append(f"coordination session is {state.value}")
        reasons += self._certificates.reasons()
        reachable = {endpoint for endpoint, (up, _down_for, _error) in self.connector.health().items() if up}
        parts: dict[str, bool] = {}
        for pid, p in sorted(self.partitions.items()):
            why = _not_ready(p, reachable)
            parts[str(pid)] = why is None
            if why is not None:
                reasons.append(f"partition {pid} {why}")
        return not reasons, {"coordination": state is SessionState.CONNECTED, "partitions": parts, "reasons": reasons}

    def _register_metrics(self) -> None:
        reg = self.metrics
        reg.gauge("partitions", "Partitions owned by this server", fn=lambda: len(self.partitions))
        reg.gauge("connections", "Open client connections", fn=lambda: len(self._links))
        self._spawn(self._metrics_loop())

    async def _metrics_loop(self) -> None:
        """Refresh per-partition gauges once a second (never on the append path)."""
        reg = self.metrics
        budgets = {"feed": self.feed_budget, "data": self.data_budget}
        for name, budget in budgets.items():
            reg.gauge("cache_budget_bytes", "Bytes the server may keep in this cache, all partitions together",
                      {"cache": name}).set(budget.limit)
        reg.gauge("cache_budget_bytes", "Bytes the server may keep in this cache, all partitions together",
                  {"cache": "replication"}).set(self.replication_budget.limit)
        shown: set[str] = set()  # storage endpoints with a storage_reachable gauge
        while True:
            for name, budget in budgets.items():
                reg.gauge("cache_bytes", "Bytes held in this cache, all partitions together",
                          {"cache": name}).set(budget.used)
            reg.gauge("cache_bytes", "Bytes held in this cache, all partitions together", {"cache": "replication"}).set(
                sum(p.store.buffered_bytes for p in self.partitions.values()))
            health = self.connector.health()
            for endpoint in shown - health.keys():  # forgotten: out of the replica assignment
                reg.remove({"storage": endpoint})
            shown = set(health)
            for endpoint, (reachable, _down_for, _error) in health.items():
                reg.gauge("storage_reachable", "1 while this server reaches the storage node, 0 while it is "
                          "marked unreachable (all partitions go on without it)", {"storage": endpoint}).set(
                    1 if reachable else 0)
            await self._partition_gauges.refresh(self.partitions)
            await asyncio.sleep(1.0)


class PartitionGauges:
    """The per-partition gauges of a server, refreshed by its metrics loop once a second.

    Each partition's gauges are looked up once (the registry sorts the labels at every lookup),
    and a refresh yields to the event loop every :data:`METRICS_SLICE` seconds: a partition's
    latency percentiles may sort 2,048 values (0.1-0.2 ms), and 64 partitions in one go stalled
    every append for 9-11 ms, while a yield after every partition was 256 task steps a second
    for an idle server of 256 partitions.
    """

    __slots__ = ("_registry", "_gauges")

    def __init__(self, registry: MetricsRegistry) -> None:
        self._registry = registry
        self._gauges: dict[int, tuple[Partition, tuple[Gauge, ...]]] = {}  #: pid -> (the partition, its gauges)

    async def refresh(self, partitions: dict[int, Partition]) -> None:
        gauges = self._gauges
        for pid in [pid for pid, (p, _) in gauges.items() if partitions.get(pid) is not p]:
            del gauges[pid]  # closed (its metrics left the registry with it), or opened again since
        sliced = time.perf_counter()
        for pid, p in list(partitions.items()):
            if partitions.get(pid) is not p:
                continue  # closed while the refresh yielded: making its gauges again would resurrect them
            entry = gauges.get(pid)
            if entry is None:
                entry = gauges[pid] = (p, self._make(pid))
            hwm, queue, pending, generation, healthy, p50, p99, lag = entry[1]
            hwm.set(p.high_water_mark)
            queue.set(p.queue_size)
            pending.set(p.pending_count)
            generation.set(p.generation)
            healthy.set(1 if p.healthy else 0)
            latency = p.commit_latency
            p50.set(latency[0])
            p99.set(latency[1])
            lag.set(p.max_feed_lag)
            if time.perf_counter() - sliced >= METRICS_SLICE:
                await asyncio.sleep(0)
                sliced = time.perf_counter()

    def forget(self, pid: int) -> None:
        """The partition's metrics left the registry (it closed): the next refresh registers the
        gauges of a partition of that id again, even one opened while the close was awaited."""
        self._gauges.pop(pid, None)

    def _make(self, pid: int) -> tuple[Gauge, ...]:
        reg, labels = self._registry, {"partition": str(pid)}
        return (reg.gauge("high_water_mark", "Committed high-water mark", labels),
                reg.gauge("append_queue_size", "Appends waiting in the partition queue", labels),
                reg.gauge("pending_appends", "Appends in flight to storage", labels),
                reg.gauge("generation", "Partition generation", labels),
                reg.gauge("healthy", "1 when the partition has a store session", labels),
                reg.gauge("commit_latency_p50_seconds", "Median append-to-commit latency (recent)", labels),
                reg.gauge("commit_latency_p99_seconds", "p99 append-to-commit latency (recent)", labels),
                reg.gauge("feed_lag", "Largest feed lag over the partition's mounted clients", labels))


def _not_ready(p: Partition, reachable: set[str]) -> str | None:
    """Why partition ``p`` cannot commit appends now (``reachable``: the storage endpoints the
    server is connected to), or None."""
    store = p.store
    waiting = store.recovery_waiting if isinstance(store, ReplicatedStore) else None
    if not p.ready:
        return f"is recovering (not open yet): {waiting}" if waiting else "is recovering (not open yet)"
    if not p.healthy:
        if waiting:
            return f"has no store session: the recovery of a new one waits: {waiting}"
        return "has no store session (a new one is starting)"
    assert isinstance(store, ReplicatedStore) and store.session is not None  # built by _open_partition; healthy
    session = store.session
    up = len(reachable.intersection(session.assigned))
    if up < session.quorum:
        return f"reaches {up} of its {len(session.assigned)} storage replicas; a commit needs {session.quorum}"
    return None


async def run_server(config: ServerProcessConfig, stop: asyncio.Event, runtime: Runtime, *,
                     announce: bool = True) -> None:
    """Run a server with ``runtime`` (the process's) until ``stop`` is set (the CLI sets it on
    SIGINT/SIGTERM).

    With ``announce`` it prints one ready line on stdout once it listens and is a cluster member,
    as the storage node does: ``waltz server ready address=... id=... http=... partitions=N
    event_loop=uvloop|asyncio``
    (scripts and service managers wait for it).
    """
    server = WaltzServer(config, runtime)
    await server.start()
    if announce:
        print(f"waltz server ready address={server.address} id={server.cluster.server_id} http={server.http_address} "
              f"partitions={server.num_partitions} event_loop={loop_name()}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()

