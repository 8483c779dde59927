"""A server's budgets against its memory limit: the cgroup's limit read as v1 and v2 hold it,
and a real server started in a memory cgroup too small for its caches says so at start."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from waltz_core import memlimit
from waltz_core.config import CoordinationConfig
from waltz_core.testing import require
from waltz_core.testing.cluster import ClusterSpec, ProcessCluster
from waltz_core.testing.faults import memory_cgroup, memory_cgroups_available

MIB = 1024 * 1024


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_v2_limit_is_the_lowest_on_the_way_to_the_root(tmp_path: Path) -> None:
    _write(tmp_path / "system.slice" / "memory.max", f"{512 * MIB}\n")
    _write(tmp_path / "system.slice" / "waltz.service" / "memory.max", "max\n")
    assert memlimit.cgroup_memory_limit("0::/system.slice/waltz.service\n", tmp_path) == 512 * MIB
    _write(tmp_path / "system.slice" / "waltz.service" / "memory.max", f"{200 * MIB}\n")
    assert memlimit.cgroup_memory_limit("0::/system.slice/waltz.service\n", tmp_path) == 200 * MIB


def test_a_v1_limit_and_no_limit(tmp_path: Path) -> None:
    v1 = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    _write(tmp_path / "memory" / "docker" / "abc" / "memory.limit_in_bytes", f"{300 * MIB}\n")
    assert memlimit.cgroup_memory_limit(v1, tmp_path) == 300 * MIB
    _write(tmp_path / "memory" / "docker" / "abc" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "none"
    assert memlimit.cgroup_memory_limit(v1, tmp_path) is None
    assert memlimit.cgroup_memory_limit("0::/\n", tmp_path / "nothing") is None


def test_a_container_sees_its_own_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    # cgroup namespaces: /proc/self/cgroup names a path the container's mount does not have
    _write(tmp_path / "memory.max", f"{256 * MIB}\n")
    assert memlimit.cgroup_memory_limit("0::/kubepods/pod1/ctr\n", tmp_path) == 256 * MIB


def test_a_server_that_fits_gets_no_warning_and_one_that_does_not_gets_the_figures() -> None:
    budgets = {"feed_cache_budget": 64 * MIB, "data_cache_budget": 128 * MIB, "replication_buffer_budget": 64 * MIB}
    assert memlimit.server_shortfall(budgets, 4, 30_000, limit=(1024 * MIB, "the host's memory")) is None
    text = memlimit.server_shortfall(budgets, 4, 30_000, limit=(120 * MIB, "its cgroup's memory limit"))
    assert text == ("its caches may hold 256 MiB (feed_cache_budget 64 MiB, data_cache_budget 128 MiB, "
                    "replication_buffer_budget 64 MiB), and the interpreter and the lock tables of the 4 partition(s) "
                    "it may own about 39 MiB: 295 MiB in all, and its cgroup's memory limit is 120 MiB: it would be "
                    "killed for memory once the caches fill; lower the budgets or raise the limit "
                    "(docs/operations.md, \"Sizing a server's memory\")")


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_server_in_a_memory_cgroup_too_small_for_its_caches_says_so_at_start(tmp_path: Path) -> None:
    """Measured before: with the default budgets (256 MiB) in a 120 MiB cgroup a server ran, then
    was killed by the kernel after about 20,000 transactions of 4 KiB, with nothing in its log."""
    require(memory_cgroups_available(), "a memory cgroup (root, and a memory controller)")
    spec = ClusterSpec(tmp_path, num_partitions=1, num_storages=3, num_servers=1, transport="tcp",
                       coordination=CoordinationConfig(name="local", connect=str(tmp_path / "coord"),
                                                       root="/waltz", session_timeout=3.0))
    with memory_cgroup(160 * MIB) as group:
        cluster = ProcessCluster(spec, on_host=lambda name, argv: group.command(argv) if name == "server-0" else argv)
        await cluster.start()
        try:
            log = cluster.log_dir / "server-0.log"
            deadline = time.monotonic() + 60
            while "waltz server ready" not in log.read_text(errors="replace"):
                assert time.monotonic() < deadline, cluster.logs()
                await asyncio.sleep(0.1)
            assert cluster.servers[0].pid in group.pids()
            text = log.read_text(errors="replace")
            assert ("its caches may hold 256 MiB (feed_cache_budget 64 MiB, data_cache_budget 128 MiB, "
                    "replication_buffer_budget 64 MiB)") in text, text[-3000:]
            assert "and its cgroup's memory limit is 160 MiB: it would be killed for memory once the caches fill" \
                in text, text[-3000:]
            # What a process in the cgroup reads, and its /metrics gauge
            probe = await asyncio.to_thread(subprocess.run, group.command([sys.executable, "-c", (
                "from waltz_core.memlimit import memory_limit; from waltz_core.metrics import process_registry; "
                "print(memory_limit()[0]); print(process_registry('x', '0').render_prometheus())")]),
                capture_output=True, text=True, timeout=60)
            lines = probe.stdout.splitlines()
            assert lines[0] == str(160 * MIB), probe.stdout + probe.stderr
            assert f"waltz_process_memory_limit_bytes {160 * MIB}.0" in lines, probe.stdout
        finally:
            cluster.stop()
