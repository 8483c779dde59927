"""The end-to-end suite, once per matrix cell (see conftest.py): real subprocesses, real servers.

One test per cell keeps a cell on one xdist worker and pays for one cluster start; its phases
run in order on one ProcessCluster (3 storage nodes, 1 server, 2 partitions):

1. appends with locks: three clients increment shared counters under write locks; replaying the
   log must show every committed increment read the previous committed value (the lock model:
   a conflicting transaction never commits), with exactly one commit per submitted increment;
2. storage failover: one storage node is SIGKILLed, appends continue on the quorum of two; it
   is restarted and catches up to the final high-water mark (checked on its admin port);
3. client restart: a client closed in phase 1 restarts from its high-water mark and applies
   exactly the transactions written since, no gap and no duplicate;
4. feed catch-up: a consumer starting from nothing reads the whole log, in order;
5. secure cells only: a client without valid credentials is refused by the server.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from waltz_core.client import (
    AsyncWaltzClient,
    JsonSerializer,
    PartitionLocalLock,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_core.config import ClientProcessConfig, CoordinationConfig, TransportConfig
from waltz_core.coordination import open_coordination
from waltz_core.coordination.recipes import StoreMetadata
from waltz_core.errors import ConnectError, ConnectionClosedError, PeerTimeoutError
from waltz_core.plugins import Registries
from waltz_core.storage.client import StorageAdminClient
from waltz_core.testing.cluster import ClusterSpec, ProcessCluster
from waltz_core.transport import open_transport

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(240)]

JSON = JsonSerializer()
PARTITIONS = 2
WRITERS = 3
INCREMENTS_PER_WRITER = 20
FAILOVER_INCREMENTS = 16
log = logging.getLogger("waltz.tests.e2e")


class CounterApp(WaltzClientCallbacks):
    """An application whose 'database' is this object: counters, and its high-water marks."""

    def __init__(self, hwm: dict[int, int] | None = None, values: dict[str, int] | None = None) -> None:
        self.hwm: dict[int, int] = dict(hwm or {})
        self.values: dict[str, int] = dict(values or {})
        self.applied: dict[int, list[int]] = {p: [] for p in range(PARTITIONS)}
        self.records: dict[int, list[dict[str, Any]]] = {p: [] for p in range(PARTITIONS)}
        self.lock = threading.Lock()

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm.get(partition_id, -1)

    async def apply_transaction(self, txn: Any) -> None:
        data = await txn.fetch_data(JSON)
        with self.lock:
            self.values[data["key"]] = data["new"]
            self.hwm[txn.partition_id] = txn.transaction_id
            self.applied[txn.partition_id].append(txn.transaction_id)
            self.records[txn.partition_id].append(data)


class Increment(TransactionContext):
    """Add one to counter ``key`` of partition ``pid``, under a write lock on the key."""

    def __init__(self, app: CounterApp, key: str, pid: int) -> None:
        super().__init__()
        self.app, self.key, self.pid = app, key, pid
        self.executions = 0

    def partition_id(self, num_partitions: int) -> int:
        return self.pid % num_partitions

    def execute(self, builder: Any) -> bool:
        self.executions += 1
        with self.app.lock:
            old = self.app.values.get(self.key, 0)
        builder.set_transaction_data({"key": self.key, "old": old, "new": old + 1}, JSON)
        builder.set_write_locks([PartitionLocalLock("counter:" + self.key, 0)])
        return True


def check_lock_model(records: list[dict[str, Any]]) -> dict[str, int]:
    """Replay a partition's log: each increment must have read the previous committed value."""
    values: dict[str, int] = {}
    for i, data in enumerate(records):
        assert data["old"] == values.get(data["key"], 0), f"transaction {i} committed a stale read: {data}"
        values[data["key"]] = data["new"]
    return values


def client_config(spec: ClusterSpec, options: dict[str, Any]) -> ClientProcessConfig:
    """The cluster's client.toml, with the client's own credentials when the cell has them."""
    config = spec.client_config(long_wait_threshold=1.0, reconnect_delay=0.1, mount_timeout=60.0)
    if options:
        config = attrs.evolve(config, transport=attrs.evolve(config.transport, options={spec.transport: options}))
    return config


async def write(app: CounterApp, config: ClientProcessConfig, keys: list[str], n: int) -> list[Increment]:
    """One client submits ``n`` increments over ``keys`` (key i lives in partition i % PARTITIONS) and flushes."""
    contexts = [Increment(app, keys[i % len(keys)], i % PARTITIONS) for i in range(n)]
    async with AsyncWaltzClient(app, config) as client:
        for ctx in contexts:
            await client.submit(ctx)
        await client.flush()
    return contexts


async def cluster_key(coordination: CoordinationConfig, registries: Registries) -> tuple[Any, int]:
    backend = open_coordination(coordination, registries)
    await backend.start()
    try:
        params = await StoreMetadata(backend, coordination.root).get_store_params()
        return params.cluster_key, params.num_partitions
    finally:
        await backend.close()


async def wait_replica_holds(spec: ClusterSpec, i: int, high_water_marks: dict[int, int], timeout: float = 60.0) -> None:
    """Poll storage ``i``'s admin port until every partition holds its final transaction (caught up)."""
    assert spec.coordination is not None
    key, n = await cluster_key(spec.coordination, spec.runtime.registries)
    transport = open_transport(spec.transport_config, spec.runtime.registries)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                admin = await StorageAdminClient.connect(transport, spec.admin_address(i), key, n)
                break
            except (ConnectError, ConnectionClosedError, PeerTimeoutError):
                assert time.monotonic() < deadline, f"storage {i} admin port did not come back"
                await asyncio.sleep(0.1)
        try:
            for pid, hwm in high_water_marks.items():
                while not await admin.record_list(pid, hwm, 1):
                    assert time.monotonic() < deadline, f"storage {i} did not catch up to {hwm} on partition {pid}"
                    await asyncio.sleep(0.1)
        finally:
            await admin.close()
    finally:
        await transport.aclose()


async def assert_refused(transport_name: str, options: dict[str, Any], address: str, registries: Registries) -> None:
    """A transport with ``options`` (missing or wrong credentials) cannot exchange a frame with ``address``.

    The refusal comes from the handshake within milliseconds; the long connect timeout only keeps a
    loaded CI machine (the multi-host tests beside this one) from turning it into "no answer".
    """
    transport = open_transport(TransportConfig(name=transport_name, connect_timeout=20.0,
                                               options={transport_name: options}), registries)
    try:
        with pytest.raises((ConnectError, ConnectionClosedError)) as info:
            conn = await transport.connect(address)
            try:
                async with asyncio.timeout(10):
                    await conn.send(b"\x00" * 16)
                    await conn.recv()
            finally:
                await conn.close()
        message = str(info.value)
        assert any(word in message for word in ("TLS", "CURVE", "security")), message
    finally:
        await transport.aclose()


async def test_end_to_end(cell: Any, cell_coordination: CoordinationConfig, cell_security: Any,
                          tmp_path: Path) -> None:
    started = time.monotonic()
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=PARTITIONS, num_storages=3, num_servers=1,
                       transport=cell.transport, transport_options=cell_security.process_options,
                       coordination=cell_coordination)
    cluster = ProcessCluster(spec)
    await cluster.start()
    config = client_config(spec, cell_security.client_options)
    keys = ["k0", "k1", "k2", "k3"]  # k0, k2 -> partition 0; k1, k3 -> partition 1
    try:
        # 1. Appends with locks: writers run concurrently on the same counters.
        writers = [CounterApp() for _ in range(WRITERS)]
        clients = [AsyncWaltzClient(app, config) for app in writers]
        contexts = [[Increment(app, keys[i % len(keys)], i % PARTITIONS) for i in range(INCREMENTS_PER_WRITER)]
                    for app in writers]
        try:
            for client in clients:
                await client.start()

            async def produce(client: AsyncWaltzClient, batch: list[Increment]) -> None:
                for ctx in batch:
                    await client.submit(ctx)

            await asyncio.gather(*(produce(c, b) for c, b in zip(clients, contexts, strict=True)))
            for client in clients:
                await client.flush()
            per_partition = WRITERS * INCREMENTS_PER_WRITER // PARTITIONS
            for pid in range(PARTITIONS):  # exactly one commit per submitted increment
                assert await clients[0].high_water_mark(pid) == per_partition - 1
            for client in clients:  # every client has applied what the others committed too
                await client.flush()
        finally:
            for client in clients:
                await client.close()
        for app in writers:
            for pid in range(PARTITIONS):
                assert app.applied[pid] == list(range(per_partition)), f"partition {pid}: gap or duplicate"
                assert app.records[pid] == writers[0].records[pid]
                check_lock_model(app.records[pid])
        assert sum(writers[0].values.values()) == WRITERS * INCREMENTS_PER_WRITER
        retried = sum(ctx.executions - 1 for batch in contexts for ctx in batch)
        log.info("%s: %d re-executions after lock conflicts", cell.id, retried)  # shown with -s below
        snapshot = (dict(writers[0].hwm), dict(writers[0].values))  # writers[0] is closed: it restarts in 3.
        phase1 = time.monotonic()

        # 2. Storage failover: kill one storage node, appends continue on the other two.
        cluster.kill_storage(2)
        failover_app = CounterApp(*snapshot)
        await write(failover_app, config, keys, FAILOVER_INCREMENTS)
        # It comes back and catches up; appends go on meanwhile.
        await cluster.start_storage(2)
        await write(failover_app, config, keys, FAILOVER_INCREMENTS)
        final = {pid: failover_app.hwm[pid] for pid in range(PARTITIONS)}
        assert final == {pid: per_partition + FAILOVER_INCREMENTS - 1 for pid in range(PARTITIONS)}
        await wait_replica_holds(spec, 2, final)
        phase2 = time.monotonic()

        # 3. Client restart: resume from the high-water mark it had when it closed.
        restarted = CounterApp(*snapshot)
        async with AsyncWaltzClient(restarted, config) as client:
            await client.wait_mounted(30)
            await client.flush()
        for pid in range(PARTITIONS):
            assert restarted.applied[pid] == list(range(snapshot[0][pid] + 1, final[pid] + 1)), "gap or duplicate"
        assert restarted.values == failover_app.values

        # 4. Feed catch-up: a late consumer with an empty state reads everything.
        late = CounterApp()
        async with AsyncWaltzClient(late, config) as client:
            await client.wait_mounted(30)
            await client.flush()
        for pid in range(PARTITIONS):
            assert late.applied[pid] == list(range(final[pid] + 1))
            assert late.records[pid][:per_partition] == writers[0].records[pid]
            check_lock_model(late.records[pid])
        assert late.values == failover_app.values
        assert sum(late.values.values()) == WRITERS * INCREMENTS_PER_WRITER + 2 * FAILOVER_INCREMENTS

        # 5. Security cells: credentials that are missing or wrong are refused by the server.
        if cell_security.refused_options is not None:
            await assert_refused(cell.transport, cell_security.refused_options, spec.servers[0].address,
                                 spec.runtime.registries)
            await assert_refused(cell.transport, {}, spec.servers[0].address, spec.runtime.registries)
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()
    print(f"\ne2e cell {cell.id}: locks {phase1 - started:.1f}s, failover {phase2 - phase1:.1f}s, "
          f"total {time.monotonic() - started:.1f}s; {retried} lock-conflict re-executions")
