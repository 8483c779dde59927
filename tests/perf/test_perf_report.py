"""benchmarks/perf_report.py, the source of docs/performance.md's figures, runs end to end at a tiny size
against real etcd and ZooKeeper (the figures themselves are measured by hand, on a quiet machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from waltz_core.perf.driver import ProduceOptions, ProduceResult
from waltz_core.testing import require
from waltz_core.testing.servers import etcd_available, zookeeper_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(290)
def test_the_report_runs_and_prints_every_table(tmp_path: Path) -> None:
    require(etcd_available(), "etcd (Debian package etcd-server)")
    require(zookeeper_available(), "ZooKeeper (Debian package zookeeper)")
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "perf_report.py"), "--rounds", "1", "--duration",
                           "0.5", "--warmup", "4", "--repeat", "1", "--populate", "500", "--json", str(out)],
                          capture_output=True, text=True, timeout=270, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for when in ("machine_before", "machine_after"):
        speed = report[when]
        assert speed["python_ns_per_op"] > 0 and speed["wakeup_round_trip_us"] > 0 and speed["fdatasync_per_s"] > 0
    assert report["comparison"]["peers"] == ["etcd", "zookeeper"]
    assert all(report["comparison"]["median"][s]["ops_per_s"] > 0 for s in ("waltz", "etcd", "zookeeper"))
    # 8 shapes, or 7 where /dev/shm cannot take the in-memory open loop (the run says why)
    shapes = [row["shape"] for row in report["produce"]]
    in_memory = [s for s in shapes if "files on tmpfs (no disk)" in s]
    assert len(shapes) == 7 + len(in_memory) and all(row["txn_per_s"] > 0 for row in report["produce"])
    if not in_memory:
        assert "files on tmpfs (no disk): not run, /dev/shm" in proc.stderr
    assert [c["mode"] for c in report["consume"]] == ["feed", "feed+data"]
    floor = report["disk_floor"]
    assert floor["writers"] == 3 and floor["quorum"] == 2 and floor["commit_ms"]["p99.9"] > 0
    text = proc.stdout
    assert text.count("Machine before: ") == 1 and text.count("Machine after: ") == 1
    for heading in ("### Waltz vs etcd vs ZooKeeper", "### `waltz perf produce`", "### Against the targets",
                    "### The disk's share", "### `waltz perf consume`"):
        assert heading in text
    assert "4 partitions x 16 / 1 partition x 64" in text and "Waltz / etcd" in text
    assert f"(the disk alone, at its rate and rounds: {floor['commit_ms']['p99.9']} ms" in text
    assert ("; the cluster with its files on tmpfs: " in text) == bool(in_memory)


def test_the_in_memory_open_loop_runs_only_where_memory_has_room(tmp_path: Path) -> None:
    perf_report = _perf_report()
    assert perf_report._no_tmpfs(tmp_path / "missing") == f"{tmp_path / 'missing'}: No such file or directory"
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    why = perf_report._no_tmpfs(tmp_path)
    if free >= perf_report.MEMORY_NEEDED:
        assert why is None
    else:
        assert why == f"{tmp_path} has {free >> 20:,} MiB free, it needs 1,024"


def _perf_report() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import perf_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return perf_report


def test_repeated_open_loops_report_their_median_tail_and_every_run() -> None:
    perf_report = _perf_report()
    runs = []
    for slow_ms, steal in ((30.0, 4.5), (8.0, 0.2), (12.0, 1.1)):  # one slow transaction in a thousand: the p99.9
        result = ProduceResult(ProduceOptions(rate=1000.0, in_flight=1024), elapsed=1.0, committed=2000,
                               host_cpu={"busy_percent": 70.0, "steal_percent": steal, "cores": 2})
        for _ in range(1996):
            result.latency.record(0.002)
        for _ in range(4):
            result.latency.record(slow_ms / 1e3)
        runs.append(result)
    tails = [r.latency.summary_ms()["p99.9"] for r in runs]
    row = perf_report._median_tail_row("1 partition, open loop 1,000/s (70% of the maximum)", runs)
    assert row["shape"] == "1 partition, open loop 1,000/s (70% of the maximum), median of 3 by p99.9"
    assert row["runs_p99.9_ms"] == tails and row["latency_ms"]["p99.9"] == sorted(tails)[1]
    assert row["runs_steal_percent"] == [4.5, 0.2, 1.1] and row["host_cpu"]["steal_percent"] == 1.1
    single = perf_report._median_tail_row("one", runs[:1])
    assert single["shape"] == "one" and "runs_p99.9_ms" not in single
    # the targets row says it is a median and gives each run, for the open loop and for both of its parts
    assert perf_report._tail(12.0, [30.0, 8.0, 12.0]) == "12.0 ms (median; runs 8.0, 12.0, 30.0)"
    assert perf_report._tail(12.0, [12.0]) == "12.0 ms"
    assert (perf_report._tail(12.0, row["runs_p99.9_ms"], row["runs_steal_percent"])
            == "12.0 ms (median; runs 8.0 at 0.2 % steal, 12.0 at 1.1 % steal, 30.0 at 4.5 % steal)")
    assert perf_report._tail(12.0, [30.0, 8.0, 12.0], [None, 0.2, 1.1]) == "12.0 ms (median; runs 8.0, 12.0, 30.0)"
    assert perf_report._host(row["host_cpu"]) == "70.0 / 1.1" and perf_report._host(None) == "-"
    assert perf_report._runs_note([]) == "."
    assert perf_report._runs_note([5.0, 7.5]) == " (the median of 2 runs by p99.9; their p99.9: 5.0 ms, 7.5 ms)."
