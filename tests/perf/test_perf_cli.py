"""``waltz perf`` end to end on a throw-away ``--local`` cluster (real processes, fdatasync).

Smoke tests: the commands run and print well-formed figures. No speed is asserted; the
figures are only checked to be consistent with each other.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from waltz_core.cli.main import build_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _run(args: list[str]) -> str:
    result = CliRunner().invoke(build_cli(), args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_produce_closed_loop_with_locks_json() -> None:
    out = json.loads(_run(["perf", "produce", "--local", "--json", "--duration", "1.5", "--warmup", "0.5",
                           "--in-flight", "16", "--lock-pool", "8", "--seed", "1"]).strip().splitlines()[-1])
    assert out["committed"] > 0 and out["failed"] == 0
    assert out["transactions_per_s"] == pytest.approx(out["committed"] / out["elapsed_s"], rel=0.01)
    assert out["mb_per_s"] == pytest.approx(out["transactions_per_s"] * 256 / 1e6, rel=0.01)
    # 16 writers on 8 locks conflict: lock failures happen and each one is a re-execution
    assert out["lock_failures"] > 0 and out["retries_per_txn"] > 0
    lat = out["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    # every committed record reached the storages (3 replicas, some in flight at the window's edges)
    assert out["storage_records"] >= out["committed"]
    assert out["records_per_fdatasync"] >= 1.0


def test_produce_open_loop_text_report() -> None:
    text = _run(["perf", "produce", "--local", "--duration", "1.5", "--warmup", "0.5", "--rate", "200",
                 "--clients", "2", "--partitions", "2", "--seed", "3"])
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert "open loop 200/s (Poisson)" in lines["producers:"]
    rate = float(lines["transactions/s"].split()[1].replace(",", ""))
    # Poisson with mean 200/s over 1.5 s: the offered rate, far below saturation (thousands/s).
    # No lower bound but > 0: a stalled fsync on a loaded machine may hold commits past the window.
    assert 0 < rate < 300
    assert "p99.9" in lines["latency"]
    assert "records" in lines["records/fdatasync"] and "syncs over all storages" in lines["records/fdatasync"]
    assert re.fullmatch(r"host CPU +busy [0-9.]+ %, steal [0-9.]+ % of \d+ cores \(.*\)", lines["host"]), lines["host"]


def test_consume_feed_and_data_json() -> None:
    out = json.loads(_run(["perf", "consume", "--local", "--json", "--populate", "800"]).strip().splitlines()[-1])
    feed, data = out["consume"]
    assert feed["mode"] == "feed" and data["mode"] == "feed+data"
    # the populate run may commit a few more than asked (in flight when the count was reached)
    assert feed["transactions"] >= 800 and data["transactions"] == feed["transactions"]
    assert feed["per_s"] > 0 and data["per_s"] > 0
    assert data["mb_per_s"] == pytest.approx(data["per_s"] * 256 / 1e6, rel=0.01)


def test_produce_without_locks_or_faults_reports_no_retries_and_cpu_per_process() -> None:
    # Regression: the transactions still in flight when the window closed used to add their
    # executions without their commits, so a fault-free run reported ~one window of "retries".
    out = json.loads(_run(["perf", "produce", "--local", "--json", "--duration", "1.5", "--warmup", "0.5",
                           "--in-flight", "32"]).strip().splitlines()[-1])
    assert out["committed"] > 0 and out["failed"] == 0 and out["lock_failures"] == 0
    assert out["retries_per_txn"] == 0.0
    cpu = out["cpu_us_per_txn"]
    assert set(cpu) == {"client", "server", "storages"}
    assert all(v > 0 for v in cpu.values())
    host = out["host_cpu"]
    assert set(host) == {"busy_percent", "steal_percent", "cores"} and 0 < host["busy_percent"] <= 100


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc; the project runs on Linux)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_sigterm_stops_the_local_cluster() -> None:
    # `timeout 60 waltz perf produce --local` used to leave its 3 storages and server running.
    perf = subprocess.Popen([sys.executable, "-m", "waltz_core.cli", "perf", "produce", "--local", "--json",
                             "--duration", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(children := _children(perf.pid)) < 4:  # 3 storages and a server
            assert perf.poll() is None and time.monotonic() < deadline, perf.stderr.read().decode()  # type: ignore[union-attr]
            time.sleep(0.2)
        time.sleep(2.0)  # the run is under way
        perf.send_signal(signal.SIGTERM)
        _, err = perf.communicate(timeout=60)
        assert perf.returncode == 128 + signal.SIGTERM, err.decode()
        assert "terminated" in err.decode()
        assert [pid for pid in children if _running(pid)] == []
    finally:
        if perf.poll() is None:
            perf.kill()
            perf.communicate()


def test_a_run_that_commits_nothing_in_its_window_fails_with_the_reason() -> None:
    # One Poisson arrival per 1000 s on average; with seed 1 the first is 144 s away: the window is empty.
    proc = subprocess.run([sys.executable, "-m", "waltz_core.cli", "perf", "produce", "--local", "--duration", "0.5",
                           "--warmup", "0", "--rate", "0.001", "--seed", "1"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no transaction committed in the 0.5" in proc.stderr and "a longer warm-up" in proc.stderr
    assert "transactions/s" not in proc.stdout  # no report of zeros
    assert "Traceback" not in proc.stderr
