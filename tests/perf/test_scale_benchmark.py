"""benchmarks/scale.py runs end to end at a tiny size (the figures themselves are measured by hand)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_scale_benchmark_runs_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--partitions", "4", "--active", "2,4",
                           "--duration", "1", "--fill-duration", "1", "--outstanding", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [row["active"] for row in report["throughput"]] == [2, 4]
    assert all(row["txn_per_s"] > 0 for row in report["throughput"])
    assert report["start_s"] > 0
    recovery = report["recovery_after_server_kill"]
    assert recovery["recovered"] == recovery["partitions_moved"] > 0
    assert set(report["memory_after_fill_mib"]) == {"server-0", "server-1"}
    assert "| active partitions |" in proc.stdout and "kill -9 of server-" in proc.stdout


def test_bad_arguments_are_one_clear_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--partitions", "4", "--active", "8"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "--active values must be between 1 and --partitions" in proc.stderr
    assert "Traceback" not in proc.stderr
