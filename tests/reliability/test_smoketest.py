"""The chaos smoke test in CI: a short run on local coordination, one on ZooKeeper, one with
every process on a host of its own (network namespaces, isolate faults), and one with replicas
moving between storage nodes.

Each run injects real faults (kill -9 and restart, SIGSTOP/SIGCONT, proxy cuts, black holes and
delays between servers and storages; ZooKeeper kill -9 and restart) under bank-transfer load,
then checks the whole history, the log read by a fresh client and every replica's files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from waltz_core.testing import require
from waltz_core.testing.faults.netns import netns_available
from waltz_core.testing.servers import zookeeper_available
from waltz_core.testing.smoketest import SmokeOptions, run_smoketest


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_short_smoketest_local_coordination(tmp_path: Path) -> None:
    # Faults a little shorter and denser than the defaults so that 50 s of load carries >= 50 faults;
    # a slower machine (restarts take longer) goes on until it has, rather than failing the count.
    result = await run_smoketest(SmokeOptions(tmp_path, duration=50.0, min_faults=50, seed=11, fault_hold=(0.3, 1.1),
                                              fault_gap=(0.1, 0.4)))
    print("\n".join(result.report()))
    assert result.verdict.ok, "\n".join(result.report())
    faults = sum(result.faults.values())
    assert faults >= 50, f"only {faults} faults injected: {result.faults}"
    assert {"storage-kill", "server-kill"} & set(result.faults), result.faults
    assert result.verdict.stats["ok"] > 500, result.verdict.stats  # the load really ran through the faults


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_short_smoketest_zookeeper_with_coordination_restarts(tmp_path: Path) -> None:
    require(zookeeper_available(), "ZooKeeper (Debian package zookeeper)")
    result = await run_smoketest(SmokeOptions(tmp_path, duration=25.0, min_faults=15, coordination="zookeeper",
                                              seed=12))
    print("\n".join(result.report()))
    assert result.verdict.ok, "\n".join(result.report())
    assert sum(result.faults.values()) >= 15, result.faults
    assert result.verdict.stats["ok"] > 200, result.verdict.stats


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_short_smoketest_every_process_on_its_own_host(tmp_path: Path) -> None:
    # Every process in a network namespace of its own (3 ZooKeeper members, 3 storages, 2 servers):
    # the nemesis adds "isolate" (the host vanishes: packets dropped, no reset) to every lane.
    require(netns_available(), "root and iproute2 (network namespaces for the emulated hosts)")
    require(zookeeper_available(), "ZooKeeper (Debian package zookeeper)")
    result = await run_smoketest(SmokeOptions(tmp_path, duration=40.0, min_faults=30, partitions=4,
                                              coordination="zookeeper", coordination_nodes=3, hosts="netns",
                                              seed=13))
    print("\n".join(result.report()))
    assert result.verdict.ok, "\n".join(result.report())
    isolations = {k: v for k, v in result.faults.items() if k.endswith("-isolate")}
    assert {"storage-isolate", "server-isolate"} <= set(isolations), result.faults
    assert result.verdict.stats["ok"] > 500, result.verdict.stats


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_short_smoketest_with_replicas_moving(tmp_path: Path) -> None:
    # 4 storage nodes, each partition on 3: the replica lane moves replicas between them (taking
    # out old ones that may be down or cut off, giving nodes back replicas they lost) while the
    # other lanes kill, pause and cut. Before the recovery voted among the previous session's
    # replicas, runs like this one lost acknowledged transactions (439 in one 60 s run).
    result = await run_smoketest(SmokeOptions(tmp_path, duration=40.0, min_faults=30, partitions=4, storages=4,
                                              moves=True, move_gap=(0.5, 2.0), seed=5))
    print("\n".join(result.report()))
    assert result.verdict.ok, "\n".join(result.report())
    assert result.faults.get("replica-move", 0) >= 8, result.faults
    assert result.verdict.stats["ok"] > 500, result.verdict.stats
