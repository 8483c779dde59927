"""Fail-over when a host vanishes, with every process on a host of its own.

Each process runs in its own Linux network namespace with its own address in 198.18.0.0/15 (3
ZooKeeper members, 3 storage nodes, 2 servers; the test process is the client host), so nothing
may assume loopback. Under bank-transfer load on 64 partitions, one host at a time vanishes
from the network (its switch port goes down: packets are dropped, nobody gets a reset) and comes
back: a storage node, then a server, then the ZooKeeper leader.

Checked: the history (no lost acknowledged write, no duplicate, order and lock safety, every
replica identical) and availability - every partition commits again *while the host is still
gone* (a quorum of replicas, another server, a ZooKeeper majority remain). Printed: the
per-partition commit stall of each fault (the figures of docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from waltz_core.testing import require
from waltz_core.testing.faults import ClusterProcesses
from waltz_core.testing.faults.netns import netns_available
from waltz_core.testing.history import OK, History, HistoryWriter
from waltz_core.testing.servers import zookeeper_available
from waltz_core.testing.smoketest import SmokeOptions, run_smoketest

PARTITIONS = 64
HOLD = 20.0  #: seconds each host stays gone
SETTLE = 8.0  #: seconds between faults
#: every partition must commit in the last LATE seconds of each hold (fail-over done, host still gone)
LATE = 5.0


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
async def test_every_partition_commits_while_a_host_is_gone(tmp_path: Path) -> None:
    require(netns_available(), "root and iproute2 (network namespaces for the emulated hosts)")
    require(zookeeper_available(), "ZooKeeper (Debian package zookeeper)")
    windows: list[tuple[str, float, float]] = []

    async def vanish_one_host_at_a_time(procs: ClusterProcesses, _proxies: Any, history: HistoryWriter) -> Any:
        await asyncio.sleep(SETTLE)
        assert procs.coordination is not None
        leader = await asyncio.to_thread(procs.coordination.leader)
        for fault, name in (("storage-isolate", "storage-1"), ("server-isolate", "server-0"),
                            ("coordination-isolate", f"coordination-{leader}")):
            start = time.monotonic()
            history.nemesis(fault, name, "start", start)
            await asyncio.to_thread(procs.isolate, name)
            await asyncio.sleep(HOLD)
            await asyncio.to_thread(procs.reconnect, name)
            windows.append((fault, start, time.monotonic()))
            history.nemesis(fault, name, "end")
            await asyncio.sleep(SETTLE)
        return windows

    result = await run_smoketest(
        SmokeOptions(tmp_path, duration=3600.0, clients=1, partitions=PARTITIONS, servers=2, accounts=100,
                     coordination="zookeeper", coordination_nodes=3, hosts="netns", seed=21, session_timeout=6.0,
                     verify_timeout=180.0),
        cluster_hook=vanish_one_host_at_a_time)
    report = result.report()
    for stall in result.stalls:
        values = sorted(v for v in stall.per_partition.values() if v is not None)
        report.append(f"{stall.kind} ({stall.end - stall.start:.0f} s): per-partition commit stall over "
                      f"{len(stall.per_partition)} partitions: min {values[0]:.2f} s, median "
                      f"{statistics.median(values):.2f} s, max {values[-1]:.2f} s"
                      if values else f"{stall.kind}: no partition committed again")
        report.append("  by partition: " + " ".join(f"{p}:{v:.1f}" if v is not None else f"{p}:-"
                                                    for p, v in sorted(stall.per_partition.items())))
    print("\n".join(report))
    assert result.verdict.ok, "\n".join(report)
    assert [s.kind for s in result.stalls] == ["storage-isolate", "server-isolate", "coordination-isolate"]

    history = History.load(result.history_path)
    commits: dict[int, list[float]] = {}
    for op in history.operations:
        if op.outcome == OK and op.complete_time is not None:
            commits.setdefault(op.partition, []).append(op.complete_time)
    for fault, start, end in windows:
        late = [p for p in range(PARTITIONS)
                if not any(end - LATE <= t <= end for t in commits.get(p, []))]
        assert not late, (f"{fault}: partitions {late} did not commit in the last {LATE:.0f} s of the "
                          f"{HOLD:.0f} s the host was gone\n" + "\n".join(report))
