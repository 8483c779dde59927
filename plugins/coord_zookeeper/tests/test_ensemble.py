"""A 3-node ZooKeeper ensemble: the leader is SIGKILLed in the middle of recipe operations.

Partition metadata CAS updates and the cluster manager must keep working once a new leader is
elected, and every committed update must survive (the final generation equals the number of
CAS updates that reported success).
"""

from __future__ import annotations

import asyncio
import time

import attrs
import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.coordination import open_coordination, recipes
from waltz_core.coordination.base import CoordinationBackend, SessionState
from waltz_core.errors import CasConflictError, CoordinationError
from waltz_core.testing.conformance.coordination import eventually
from waltz_core.testing.servers import ZooKeeperServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


async def cas_until(store: recipes.StoreMetadata, partition: int, stop: asyncio.Event, done: list[int]) -> None:
    """Bump the generation of ``partition`` by CAS until ``stop``; record each committed generation."""
    while not stop.is_set():
        try:
            meta, version = await store.get_partition_metadata(partition)
            new = attrs.evolve(meta, generation=meta.generation + 1)
            await store.cas_partition_metadata(partition, new, version)
            done.append(new.generation)
        except (CasConflictError, CoordinationError):
            await asyncio.sleep(0.05)  # a lost race or the ensemble electing: re-read and retry


async def test_leader_kill_during_recipe_operations(zk_ensemble: ZooKeeperServer) -> None:
    config = CoordinationConfig(name="zookeeper", connect=zk_ensemble.connect_string, session_timeout=6.0)
    backends: list[CoordinationBackend] = []

    async def make() -> CoordinationBackend:
        backend = open_coordination(config)
        await backend.start()
        backends.append(backend)
        return backend

    admin, writer, server_a, server_b = [await make() for _ in range(4)]
    states: list[SessionState] = []
    writer.add_session_listener(states.append)
    root = "/waltz-failover"
    await recipes.create_cluster(admin, root, "failover", 4)
    got_a: list[recipes.ServerAssignment] = []
    got_b: list[recipes.ServerAssignment] = []
    manager_a = recipes.ClusterManager(server_a, root, recipes.ServerDescriptor(host="127.0.0.1", port=5001),
                                       on_assignment=got_a.append)
    manager_b = recipes.ClusterManager(server_b, root, recipes.ServerDescriptor(host="127.0.0.1", port=5002),
                                       on_assignment=got_b.append)
    stop, committed = asyncio.Event(), []
    killed: int | None = None
    store = recipes.StoreMetadata(writer, root)
    try:
        await manager_a.start()
        await eventually(lambda: bool(got_a) and len(got_a[-1].partitions) == 4, 20, "server A owns all partitions")
        cas = asyncio.create_task(cas_until(store, 0, stop, committed))
        await eventually(lambda: len(committed) >= 20, 20, "20 CAS updates before the kill")

        killed = zk_ensemble.leader()
        await asyncio.to_thread(zk_ensemble.kill, killed)
        killed_at, before_kill = time.monotonic(), len(committed)
        await eventually(lambda: len(committed) > before_kill, 30, "a CAS update after the leader kill")
        recovery = time.monotonic() - killed_at
        assert await asyncio.to_thread(zk_ensemble.leader) != killed
        await eventually(lambda: len(committed) >= before_kill + 20, 30, "20 CAS updates after the new leader")
        print(f"\nzookeeper leader kill: first CAS commit {recovery * 1000:.0f} ms after SIGKILL")
        await manager_b.start()  # membership change under the new leader: the coordinator rebalances
        await eventually(lambda: bool(got_b) and len(got_b[-1].partitions) == 2 and len(got_a[-1].partitions) == 2,
                         30, "two servers share the partitions after the failover")
        stop.set()
        await cas
        # Nothing committed is lost: a fresh client reads exactly the last committed generation.
        reader = await make()
        final, _ = await recipes.StoreMetadata(reader, root).get_partition_metadata(0)
        assert committed == list(range(0, len(committed)))  # EMPTY is generation -1: 0, 1, 2, ...
        assert final.generation == committed[-1]
        moved = set(got_b[-1].partitions)
        assert all(got_b[-1].partitions[p] == got_a[0].partitions[p] + 1 for p in moved)
        assert writer.session_state is SessionState.CONNECTED and SessionState.LOST not in states
    finally:
        stop.set()
        await manager_a.close()
        await manager_b.close()
        for backend in backends:
            await backend.close()
