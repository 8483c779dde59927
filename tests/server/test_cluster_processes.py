"""A real cluster of processes (3 storage nodes, servers, coordination) over TCP.

Each test runs ``waltz storage start`` / ``waltz server start`` subprocesses, kills them with
SIGKILL, and checks what the Waltz design promises: commits on 2 of 3, no committed transaction lost or
duplicated, stalls without a quorum, byte-identical replicas after catch-up, server failover.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.testing.cluster import ClusterSpec, ProcessCluster, wait_replica_holds
from waltz_core.testing.probe import PartitionProbe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def coordination_for(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> CoordinationConfig:
    if kind == "local":
        return CoordinationConfig(name="local", connect=str(tmp_path / "coord"), root="/waltz", session_timeout=3.0)
    zk = request.getfixturevalue("zookeeper_server")
    return CoordinationConfig(name="zookeeper", connect=zk.connect_string, root=f"/waltz-{uuid.uuid4().hex[:8]}",
                              session_timeout=4.0)


def payloads(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() * 8 for i in range(n)]


def check_exactly_once(probe: PartitionProbe, committed: dict[bytes, int]) -> None:
    ids = [t for t, _, _ in probe.feed]
    assert ids == list(range(len(ids))), "the feed must be gap-free from 0"
    assert len(set(committed.values())) == len(committed), "one transaction per payload"
    reqs = [q for _, q, _ in probe.feed]
    assert len(set(reqs)) == len(reqs), "no request committed twice"


@pytest.mark.parametrize("coordination", ["local", "zookeeper"])
async def test_storage_kill_quorum_stall_resume_and_catch_up(coordination: str, tmp_path: Path,
                                                              request: pytest.FixtureRequest) -> None:
    spec = ClusterSpec(tmp_path, num_partitions=1, num_storages=3, num_servers=1, transport="tcp",
                       coordination=coordination_for(coordination, tmp_path, request))
    cluster = ProcessCluster(spec)
    await cluster.start()
    try:
        async with PartitionProbe(spec.transport_config, spec.coordination, 0,
                                  registries=spec.runtime.registries) as probe:
            committed = await probe.write(payloads("a", 150))
            # One storage killed: appends continue on the remaining quorum of 2.
            cluster.kill_storage(2)
            committed.update(await probe.write(payloads("b", 150)))
            # Two killed: no quorum, appends stall (nothing commits) ...
            cluster.kill_storage(1)
            stalled_at = probe.high_water_mark
            with pytest.raises(TimeoutError):
                await probe.write(payloads("c", 20), timeout=4)
            assert probe.high_water_mark == stalled_at
            # ... and resume when one returns.
            await cluster.start_storage(1)
            committed.update(await probe.write(payloads("c", 20), timeout=90))
            # The third returns too and catches up inside a new session.
            await cluster.start_storage(2)
            committed.update(await probe.write(payloads("d", 100), timeout=90))
            final = probe.high_water_mark
            check_exactly_once(probe, committed)
            assert set(committed) == set(payloads("a", 150) + payloads("b", 150) + payloads("c", 20) + payloads("d", 100))
            key, n = await spec.store_params()
            await wait_replica_holds(spec, 2, key, n, final)
    finally:
        cluster.stop()
    # Every record of each replica, read offline through its layout, as comparable tuples.
    replicas = [[repr((r.transaction_id, r.req_id, r.header, r.data, r.checksum)).encode()
                 for r in spec.read_replica(i, key, n, [0])[0]] for i in range(3)]
    prefix = [r[: final + 1] for r in replicas]
    assert all(len(p) == final + 1 for p in prefix), [len(r) for r in replicas]
    assert prefix[0] == prefix[1] == prefix[2], "committed prefixes must be byte-identical on every replica"


@pytest.mark.parametrize("coordination", ["local", "zookeeper"])
async def test_second_server_takes_over_without_loss_or_duplicates(coordination: str, tmp_path: Path,
                                                                   request: pytest.FixtureRequest) -> None:
    spec = ClusterSpec(tmp_path, num_partitions=2, num_storages=3, num_servers=2, transport="tcp",
                       coordination=coordination_for(coordination, tmp_path, request))
    cluster = ProcessCluster(spec)
    await cluster.start()
    try:
        async with PartitionProbe(spec.transport_config, spec.coordination, 0,
                                  registries=spec.runtime.registries) as probe:
            committed = await probe.write(payloads("x", 200))
            # Each server prints its ready line (stdout goes to its log), as the storage nodes do.
            for i, node in enumerate(spec.servers):
                log_path = cluster.log_dir / f"server-{i}.log"
                deadline = time.monotonic() + 60
                while f"waltz server ready address={node.address} id=" not in log_path.read_text():
                    assert time.monotonic() < deadline, log_path.read_text()[-2000:]
                    await asyncio.sleep(0.1)
            owner, _ = await probe._owner() or ("", 0)
            victim = next(i for i, node in enumerate(spec.servers) if node.address == owner)
            cluster.kill_server(victim)
            # The survivor takes the partition once the victim's coordination session expires.
            committed.update(await probe.write(payloads("y", 200), timeout=120))
            new_owner, _ = await probe._owner() or ("", 0)
            assert new_owner and new_owner != owner
            check_exactly_once(probe, committed)
            assert set(committed) == set(payloads("x", 200) + payloads("y", 200))
            assert probe.high_water_mark == 399
    finally:
        cluster.stop()
