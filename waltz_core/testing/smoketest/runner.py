"""``waltz smoketest``: the original's chaos smoke test (waltz-original.md section 3.3), done better.

A real cluster of processes (3 storage nodes, 2-3 servers, coordination: ``local``, ``zookeeper``
or ``etcd``) with a :class:`~waltz_core.testing.faults.ThreadedFaultProxy` in front of every
storage node (servers reach storages only through it), 2+ clients x N partitions running bank
transfers (:mod:`.workload`) with a recorded history, and a nemesis:

* storage lane (one storage at a time, never more than a minority down): kill -9 and restart,
  SIGSTOP/SIGCONT, proxy cut (reset + refuse), proxy black hole one way, proxy delay;
* server lane (one server at a time): kill -9 and restart, SIGSTOP/SIGCONT;
* coordination lane (ZooKeeper/etcd started by the smoke test only): kill -9 and restart;
* replica lane (``moves``, one storage node more than each partition has replicas): a replica of
  a random partition moves to a node that has none, as an operator does it (assign the new one,
  then take out an old one, which may be down or cut off at that moment). Nodes that lost a
  replica get it back in later moves, with whatever their files still hold.

With ``hosts="netns"`` every process runs on a host of its own (a Linux network namespace with
its own address in 198.18.0.0/15, :class:`~waltz_core.testing.faults.netns.HostNetwork`; root
only), nothing goes through a proxy, and every lane gains ``isolate``: the host vanishes from
the network (packets dropped, no reset) for the fault's hold time and comes back.

At the end everything heals, a fresh client reads every partition from id 0, every replica
assigned then catches up to the committed high-water mark, the processes stop, each replica's files are read
offline, and :func:`waltz_core.testing.checker.check` gives the verdict.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import random
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from ...app.local_cluster import ClusterSpec, ProcessCluster
from ...config import CoordinationConfig
from ...coordination import open_coordination
from ...coordination.recipes import StoreMetadata
from ...errors import WaltzError
from ...storage.client import StorageAdminClient
from ...transport import open_transport
from ..checker import BankModel, LogEntry, Verdict, check
from ..faults import ClusterProcesses, ThreadedFaultProxy
from ..faults.netns import HostNetwork, netns_available
from ..history import OK, History, HistoryWriter, req_key
from .workload import PartitionWorker

log = logging.getLogger("waltz.smoketest")


@attrs.define
class SmokeOptions:
    """Sizes, duration and faults of one smoke test run."""

    directory: Path
    duration: float = 60.0
    #: keep the load and faults going past ``duration`` until this many faults were injected
    #: (fault count, not machine speed, is what a run must cover), at most ``2 * duration`` in all
    min_faults: int = 0
    clients: int = 2
    partitions: int = 3
    storages: int = 3
    servers: int = 2
    accounts: int = 1000  #: locks (accounts) per partition, from a pool of at most 1024
    initial_balance: int = 1000
    coordination: str = "local"  #: local | zookeeper | etcd
    connect: str | None = None  #: an external ZooKeeper/etcd (no coordination faults then)
    #: ``loopback``: every process on this host, storages behind fault proxies; ``netns``: every
    #: process on a host of its own (network namespaces, needs root), isolate faults
    hosts: str = "loopback"
    coordination_nodes: int = 1  #: members of the ZooKeeper/etcd ensemble the smoke test starts
    seed: int = 1
    nemesis: bool = True
    fault_hold: tuple[float, float] = (0.4, 1.5)  #: seconds a fault lasts
    fault_gap: tuple[float, float] = (0.1, 0.6)  #: seconds between faults of one lane
    coordination_faults: bool = True
    #: the replica lane: each partition on all storages but one, a replica moved every ``move_gap``
    moves: bool = False
    move_gap: tuple[float, float] = (1.0, 4.0)
    op_timeout: float = 4.0
    session_timeout: float = 3.0
    verify_timeout: float = 90.0


@attrs.define
class SmokeResult:
    verdict: Verdict
    history_path: Path
    faults: dict[str, int]
    transactions: int
    elapsed: float
    stalls: list[FaultStall]  #: per fault of the kinds that can stall commits

    def report(self) -> list[str]:
        lines = [f"elapsed: {self.elapsed:.1f} s", f"faults injected: {sum(self.faults.values())} {dict(self.faults)}",
                 f"transactions committed: {self.transactions}", f"history: {self.history_path}"]
        by_kind: dict[str, list[FaultStall]] = {}
        for stall in self.stalls:
            by_kind.setdefault(stall.kind, []).append(stall)
        for kind, stalls in sorted(by_kind.items()):
            worst = [st.worst for st in stalls if st.worst is not None]
            never = sum(1 for st in stalls if st.worst is None)
            line = f"commit stall after {kind}: n={len(stalls)}"
            if worst:
                line += f" worst partition p50={statistics.median(worst):.2f} s max={max(worst):.2f} s"
            if never:
                line += f", {never} with a partition that never committed again"
            lines.append(line)
        return lines + self.verdict.report()


def coordination_launcher(kind: str, directory: Path, nodes: int = 1, network: HostNetwork | None = None) -> Any:
    """Start a ZooKeeper/etcd ensemble of our own (its processes are fault-injectable); with a
    network, member ``i`` runs on host ``coordination-i``."""
    from ..servers import EtcdServer, ZooKeeperServer

    placement: dict[str, Any] = {}
    if network is not None:
        hosts = [network.add_host(f"coordination-{i}") for i in range(nodes)]
        placement = {"hosts": [h.address for h in hosts], "on_host": lambda i, argv: hosts[i].command(argv)}
    if kind == "zookeeper":
        return ZooKeeperServer(nodes, workdir=directory / "zookeeper", **placement).start()
    return EtcdServer(nodes, workdir=directory / "etcd", **placement).start()


class Nemesis:
    """Fault lanes run as asyncio tasks; blocking process work goes to worker threads."""

    def __init__(self, procs: ClusterProcesses, proxies: list[ThreadedFaultProxy], history: HistoryWriter,
                 opts: SmokeOptions) -> None:
        self.procs, self.proxies, self.history, self.opts = procs, proxies, history, opts
        self.rng = random.Random(opts.seed * 7919)
        self.counts: dict[str, int] = {}
        #: (fault, start, end) of the faults that can stall commits (kill, isolate)
        self.windows: list[tuple[str, float, float]] = []
        self.isolation = procs.network is not None

    def _start(self, fault: str, target: str) -> float:
        now = time.monotonic()
        self.counts[fault] = self.counts.get(fault, 0) + 1
        self.history.nemesis(fault, target, "start", now)
        return now

    async def _isolate(self, fault: str, name: str) -> None:
        """The host of ``name`` vanishes for the hold time, then comes back."""
        t = self._start(fault, name)
        await asyncio.to_thread(self.procs.isolate, name)
        await self._hold()
        await asyncio.to_thread(self.procs.reconnect, name)
        self.windows.append((fault, t, time.monotonic()))
        self.history.nemesis(fault, name, "end")

    async def _hold(self) -> None:
        await asyncio.sleep(self.rng.uniform(*self.opts.fault_hold))

    async def _gap(self) -> None:
        await asyncio.sleep(self.rng.uniform(*self.opts.fault_gap))

    async def storage_lane(self, stop: asyncio.Event) -> None:
        # Hosts of their own have no proxies in front of them: they vanish from the network instead.
        faults = ["kill", "pause", "isolate"] if self.isolation else ["kill", "pause", "cut", "blackhole-up", "delay"]
        while not stop.is_set():
            i = self.rng.randrange(self.opts.storages)
            name = f"storage-{i}"
            fault = self.rng.choice(faults)
            if fault == "isolate":
                await self._isolate("storage-isolate", name)
                await self._gap()
                continue
            t = self._start(f"storage-{fault}", name)
            if fault == "kill":
                await asyncio.to_thread(self.procs.kill, name)
                await self._hold()
                await asyncio.to_thread(self.procs.restart, name)
                self.windows.append(("storage-kill", t, time.monotonic()))
            elif fault == "pause":
                await asyncio.to_thread(self.procs.pause, name)
                await self._hold()
                await asyncio.to_thread(self.procs.resume, name)
            else:
                proxy = self.proxies[i]
                if fault == "cut":
                    proxy.cut()
                elif fault == "blackhole-up":
                    proxy.drop("up")
                else:
                    proxy.delay(self.rng.uniform(0.02, 0.2))
                await self._hold()
                proxy.heal()
                if fault == "blackhole-up":
                    proxy.reset()  # connections that lost bytes cannot resynchronise
            self.history.nemesis(f"storage-{fault}", name, "end")
            await self._gap()

    async def server_lane(self, stop: asyncio.Event) -> None:
        faults = ["kill", "pause", "isolate"] if self.isolation else ["kill", "pause"]
        while not stop.is_set():
            i = self.rng.randrange(self.opts.servers)
            name = f"server-{i}"
            fault = self.rng.choice(faults)
            if fault == "isolate":
                await self._isolate("server-isolate", name)
                await asyncio.sleep(self.rng.uniform(1.0, 2.0))
                continue
            t = self._start(f"server-{fault}", name)
            if fault == "kill":
                await asyncio.to_thread(self.procs.kill, name)
                await self._hold()
                await asyncio.to_thread(self.procs.restart, name)
                self.windows.append(("server-kill", t, time.monotonic()))
            else:
                await asyncio.to_thread(self.procs.pause, name)
                await self._hold()
                await asyncio.to_thread(self.procs.resume, name)
            self.history.nemesis(f"server-{fault}", name, "end")
            # Let the cluster settle: a failover takes about one coordination session timeout.
            await asyncio.sleep(self.rng.uniform(1.0, 2.0))

    async def coordination_lane(self, stop: asyncio.Event) -> None:
        faults = ["kill", "isolate"] if self.isolation else ["kill"]
        members = self.procs.names("coordination")
        while not stop.is_set():
            await asyncio.sleep(self.rng.uniform(4.0, 8.0))
            if stop.is_set():
                break
            name, fault = self.rng.choice(members), self.rng.choice(faults)
            if fault == "isolate":
                await self._isolate("coordination-isolate", name)
                continue
            t = self._start("coordination-kill", name)
            await asyncio.to_thread(self.procs.kill, name)
            await asyncio.sleep(self.rng.uniform(0.5, 1.5))
            await asyncio.to_thread(self.procs.restart, name)
            self.windows.append(("coordination-kill", t, time.monotonic()))
            self.history.nemesis("coordination-kill", name, "end")

    async def replica_lane(self, stop: asyncio.Event, spec: ClusterSpec, metadata: StoreMetadata) -> None:
        """Move a replica of a random partition to a node without one, one move at a time."""
        index = {node.address: i for i, node in enumerate(spec.storages)}
        while not stop.is_set():
            await asyncio.sleep(self.rng.uniform(*self.opts.move_gap))
            if stop.is_set():
                break
            partition = self.rng.randrange(self.opts.partitions)
            try:
                await self._move_a_replica(spec, metadata, partition, index)
            except WaltzError as exc:  # coordination cut off or restarting: the next move tries again
                log.info("replica lane: a move of partition %d stopped: %s", partition, exc)

    async def _move_a_replica(self, spec: ClusterSpec, metadata: StoreMetadata, partition: int,
                              index: dict[str, int]) -> None:
        assignment = await metadata.get_replica_assignments()
        holders = sorted(ep for ep, pids in assignment.items() if partition in pids)
        spares = sorted(ep for ep, pids in assignment.items() if partition not in pids)
        self._start("replica-move", f"partition-{partition}")
        try:
            if spares:  # else an earlier move's old replica is still there: take it out now
                target = self.rng.choice(spares)
                await metadata.assign_partitions(target, [partition])
                try:  # the node may be down or cut off: it is told when it restarts, or by a later move
                    await spec.assign_on_storage(index[target], timeout=3.0)
                except Exception as exc:  # noqa: BLE001 - any failure to reach it is the fault's business
                    log.info("replica lane: storage %s not told of partition %d yet: %s", target, partition, exc)
                await asyncio.sleep(self.rng.uniform(0.0, 3.0))  # sometimes before it caught up
            # Never below a majority here (N-1 replicas of N nodes, one more while a move is half done).
            await metadata.unassign_partitions(self.rng.choice(holders), [partition], keep_majority=True)
        finally:
            self.history.nemesis("replica-move", f"partition-{partition}", "end")

    async def heal(self) -> None:
        for proxy in self.proxies:
            proxy.heal()
        await asyncio.to_thread(self.procs.heal)


@attrs.frozen
class FaultStall:
    """How long each partition went without an acknowledged commit around one fault."""

    kind: str
    start: float
    end: float
    #: partition -> the longest time without an acknowledged commit from the fault's start until
    #: its first commit after the fault ended; None: it never committed again
    per_partition: dict[int, float | None]

    @property
    def worst(self) -> float | None:
        values = list(self.per_partition.values())
        return None if not values or None in values else max(v for v in values if v is not None)


def commit_stalls(history: History, windows: list[tuple[str, float, float]]) -> list[FaultStall]:
    """Per fault window, per partition: the longest gap between acknowledged commits, counted
    from the fault's start through the partition's first commit after the fault ended (so a stall
    that began during the fault and outlasted it is measured whole)."""
    acks: dict[int, list[float]] = {}
    for op in history.operations:
        if op.outcome == OK and op.complete_time is not None:
            acks.setdefault(op.partition, []).append(op.complete_time)
    for times in acks.values():
        times.sort()
    out = []
    for kind, start, end in windows:
        per: dict[int, float | None] = {}
        for partition, times in sorted(acks.items()):
            first = bisect.bisect_right(times, start)
            last = bisect.bisect_right(times, end)
            if last >= len(times):
                per[partition] = None  # no commit after the fault ended
                continue
            points = [start, *times[first:last + 1]]
            per[partition] = max(b - a for a, b in itertools.pairwise(points))
        out.append(FaultStall(kind, start, end, per))
    return out


async def wait_replicas_hold(spec: ClusterSpec, key: uuid.UUID, n: int, hwms: dict[int, int],
                             assigned: dict[int, set[int]], timeout: float) -> None:
    """Poll every storage's admin port until it holds the committed high-water mark of each
    partition ``assigned`` to it (storage index -> partitions)."""
    transport = open_transport(spec.transport_config, spec.runtime.registries)
    try:
        deadline = time.monotonic() + timeout
        for i in range(spec.num_storages):
            admin = None
            while admin is None:
                try:
                    admin = await StorageAdminClient.connect(transport, spec.admin_address(i), key, n)
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            try:
                for p, hwm in hwms.items():
                    if p not in assigned.get(i, set()):
                        continue
                    while hwm >= 0 and not await admin.record_list(p, hwm, 1):
                        if time.monotonic() > deadline:
                            log.warning("storage-%d did not catch up partition %d to %d", i, p, hwm)
                            break
                        await asyncio.sleep(0.2)
            finally:
                await admin.close()
    finally:
        await transport.aclose()


async def _spread_replicas(spec: ClusterSpec) -> None:
    """Create the cluster with each partition on every storage node but one (partition ``p`` not
    on node ``p mod N``), so the replica lane always has a node to move a replica to."""
    assert spec.coordination is not None
    await spec.bootstrap()
    backend = open_coordination(spec.coordination, spec.runtime.registries)
    await backend.start()
    try:
        metadata = StoreMetadata(backend, spec.coordination.root)
        for p in range(spec.num_partitions):
            await metadata.unassign_partitions(spec.storages[p % spec.num_storages].address, [p])
    finally:
        await backend.close()


ProgressHook = Callable[[float, dict[str, Any]], None]


async def run_smoketest(opts: SmokeOptions, progress: ProgressHook | None = None,
                        cluster_hook: Callable[[ClusterProcesses, list[ThreadedFaultProxy], HistoryWriter], Any]
                        | None = None) -> SmokeResult:
    """Run one smoke test (blocking processes are started and stopped here; nothing is left running).

    ``cluster_hook`` (tests) replaces the nemesis: an async callable given the process control,
    the proxies and the history, run while the clients work; it may return the windows of its
    faults as ``(fault, start, end)`` (``time.monotonic()``) to have their commit stalls measured.
    """
    began = time.monotonic()
    if opts.hosts not in ("loopback", "netns"):
        raise ValueError(f"hosts must be loopback or netns, not {opts.hosts!r}")
    if opts.hosts == "netns" and not netns_available():
        raise PermissionError("hosts=netns needs root and iproute2's `ip` (network namespaces)")
    directory = Path(opts.directory)
    directory.mkdir(parents=True, exist_ok=True)
    launcher = None
    network: HostNetwork | None = None
    proxies: list[ThreadedFaultProxy] = []
    cluster: ProcessCluster | None = None
    history = HistoryWriter(directory / "history.jsonl")
    try:
        if opts.hosts == "netns":
            network = HostNetwork()
            for kind, count in (("storage", opts.storages), ("server", opts.servers)):
                for i in range(count):
                    network.add_host(f"{kind}-{i}")
        if opts.coordination == "local":
            coordination = CoordinationConfig(name="local", connect=str(directory / "coord"), root="/waltz",
                                              session_timeout=opts.session_timeout)
        else:
            connect = opts.connect
            if connect is None:
                launcher = await asyncio.to_thread(coordination_launcher, opts.coordination, directory,
                                                   opts.coordination_nodes, network)
                connect = launcher.connect_string if opts.coordination == "zookeeper" else launcher.endpoints
            coordination = CoordinationConfig(name=opts.coordination, connect=connect,
                                              root=f"/waltz-smoke-{uuid.uuid4().hex[:8]}",
                                              session_timeout=max(opts.session_timeout, 4.0))
        node_hosts = {name: h.address for name, h in network.hosts.items()} if network is not None else {}
        # Hosts of their own are not loopback: the test cluster runs in plaintext on purpose.
        spec = ClusterSpec(directory / "cluster", num_partitions=opts.partitions, num_storages=opts.storages,
                           num_servers=opts.servers, coordination=coordination, node_hosts=node_hosts,
                           insecure=network is not None)
        spec.write_configs()
        if network is None:
            # Servers reach every storage node through a fault proxy: its address is the one registered.
            for node in spec.storages:
                proxy = ThreadedFaultProxy(node.address).start()
                proxies.append(proxy)
                node.address = proxy.address
            cluster = ProcessCluster(spec)
        else:
            hosts = network.hosts
            cluster = ProcessCluster(spec, on_host=lambda name, argv: hosts[name].command(argv))
        if opts.moves:
            await _spread_replicas(spec)  # with the addresses registered: the proxies', on loopback
        await cluster.start()
        procs = ClusterProcesses(cluster, launcher, network)
        outcome = await _drive(opts, spec, procs, proxies, history, progress, cluster_hook)
        hwms = {p: len(entries) - 1 for p, entries in outcome["logs"].items()}
        assigned: dict[int, set[int]] = outcome["assigned"]
        key, n = await spec.store_params()
        await wait_replicas_hold(spec, key, n, hwms, assigned, timeout=60.0)
        cluster.stop()
        replicas: dict[int, dict[str, list[LogEntry]]] = {p: {} for p in range(opts.partitions)}
        for i in range(opts.storages):
            # A replica moved away keeps what it had (a dirty tail too): only assigned ones must agree.
            for p, records in spec.read_replica(i, key, n, sorted(assigned.get(i, set()))).items():
                replicas[p][f"storage-{i}"] = [LogEntry(r.transaction_id, req_key(r.req_id), r.header, bytes(r.data))
                                               for r in records]
    finally:
        if cluster is not None:
            cluster.stop()
        for proxy in proxies:
            proxy.close()
        if launcher is not None:
            await asyncio.to_thread(launcher.stop)
        if network is not None:
            network.close()
        history.close()
    parsed = History.load(history.path)
    verdict = check(parsed, outcome["logs"], replicas, BankModel(opts.accounts, opts.initial_balance))
    transactions = sum(len(v) for v in outcome["logs"].values())
    return SmokeResult(verdict, history.path, outcome["faults"], transactions, time.monotonic() - began,
                       commit_stalls(parsed, outcome["windows"]))


async def _drive(opts: SmokeOptions, spec: ClusterSpec, procs: ClusterProcesses, proxies: list[ThreadedFaultProxy],
                 history: HistoryWriter, progress: ProgressHook | None, cluster_hook: Any) -> dict[str, Any]:
    assert spec.coordination is not None
    transport = open_transport(spec.transport_config, spec.runtime.registries)
    backend = open_coordination(spec.coordination, spec.runtime.registries)
    await backend.start()
    rng = random.Random(opts.seed)
    ops = itertools.count(1)
    counts = {"ok": 0, "fail": 0, "unknown": 0}
    nemesis = Nemesis(procs, proxies, history, opts)
    try:
        workers = [PartitionWorker(c + 1, p, transport, backend, spec.coordination.root, history,
                                   accounts=opts.accounts, initial=opts.initial_balance,
                                   rng=random.Random(rng.random()), op_timeout=opts.op_timeout, ops=ops)
                   for c in range(opts.clients) for p in range(opts.partitions)]
        # Every partition mounted before the clock starts (server start and recovery are not faults).
        ready = await asyncio.gather(*(w.connect(time.monotonic() + 60) for w in workers))
        if not all(ready):
            raise TimeoutError("partitions did not become ready within 60 s:\n" + procs.cluster.logs())

        def count(outcome: str) -> None:
            counts[outcome] += 1

        stop = asyncio.Event()
        tasks = [asyncio.ensure_future(w.run(stop, count)) for w in workers]
        lanes: list[asyncio.Future[Any]] = []
        if cluster_hook is not None:
            lanes.append(asyncio.ensure_future(cluster_hook(procs, proxies, history)))
        elif opts.nemesis:
            lanes += [asyncio.ensure_future(nemesis.storage_lane(stop)),
                      asyncio.ensure_future(nemesis.server_lane(stop))]
            if procs.coordination is not None and opts.coordination_faults:
                lanes.append(asyncio.ensure_future(nemesis.coordination_lane(stop)))
            if opts.moves:
                metadata = StoreMetadata(backend, spec.coordination.root)
                lanes.append(asyncio.ensure_future(nemesis.replica_lane(stop, spec, metadata)))
        start = time.monotonic()

        def going_on() -> bool:
            if cluster_hook and lanes[0].done():
                return False
            elapsed = time.monotonic() - start
            if elapsed < opts.duration:
                return True
            return sum(nemesis.counts.values()) < opts.min_faults and elapsed < 2 * opts.duration

        while going_on():
            await asyncio.sleep(0.25)
            if progress is not None:
                progress(time.monotonic() - start, {**counts, "faults": sum(nemesis.counts.values()),
                                                    "down": sorted(procs.killed | procs.paused | procs.isolated)})
        stop.set()
        windows = list(nemesis.windows)
        for lane in lanes:
            with contextlib.suppress(asyncio.CancelledError):
                result = await lane
                if cluster_hook is not None and lane is lanes[0] and result:
                    windows += result  # the hook's own fault windows: (fault, start, end)
        await nemesis.heal()
        await asyncio.gather(*tasks)
        for w in workers:
            history.feed(w.client_id, w.partition, 0, [k for k, _ in w.feed])
        # Verify through a fresh client: the whole log of every partition from id 0.
        logs = {}
        for p in range(opts.partitions):
            reader = PartitionWorker(999, p, transport, backend, spec.coordination.root, None, accounts=opts.accounts,
                                     initial=opts.initial_balance, rng=random.Random(0))
            logs[p] = await reader.read_all(opts.verify_timeout)
        replica_assignments = await StoreMetadata(backend, spec.coordination.root).get_replica_assignments()
        index = {node.address: i for i, node in enumerate(spec.storages)}
        assigned = {index[ep]: set(pids) for ep, pids in replica_assignments.items() if ep in index}
        return {"logs": logs, "faults": dict(nemesis.counts), "windows": windows, "assigned": assigned}
    finally:
        await backend.close()
        await transport.aclose()
