"""Applications over real processes (``waltz storage start`` / ``waltz server start``), with
local and ZooKeeper coordination: one cluster per backend (5 partitions; each test owns its own
partitions, so the tests share it):

* partition 0: ``waltz client validate`` with 4 clients (a subprocess);
* partitions 1-2: concurrent clients with conflicting locks, the log replayed against the exact lock model;
* partition 3: a client process killed -9 and restarted resumes from its SQLite high-water mark;
* partition 4: a server killed -9 and restarted under load loses no acknowledged transaction.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz_core import PartitionLocalLock, TransactionContext, WaltzClient, WaltzClientCallbacks
from waltz_core.client import JsonSerializer
from waltz_core.config import CoordinationConfig
from waltz_core.locks.base import LockRequest
from waltz_core.locks.exact import ExactLockTable
from waltz_core.testing.cluster import ClusterSpec, ProcessCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

JSON = JsonSerializer()
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=["local", "zookeeper"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    directory = tmp_path_factory.mktemp(f"cluster-{request.param}")
    if request.param == "local":
        coordination = CoordinationConfig(name="local", connect=str(directory / "coord"), root="/waltz",
                                          session_timeout=3.0)
    else:
        zk = request.getfixturevalue("zookeeper_server")
        coordination = CoordinationConfig(name="zookeeper", connect=zk.connect_string,
                                          root=f"/waltz-{uuid.uuid4().hex[:8]}", session_timeout=4.0)
    spec = ClusterSpec(directory, num_partitions=5, num_storages=3, num_servers=2, coordination=coordination)
    processes = ProcessCluster(spec)
    try:
        asyncio.run(processes.start())
        yield processes
    except BaseException:
        print(processes.logs())
        raise
    finally:
        processes.stop()


class Recorder(WaltzClientCallbacks):
    """Keeps, per partition of interest, every applied transaction's data in order (in memory)."""

    def __init__(self, partitions: set[int]) -> None:
        self.partitions = partitions
        self.hwm: dict[int, int] = {}
        self.log: dict[int, list[tuple[int, bytes]]] = {p: [] for p in partitions}
        self.cond = threading.Condition()

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm.get(partition_id, -1)

    def apply_transaction(self, txn) -> None:
        data = txn.get_data() if txn.partition_id in self.partitions else b""
        with self.cond:
            if txn.partition_id in self.partitions:
                self.log[txn.partition_id].append((txn.transaction_id, data))
            self.hwm[txn.partition_id] = txn.transaction_id
            self.cond.notify_all()

    def wait_for(self, client: WaltzClient, timeout: float = 60.0) -> None:
        targets = {p: client.high_water_mark(p) for p in self.partitions}
        deadline = time.monotonic() + timeout
        with self.cond:
            while any(self.hwm.get(p, -1) < t for p, t in targets.items()):
                assert time.monotonic() < deadline, f"consumer at {self.hwm}, expected {targets}"
                self.cond.wait(0.1)


def read_all(spec: ClusterSpec, partitions: set[int]) -> dict[int, list[tuple[int, bytes]]]:
    """Every transaction of ``partitions``, read by a fresh client from the start of the log."""
    recorder = Recorder(partitions)
    with WaltzClient(recorder, spec.client_config()) as client:
        recorder.wait_for(client)
    return recorder.log


# ------------------------------------------------------------------------------ locks


LOCKS = [PartitionLocalLock("row", i) for i in range(4)]


class Locked(TransactionContext):
    """Random write/read locks; the data records them with the high-water mark they were checked at."""

    def __init__(self, pid: int, rng: random.Random, stats: dict[str, int]) -> None:
        super().__init__()
        self.pid = pid
        self.writes = rng.sample(range(len(LOCKS)), rng.randint(1, 2))
        self.reads = [i for i in rng.sample(range(len(LOCKS)), rng.randint(0, 2)) if i not in self.writes]
        self.stats = stats

    def partition_id(self, num_partitions: int) -> int:
        return self.pid

    def execute(self, builder) -> bool:
        builder.set_transaction_data({"hwm": builder.client_high_water_mark, "w": self.writes, "r": self.reads}, JSON)
        builder.set_write_locks([LOCKS[i] for i in self.writes])
        builder.set_read_locks([LOCKS[i] for i in self.reads])
        return True

    def on_completion(self, result: bool) -> None:
        self.stats["committed"] += result

    def on_lock_failure(self) -> None:
        self.stats["lock_failures"] += 1


def test_conflicting_locks_never_commit_a_conflict(cluster: ProcessCluster) -> None:
    partitions = {1, 2}
    stats = {"committed": 0, "lock_failures": 0}
    recorders = [Recorder(partitions) for _ in range(3)]
    clients = [WaltzClient(r, cluster.spec.client_config()) for r in recorders]
    try:
        def produce(i: int) -> None:
            rng = random.Random(i)
            for n in range(40):
                clients[i].submit(Locked(1 + n % 2, rng, stats))
            clients[i].flush(timeout=60)

        threads = [threading.Thread(target=produce, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in clients:
            c.close()
    assert stats["committed"] == 120
    assert stats["lock_failures"] > 0, "the workload must actually conflict"
    log = read_all(cluster.spec, partitions)
    for pid in partitions:
        assert [t for t, _ in log[pid]] == list(range(len(log[pid])))
        assert len(log[pid]) == 60
        table = ExactLockTable()
        for tid, data in log[pid]:
            txn = json.loads(data)
            request = LockRequest([LOCKS[i].lock_hash for i in txn["w"]], [LOCKS[i].lock_hash for i in txn["r"]])
            conflict = table.check(request, txn["hwm"])
            assert conflict is None, f"partition {pid}: transaction {tid} committed over a lock written at {conflict}"
            table.commit(request, tid)


# ------------------------------------------------------------------------ killed client


def applied_rows(db: Path, pid: int) -> list[tuple[int, str]]:
    with sqlite3.connect(db, timeout=30) as conn:
        try:
            return conn.execute("SELECT txn_id, data FROM applied WHERE partition_id = ? ORDER BY rowid", (pid,)).fetchall()
        except sqlite3.OperationalError:  # table not created yet
            return []


def test_killed_client_resumes_from_its_high_water_mark(cluster: ProcessCluster, tmp_path: Path) -> None:
    pid = 3
    db = tmp_path / "app.sqlite3"
    config = cluster.spec.directory / "client.toml"
    cmd = [sys.executable, str(HERE / "client_process.py"), str(config), str(db), str(pid)]
    out = tmp_path / "first.log"
    with out.open("wb") as log:
        # more than it can write before the kill even when this process is descheduled for seconds
        # (with 300 a loaded CI host once saw all of them applied before it looked)
        first = subprocess.Popen([*cmd, "3000", "first"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while len(applied_rows(db, pid)) < 60:
            assert first.poll() is None, out.read_text()
            assert time.monotonic() < deadline, "the client applied too little"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)  # mid-stream: appends in flight, applies in progress
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    at_kill = applied_rows(db, pid)
    assert 60 <= len(at_kill) < 3000
    # Someone else writes while it is down.
    other = subprocess.run([*cmd[:3], str(tmp_path / "other.sqlite3"), str(pid), "40", "other"],
                           capture_output=True, timeout=90)
    assert other.returncode == 0, other.stdout.decode() + other.stderr.decode()
    # Restarted: no production, only catch up from the high-water mark kept in SQLite.
    second = subprocess.run([*cmd, "0", "second"], capture_output=True, timeout=90)
    assert second.returncode == 0, second.stdout.decode() + second.stderr.decode()
    hwm = int(second.stdout.decode().split("DONE ")[1].split()[0])
    rows = applied_rows(db, pid)
    assert rows[: len(at_kill)] == at_kill
    assert [t for t, _ in rows] == list(range(hwm + 1)), "no gap, no duplicate apply across the kill"
    datas = [d for _, d in rows]
    assert len(set(datas)) == len(datas)
    assert {f"other-{i}" for i in range(40)} <= set(datas)


# ------------------------------------------------------------------------ server restart


class Put(TransactionContext):
    def __init__(self, data: bytes, acked: list[bytes]) -> None:
        super().__init__()
        self.data = data
        self.acked = acked

    def partition_id(self, num_partitions: int) -> int:
        return 4

    def execute(self, builder) -> bool:
        builder.set_transaction_data(self.data)
        return True

    def on_completion(self, result: bool) -> None:
        if result:
            self.acked.append(self.data)


def test_server_killed_and_restarted_under_load_loses_nothing_acknowledged(cluster: ProcessCluster) -> None:
    acked: list[bytes] = []
    errors: list[BaseException] = []
    config = cluster.spec.client_config(long_wait_threshold=0.5, reconnect_delay=0.1)
    recorder = Recorder({4})
    client = WaltzClient(recorder, config)
    started = threading.Event()

    def produce() -> None:
        try:
            for i in range(200):
                client.submit(Put(f"load-{i}".encode(), acked))
                if i == 40:
                    started.set()
                time.sleep(0.01)
            client.flush(timeout=120)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            started.set()

    producer = threading.Thread(target=produce)
    try:
        producer.start()
        started.wait(30)
        victims = list(cluster.servers)
        for i in victims:
            cluster.kill_server(i)  # kill -9 every server: nothing serves until they come back
        time.sleep(0.5)
        for i in victims:
            cluster.start_server(i)
        producer.join(150)
        assert not producer.is_alive()
        assert errors == []
    finally:
        client.close()
    assert len(acked) == 200 and len(set(acked)) == 200
    log = read_all(cluster.spec, {4})[4]
    datas = [d for _, d in log]
    assert len(set(datas)) == len(datas), "no transaction committed twice"
    assert set(acked) <= set(datas), "every acknowledged transaction survived the restart"


# ---------------------------------------------------------------------------- validate


def test_validate_cli_passes_with_four_clients(cluster: ProcessCluster) -> None:
    proc = subprocess.run([sys.executable, "-m", "waltz_core.cli", "client", "validate", "--config",
                           str(cluster.spec.directory / "client.toml"), "--clients", "4", "--txn-per-client", "50",
                           "--interval", "2"], capture_output=True, timeout=120)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    assert out.strip().splitlines()[-1] == "PASS"
    assert "committed=200/200 consumed=200" in out
