"""Offline recovery (`waltz storage recover-partition`) and `waltz storage validate`.

On a real cluster of processes, each kind of damage is done to a stopped storage node - its disk
replaced (directory gone), both control structs of a partition, the control file header, a
record in the middle of a segment - then the node is rebuilt from a healthy replica, started
again, and must carry the cluster: the healthy source is stopped, so every acknowledged write
must be read back through the rebuilt node and the third one. The safety rule - never recover
from a replica that holds less than another - is checked on nodes in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.protocol.wire import Record, ReqId
from waltz_core.storage.format import HEADER_SIZE, partition_entry_offset
from waltz_core.storage.recovery import PartitionRebuild, RecoveryRefused, compare_partition, recover_partition
from waltz_core.storage.segmented import SegmentedLayout
from waltz_core.testing.cluster import ClusterSpec, ProcessCluster
from waltz_core.testing.probe import PartitionProbe

from .conftest import NodeHarness, make_records

WALTZ = [sys.executable, "-m", "waltz_core.cli"]


def waltz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WALTZ, *args], capture_output=True, text=True, timeout=120)


def damage(directory: Path, kind: str) -> None:
    """Do one kind of damage to a stopped node's directory."""
    control = directory / "waltz-storage.ctl"
    if kind == "disk replaced":
        import shutil

        shutil.rmtree(directory)
    elif kind == "both control structs":
        with open(control, "r+b") as fh:  # partition 0's two structs, after its 4-byte id
            fh.seek(partition_entry_offset(0) + 4)
            fh.write(os.urandom(72))
    elif kind == "control header":
        with open(control, "r+b") as fh:
            fh.seek(8)
            fh.write(os.urandom(32))
    elif kind == "segment record":
        segment = sorted((directory / "0").glob("*.seq"))[0]
        size = segment.stat().st_size
        with open(segment, "r+b") as fh:  # garble a quarter in: a committed record fails its checksum
            fh.seek(HEADER_SIZE + (size - HEADER_SIZE) // 4)
            fh.write(b"\xff" * 16)
    else:
        raise AssertionError(kind)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["disk replaced", "both control structs", "control header", "segment record"])
async def test_recover_a_damaged_node_from_a_replica_and_lose_no_acknowledged_write(tmp_path: Path, kind: str) -> None:
    coordination = CoordinationConfig(name="local", connect=str(tmp_path / "coord"), root="/waltz", session_timeout=3.0)
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=2, num_storages=3, num_servers=1, coordination=coordination)
    cluster = ProcessCluster(spec)
    await cluster.start()
    try:
        acked: dict[int, dict[bytes, int]] = {0: {}, 1: {}}
        for half in (0, 1):
            for pid in (0, 1):
                async with PartitionProbe(spec.transport_config, spec.coordination, pid,
                                          registries=spec.runtime.registries) as probe:
                    acked[pid].update(await probe.write([f"{kind}-{pid}-{i}".encode() * 4
                                                         for i in range(150 * half, 150 * half + 150)]))
            if half == 0:  # a new store session: every replica's low-water mark becomes 149
                cluster.kill_server(0)
                cluster.start_server(0)
        cluster.kill_storage(1, 15)  # stopped cleanly; the damage is done to its files
        directory = Path(spec.storage_config(1).storage.directory)
        damage(directory, kind)
        source = spec.admin_address(0)
        result = await asyncio.to_thread(waltz, "storage", "recover-partition", "-c", str(spec.storages[1].config_file),
                                         "-p", "0-1", "--from", source, "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        by_pid = {r["partition_id"]: r for r in report["partitions"]}
        assert by_pid[0]["max_transaction_id"] == 299 and by_pid[1]["max_transaction_id"] == 299
        if kind == "disk replaced":
            assert by_pid[0]["copied"] == 300 and report["report"] is None  # nothing to move aside
        else:
            aside = Path(report["report"]).parent
            assert aside.parent == directory and any(aside.iterdir())  # damaged files kept, not deleted
        if kind == "segment record":
            # partition 0 keeps its intact prefix (a copy of the damaged files goes aside); partition 1
            # keeps its whole committed prefix
            assert 0 <= by_pid[0]["kept"] < 149 and by_pid[0]["copied"] == 299 - by_pid[0]["kept"]
            assert by_pid[0]["quarantined"] and "is damaged" in by_pid[0]["why"]
            assert (by_pid[1]["kept"], by_pid[1]["copied"], by_pid[1]["quarantined"]) == (149, 150, [])
        await cluster.start_storage(1)
        # The rebuilt node holds what the source holds, record for record.
        key, n = await spec.store_params()
        check = await asyncio.to_thread(waltz, "storage", "validate", "-a", spec.admin_address(1), "--against",
                                        source, "--cluster-key", str(key), "--num-partitions", str(n), "-p", "0-1")
        assert check.returncode == 0, check.stdout + check.stderr
        assert check.stdout.count(": ok: identical") == 2, check.stdout
        # Now the source goes, and the server restarts (no cache): the rebuilt node and the third
        # one must recover the partitions together and serve every acknowledged write.
        cluster.kill_storage(0)
        cluster.kill_server(0)
        cluster.start_server(0)
        cfg = spec.client_config()
        import attrs

        from waltz_core.client import AsyncWaltzClient, WaltzClientCallbacks

        async with AsyncWaltzClient(WaltzClientCallbacks(), attrs.evolve(
                cfg, client=attrs.evolve(cfg.client, auto_mount=False, rpc_timeout=60.0))) as client:
            for pid in (0, 1):
                data = await client.fetch_data_range(pid, 0, 300)
                for payload, txn in acked[pid].items():
                    assert data[txn] == payload, f"partition {pid}: acknowledged transaction {txn} lost"
        for pid in (0, 1):
            async with PartitionProbe(spec.transport_config, spec.coordination, pid,
                                      registries=spec.runtime.registries) as probe:
                more = await probe.write([f"after-{pid}-{i}".encode() for i in range(20)], timeout=120)
                assert sorted(more.values()) == list(range(300, 320))  # dense after the 300 acknowledged
    finally:
        cluster.stop()


async def test_validate_and_recover_refuse_a_source_that_holds_less(tmp_path: Path) -> None:
    key = uuid.uuid4()
    nodes = {name: NodeHarness(tmp_path / name, key) for name in ("a", "c")}
    for h in nodes.values():
        await h.start()
    try:
        for name, count in (("a", 10), ("c", 13)):
            admin = await nodes[name].admin()
            await admin.set_assignment([0], True)
            client = await nodes[name].client()
            await client.append(1, 0, make_records(0, count))
        a, c = await nodes["a"].admin(), await nodes["c"].admin()
        comparison = await compare_partition(a, c, 0)
        assert comparison.ok and (comparison.local_max, comparison.replica_max) == (9, 12)
        layout = SegmentedLayout(tmp_path / "b")
        rebuild = PartitionRebuild(layout, key, 4, tmp_path / "b" / "aside")
        rebuild.open()
        try:
            with pytest.raises(RecoveryRefused, match=r"replica .* holds transaction 10, the source .* holds up to 9"):
                await recover_partition(rebuild, 0, a, [c], [])
            with pytest.raises(RecoveryRefused, match="did not answer"):
                await recover_partition(rebuild, 0, a, [], ["c:1"])
            assert layout.open_partition(0).max_transaction_id == -1  # refused: nothing written
            done = await recover_partition(rebuild, 0, c, [a], [])
            assert (done.copied, done.max_transaction_id) == (13, 12)
            store = layout.open_partition(0)
            assert (await compare_partition(store, c, 0)).ok
            # A record that differs is found.
            client = await nodes["a"].client()
            await client.truncate(1, 0, 4)
            await client.append(1, 0, [Record(5, ReqId(7, 1, 0, 5), 99, b"x", zlib.crc32(b"x"))])
            diff = await compare_partition(store, a, 0)
            assert not diff.ok and diff.mismatch == 5
            store.close()
        finally:
            layout.close()
    finally:
        for h in nodes.values():
            await h.stop()
