"""Moving a replica of a running partition to another storage node, as an operator does it.

``waltz cluster assign-partition`` on the new node and ``waltz storage sync-partitions`` give it
the partition; the server's watch on the replica assignment rolls the partition over to a session
that takes the new replica in and catches it up, at once, under load or not (the original Waltz's
``onReplicaAssignmentsUpdate``). ``unassign-partition`` on the old node then takes that one out
the same way. Nothing is lost or duplicated, and the new replica's committed prefix is
byte-identical to the others'.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.testing.cluster import ClusterSpec, ProcessCluster, wait_replica_holds
from waltz_core.testing.probe import PartitionProbe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def waltz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "waltz_core.cli", *args], capture_output=True, text=True, timeout=120)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("coordination", ["local", "zookeeper"])
async def test_a_replica_moves_to_another_storage_node_while_the_partition_runs(
        coordination: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    config = None
    if coordination == "zookeeper":  # a real ZooKeeper's watch on the replica assignment
        zk = request.getfixturevalue("zookeeper_server")
        config = CoordinationConfig(name="zookeeper", connect=zk.connect_string, root=f"/waltz-{uuid.uuid4().hex[:8]}",
                                    session_timeout=4.0)
    spec = ClusterSpec(tmp_path, num_partitions=1, num_storages=4, num_servers=1, transport="tcp", coordination=config,
                       http=True)
    spec.write_configs()
    await spec.bootstrap()
    cli = str(tmp_path / "cli.toml")  # the operator's CLI config: the client's without its [client] table
    Path(cli).write_text((tmp_path / "client.toml").read_text().replace("[client]\n", ""))
    old, new = spec.storages[0].address, spec.storages[3].address
    _ok(waltz("cluster", "unassign-partition", "-p", "0", "-s", new, "-c", cli))  # storage-3 starts empty
    cluster = ProcessCluster(spec)
    await cluster.start()
    try:
        async with PartitionProbe(spec.transport_config, spec.coordination, 0,
                                  registries=spec.runtime.registries) as probe:
            committed = await probe.write([f"a-{i}".encode() for i in range(100)])
            # The new node gets the partition: in coordination, then on the node itself.
            _ok(waltz("cluster", "assign-partition", "-p", "0", "-s", new, "-c", cli))
            _ok(waltz("storage", "sync-partitions", "-c", cli))
            committed.update(await probe.write([f"b-{i}".encode() for i in range(50)]))
            key, n = await spec.store_params()
            # Caught up from transaction 0, without a failure or the checkpoint interval (250,000).
            await wait_replica_holds(spec, 3, key, n, probe.high_water_mark, timeout=30)
            # The old node gives it up.
            _ok(waltz("cluster", "unassign-partition", "-p", "0", "-s", old, "-c", cli))
            _ok(waltz("storage", "sync-partitions", "-c", cli))
            committed.update(await probe.write([f"c-{i}".encode() for i in range(50)]))
            final = probe.high_water_mark
            assert final == 199 and sorted(committed.values()) == list(range(200)), "each payload exactly once"
            await wait_replica_holds(spec, 3, key, n, final, timeout=30)
        verify = waltz("cluster", "verify", "-c", cli)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        server_log = (cluster.log_dir / "server-0.log").read_text()
        assert server_log.count("rolling over to a new session") >= 2, server_log[-3000:]
        # The old node is shut down, as a decommissioned one is: the server forgets it instead of
        # trying it (and showing it unreachable, its alert firing) for as long as it runs.
        cluster.kill_storage(0, signal.SIGTERM)
        metrics_url = f"http://127.0.0.1:{spec.servers[0].http_port}/metrics"
        gauge = f'waltz_server_storage_reachable{{storage="{old}"}}'
        deadline = time.monotonic() + 20
        while gauge in (page := _get(metrics_url)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert gauge not in page and 'waltz_server_storage_reachable{storage="' in page, page
        await asyncio.sleep(3)  # a reconnect loop would have tried it several times by now
        server_log = (cluster.log_dir / "server-0.log").read_text()
        assert f"storage {old} is not in the replica assignment any more: not trying it again" in server_log
        assert server_log.count(f"storage {old} unreachable") <= 1, server_log[-3000:]
        assert gauge not in _get(metrics_url)
    finally:
        cluster.stop()
    replicas = [[repr((r.transaction_id, r.req_id, r.header, r.data, r.checksum)).encode()
                 for r in spec.read_replica(i, key, n, [0])[0]] for i in range(4)]
    assert [len(r) for r in replicas[1:]] == [final + 1] * 3, [len(r) for r in replicas]
    assert replicas[1] == replicas[2] == replicas[3], "the moved replica is byte-identical to the others"
    assert len(replicas[0]) < final + 1  # the old replica got nothing after it left


async def test_a_replica_moved_away_while_down_and_back_later_keeps_no_dirty_transactions(tmp_path: Path) -> None:
    """Partition 0 has 4 replicas (storages 0-3; storage 4 is spare). Storage 0 alone writes
    appends that never reach a quorum (1-3 are stopped), then the server and storages 0-3 die.
    The operator moves the replica of storage 0, which is down, to storage 4 (3 of 4 stay: no
    --force needed), and the log goes on: the same transaction ids now hold other transactions.
    When storage 0 is back and assigned the partition again, its dirty records must go: it is
    caught up to a log identical to the other replicas'.

    Storage 3 is stopped too so that no replica that stays holds the dirty appends: one that did
    could hand them to the others during the recovery (they were never acknowledged, so committing
    them is allowed), and whether it did would depend on which replica answered first."""
    spec = ClusterSpec(tmp_path, num_partitions=1, num_storages=5, num_servers=1, transport="tcp")
    spec.write_configs()
    await spec.bootstrap()
    cli = str(tmp_path / "cli.toml")
    Path(cli).write_text((tmp_path / "client.toml").read_text().replace("[client]\n", ""))
    down, spare = spec.storages[0].address, spec.storages[4].address
    _ok(waltz("cluster", "unassign-partition", "-p", "0", "-s", spare, "-c", cli))
    cluster = ProcessCluster(spec)
    await cluster.start()
    try:
        key, n = await spec.store_params()
        async with PartitionProbe(spec.transport_config, spec.coordination, 0,
                                  registries=spec.runtime.registries) as probe:
            first = await probe.write([f"a-{i}".encode() for i in range(20)])
            assert sorted(first.values()) == list(range(20))
            for i in (1, 2, 3):  # the quorum is 3 of 4: what 0 writes from now on stays uncommitted
                cluster.storages[i].send_signal(signal.SIGSTOP)
            dirty = asyncio.create_task(probe.write([f"dirty-{i}".encode() for i in range(10)], timeout=60))
            await wait_replica_holds(spec, 0, key, n, 29, timeout=30)
            dirty.cancel()
            await asyncio.gather(dirty, return_exceptions=True)
        cluster.kill_server(0)
        for i in (0, 1, 2, 3):  # the stopped ones never read the appends waiting in their sockets
            cluster.kill_storage(i)
        # Storage 0 stays down; its replica moves to storage 4.
        _ok(waltz("cluster", "assign-partition", "-p", "0", "-s", spare, "-c", cli))
        _ok(waltz("cluster", "unassign-partition", "-p", "0", "-s", down, "-c", cli))
        for i in (1, 2, 3):
            await cluster.start_storage(i)
        await spec.assign_on_storage(4)  # storage 4 ran all along
        cluster.start_server(0)
        async with PartitionProbe(spec.transport_config, spec.coordination, 0, client_id=9_001,
                                  registries=spec.runtime.registries) as probe:
            later = await probe.write([f"b-{i}".encode() for i in range(30)])
            assert sorted(later.values()) == list(range(20, 50)), "the dirty appends were not committed"
            # Storage 0 comes back, and the operator gives it the partition again.
            await cluster.start_storage(0)
            _ok(waltz("cluster", "assign-partition", "-p", "0", "-s", down, "-c", cli))
            await spec.assign_on_storage(0)
            await wait_replica_holds(spec, 0, key, n, 49, timeout=60)
            more = await probe.write([f"c-{i}".encode() for i in range(10)])
            assert sorted(more.values()) == list(range(50, 60))
            await wait_replica_holds(spec, 0, key, n, 59, timeout=60)
    finally:
        cluster.stop()
    replicas = [[(r.transaction_id, r.req_id, r.data) for r in spec.read_replica(i, key, n, [0])[0]]
                for i in range(5)]
    assert [len(r) for r in replicas] == [60] * 5, [len(r) for r in replicas]
    assert not [r for r in replicas[0] if r[2].startswith(b"dirty-")], "storage 0 kept uncommitted appends"
    assert replicas[0] == replicas[1] == replicas[2] == replicas[3] == replicas[4]
