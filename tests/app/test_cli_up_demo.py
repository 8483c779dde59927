"""``waltz up`` (background, foreground, reuse, ZooKeeper), ``waltz demo bank`` and ``waltz demo
quickstart`` as a user runs them: subprocesses of the installed ``waltz`` command, with timeouts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from waltz_core.testing.servers import ZooKeeperServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

WALTZ = [sys.executable, "-m", "waltz_core.cli"]


def waltz(*args: str, stdin: str | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WALTZ, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except OSError:
        return False
    return state != "Z"


def cluster_processes(data: Path) -> list[int]:
    """Pids of the storage/server processes whose command line names a config in ``data``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "start" in args and any(a.startswith(str(data.resolve())) and a.endswith(".toml") for a in args):
                out.append(int(entry.name))
    return out


def test_up_background_bank_stop_then_foreground_reuse_and_sigterm(tmp_path: Path) -> None:
    data = tmp_path / "waltz-data"
    up = waltz("up", "--background", "--data-dir", str(data), "--partitions", "2")
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"client config: {data.resolve()}/client.toml" in up.stdout
    assert "cluster ready" in up.stdout and "waltz up --stop" in up.stdout
    pids = json.loads((data / "waltz-up.pids").read_text())
    assert sorted(pids) == ["server-0", "storage-0", "storage-1", "storage-2"]
    try:
        again = waltz("up", "--background", "--data-dir", str(data))
        assert again.returncode == 1 and "already running" in again.stderr
        auto = waltz("demo", "bank", "--data-dir", str(data), "--auto", "60", "--clients", "2", "--accounts", "3")
        assert auto.returncode == 0, auto.stdout + auto.stderr
        assert "OK    no negative balance" in auto.stdout and "FAIL" not in auto.stdout
        session = waltz("demo", "bank", "--data-dir", str(data), "--db", str(tmp_path / "mine.sqlite3"),
                        stdin="deposit 7 100\nwithdraw 7 30\nwithdraw 7 500\nbalance 7\nquit\n")
        assert session.returncode == 0, session.stdout + session.stderr
        assert "ok: account 7: 100" in session.stdout and "ok: account 7: 70" in session.stdout
        assert "withdrawal refused: balance 70 < 500" in session.stdout
    finally:
        stop = waltz("up", "--stop", "--data-dir", str(data))
    assert stop.returncode == 0 and "stopped 4 processes" in stop.stdout
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids.values())
    assert not (data / "waltz-up.pids").exists()

    # Foreground on the same directory: the cluster and its data come back; SIGTERM stops it all.
    log = tmp_path / "up.log"
    with log.open("w") as out:
        fg = subprocess.Popen([*WALTZ, "up", "--data-dir", str(data)], stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while "press Ctrl-C" not in log.read_text():
            assert fg.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert "reused" in log.read_text()
        session = waltz("demo", "bank", "--data-dir", str(data), "--db", str(tmp_path / "mine.sqlite3"),
                        stdin="balance 7\nquit\n")
        assert "account 7: 70" in session.stdout, session.stdout + session.stderr
        children = cluster_processes(data)
        assert len(children) == 4
        fg.send_signal(signal.SIGTERM)
        assert fg.wait(30) == 0, log.read_text()
    finally:
        if fg.poll() is None:
            fg.send_signal(signal.SIGTERM)
            try:
                fg.wait(30)
            except subprocess.TimeoutExpired:
                fg.kill()
                fg.wait()
        for pid in cluster_processes(data):  # never leave a cluster behind, whatever failed
            os.kill(pid, signal.SIGKILL)
    assert "stopped" in log.read_text()
    assert not any(alive(p) for p in children)


def test_up_in_the_background_writes_its_pid_file_even_if_its_reader_went_away(tmp_path: Path) -> None:
    # `waltz up --background | head -1`: printing failed (a closed pipe) before the pid file was
    # written, and the cluster ran on without one. Here the reader is gone before the first line.
    data = tmp_path / "waltz-data"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([*WALTZ, "up", "--background", "--data-dir", str(data), "--partitions", "1"],
                              stdout=write_end, stderr=subprocess.DEVNULL, timeout=90)
    finally:
        os.close(write_end)
    try:
        assert done.returncode != 0  # it could not say what it did
        pids = json.loads((data / "waltz-up.pids").read_text())
        assert sorted(pids.values()) == sorted(cluster_processes(data))
    finally:
        stop = waltz("up", "--stop", "--data-dir", str(data))
        for pid in cluster_processes(data):
            os.kill(pid, signal.SIGKILL)
    assert "stopped 4 processes" in stop.stdout and "not in waltz-up.pids" not in stop.stdout, stop.stdout


def test_up_finds_the_processes_of_a_cluster_whose_pid_file_was_lost(tmp_path: Path) -> None:
    # Without this, a second `waltz up` started processes that found their directories locked and
    # exited while the running cluster answered for them: it reported a cluster started, and
    # `--stop` then found nothing to stop and left the first cluster running.
    data = tmp_path / "waltz-data"
    up = waltz("up", "--background", "--data-dir", str(data), "--partitions", "1")
    assert up.returncode == 0, up.stdout + up.stderr
    pids = json.loads((data / "waltz-up.pids").read_text())
    try:
        (data / "waltz-up.pids").unlink()
        again = waltz("up", "--background", "--data-dir", str(data))
        assert again.returncode == 1, again.stdout + again.stderr
        assert f"processes of the cluster in {data.resolve()} are running: server-0 (pid {pids['server-0']})" \
            in again.stderr
        assert f"stop them with: waltz up --stop --data-dir {data.resolve()}" in again.stderr
        assert sorted(cluster_processes(data)) == sorted(pids.values())  # nothing new started, nothing stopped
    finally:
        stop = waltz("up", "--stop", "--data-dir", str(data))
        for pid in cluster_processes(data):
            os.kill(pid, signal.SIGKILL)
    assert stop.returncode == 0, stop.stderr
    assert f"stopped storage-0 (pid {pids['storage-0']}, not in waltz-up.pids)" in stop.stdout
    assert "stopped 4 processes" in stop.stdout
    assert not any(alive(p) for p in pids.values())
    assert "no running cluster" in waltz("up", "--stop", "--data-dir", str(data)).stdout


def test_up_with_zookeeper_and_validate(tmp_path: Path, zookeeper_server: ZooKeeperServer) -> None:
    data = tmp_path / "zk-data"
    up = waltz("up", "--background", "--data-dir", str(data), "--coordination", "zookeeper", "--connect",
               zookeeper_server.connect_string, "--root", f"/up-{uuid.uuid4().hex[:8]}")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert 'name = "zookeeper"' in (data / "client.toml").read_text()
        check = waltz("client", "validate", "--data-dir", str(data), "--clients", "4", "--txn-per-client", "30",
                      "--interval", "1")
        assert check.returncode == 0, check.stdout + check.stderr
        assert check.stdout.strip().splitlines()[-1] == "PASS"
        check = waltz("client", "validate", "--data-dir", str(data), "--clients", "2", "--txn-per-client", "5",
                      "--json")
        report = json.loads(check.stdout)
        assert check.returncode == 0 and report["passed"] is True and report["committed"] == report["expected"] == 10
        marks = waltz("client", "high-water-mark", "--data-dir", str(data), "-p", "0", "--json")
        assert marks.returncode == 0, marks.stderr
        assert json.loads(marks.stdout)["high_water_marks"]["0"] == 129  # 4 x 30 + 2 x 5 transactions, from 0
        marks = waltz("client", "high-water-mark", "--data-dir", str(data))
        assert "partition 0: high-water mark 129" in marks.stdout
        one = waltz("client", "high-water-mark", "--data-dir", str(data), "-p", "99")
        assert one.returncode == 1 and "the cluster has partitions 0-3, not [99]" in one.stderr
    finally:
        stop = waltz("up", "--stop", "--data-dir", str(data))
    assert "stopped 4 processes" in stop.stdout


def test_up_picks_backends_by_name(tmp_path: Path) -> None:
    """`waltz up --transport` takes any installed transport (zmq here); an unknown backend name is
    one clear line naming what is installed, and nothing is created."""
    data = tmp_path / "zmq-data"
    up = waltz("up", "--background", "--data-dir", str(data), "--transport", "zmq", "--partitions", "2")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert 'name = "zmq"' in (data / "client.toml").read_text()
        bank = waltz("demo", "bank", "--auto", "30", "--data-dir", str(data))
        assert bank.returncode == 0, bank.stdout + bank.stderr
        other = waltz("up", "--background", "--data-dir", str(data), "--transport", "tcp")
        assert other.returncode == 1 and "was created with the zmq transport" in other.stderr, other.stderr
    finally:
        stop = waltz("up", "--stop", "--data-dir", str(data))
    assert "stopped 4 processes" in stop.stdout
    for flag, kind, name in (("--transport", "transport", "nosuch"), ("--coordination", "coordination", "nosuch"),
                             ("--transport", "transport", "")):
        bad = waltz("up", "--background", "--data-dir", str(tmp_path / "bad"), flag, name, "--connect", "x:1")
        assert bad.returncode == 1, bad.stderr
        assert bad.stderr.startswith(f"error: {kind} {name!r} not found; installed: "), bad.stderr
        assert not (tmp_path / "bad").exists()
    third_party = waltz("smoketest", "--coordination", "nosuch", "--duration", "1")
    assert third_party.returncode == 1 and "coordination 'nosuch' not found" in third_party.stderr


def test_demo_quickstart_as_the_readme_says(tmp_path: Path) -> None:
    t0 = time.monotonic()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([*WALTZ, "demo", "quickstart"], capture_output=True, text=True, timeout=60, env=env)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: the balances add up" in proc.stdout
    assert "balances re-derived by replaying the log through a fresh client match" in proc.stdout
    assert "FAIL" not in proc.stdout
    assert list(tmp_path.iterdir()) == [], "the temporary cluster directory is removed"
    print(f"waltz demo quickstart took {elapsed:.1f}s")
