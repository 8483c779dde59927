"""A storage node whose disk fills up, on a real full filesystem (a tmpfs of a fixed size).

What an operator gets: the cluster goes on committing on the other two replicas; the full node
says why it cannot write (``/readyz`` answers 503 with the reason, the metrics show the free
bytes); once the space is freed and the node restarted, it replays its journal and catches up,
and its committed prefix is byte-identical to the others'. docs/operations.md, "A storage disk
is full", is the runbook this test follows.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from waltz_core.testing import require
from waltz_core.testing.cluster import ClusterSpec, ProcessCluster, wait_replica_holds
from waltz_core.testing.faults import small_filesystem, small_filesystems_available
from waltz_core.testing.probe import PartitionProbe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def _readyz(port: int) -> tuple[int, dict[str, Any]]:
    status, body = await asyncio.to_thread(_get, port, "/readyz")
    return status, json.loads(body)


async def _gauge(port: int, name: str) -> float:
    _, text = await asyncio.to_thread(_get, port, "/metrics")
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


async def test_a_storage_node_whose_disk_fills_says_so_and_catches_up_once_space_is_freed(tmp_path: Path) -> None:
    require(small_filesystems_available(), "root and mount (a tmpfs of a fixed size: a real full disk)")
    spec = ClusterSpec(tmp_path, num_partitions=1, num_storages=3, num_servers=1, transport="tcp", http=True)
    with small_filesystem(tmp_path / "storage-2", 16 << 20) as disk:
        cluster = ProcessCluster(spec)
        await cluster.start()
        try:
            port = spec.storages[2].http_port
            assert (await _readyz(port))[0] == 200
            async with PartitionProbe(spec.transport_config, spec.coordination, 0,
                                      registries=spec.runtime.registries) as probe:
                committed = await probe.write([f"a-{i}".encode() for i in range(50)])
                disk.fill(leave=256 * 1024)
                # About 1.6 MB of records: several times what is left on storage-2. The other
                # two replicas are a quorum, so every one of them commits.
                payloads = [f"b-{i}-".encode() + bytes(4000) for i in range(400)]
                committed.update(await probe.write(payloads, timeout=120))
                status, ready = await _readyz(port)
                assert status == 503 and any("No space left on device" in r for r in ready["reasons"]), ready
                free = await _gauge(port, "waltz_storage_filesystem_free_bytes")
                assert free < 256 * 1024, free
                before_restart = probe.high_water_mark
                # The full replica left the session and was kept out of the next ones: the
                # partition did not start a session per refusal (12 in this test before the hold).
                server_log = (cluster.log_dir / "server-0.log").read_text()
                assert server_log.count("refused writes; it is kept out of new sessions") >= 1, server_log[-3000:]
                assert len(re.findall(r"session \d+ open at high-water mark", server_log)) <= 4, server_log[-3000:]
                # The operator frees space and restarts the node (docs/operations.md).
                disk.free()
                cluster.kill_storage(2, signal.SIGTERM)
                await cluster.start_storage(2)
                committed.update(await probe.write([f"c-{i}".encode() for i in range(50)], timeout=120))
                final = probe.high_water_mark
                assert final == before_restart + 50 == len(committed) - 1
                assert sorted(committed.values()) == list(range(final + 1)), "each payload committed exactly once"
            key, n = await spec.store_params()
            await wait_replica_holds(spec, 2, key, n, final)
            deadline = asyncio.get_running_loop().time() + 30
            while (await _readyz(port))[0] != 200:
                assert asyncio.get_running_loop().time() < deadline, await _readyz(port)
                await asyncio.sleep(0.2)
        finally:
            cluster.stop()
        replicas = [[repr((r.transaction_id, r.req_id, r.header, r.data, r.checksum)).encode()
                     for r in spec.read_replica(i, key, n, [0])[0]][: final + 1] for i in range(3)]
    assert [len(r) for r in replicas] == [final + 1] * 3
    assert replicas[0] == replicas[1] == replicas[2], "committed prefixes must be byte-identical on every replica"
