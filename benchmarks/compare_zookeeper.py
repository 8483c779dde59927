"""Side by side: this project's cluster against a 3-node ZooKeeper ensemble, same closed-loop driver.

The ZooKeeper round of ``compare_etcd.py`` (which runs Waltz, etcd and ZooKeeper interleaved);
run standalone, this script interleaves Waltz and ZooKeeper only. Same load shape as the other
drivers: ``--concurrency`` workers, each keeping exactly one conditional write outstanding on a
znode of its own, ``--record-size`` bytes, for ``--duration`` seconds after a warm-up.

The write is ZooKeeper's optimistic check: ``setData(path, value, version=expected)``, where
``expected`` is the version the worker's previous write returned (no conflicts: a BadVersion
would be a driver bug, and is counted). The ensemble is ``ZooKeeperServer(nodes=3,
force_sync=True)``: ``forceSync=yes``, ZooKeeper's default, so every write is fsync'ed to the
transaction log of a quorum before it is acknowledged; the JVMs run with their default flags
(C2 JIT) and a 256 MB heap. The client is kazoo's asynchronous API (``set_async``; the completion
callback issues the worker's next write), one connection per member with the workers spread over
them. CPU per write is the client process and the sum of the three JVMs (user + system time from
``/proc/<pid>/stat`` over the measured window). Usage::

    python benchmarks/compare_zookeeper.py --rounds 3 --duration 10 --concurrency 64
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from waltz_core.perf.cpu import CpuSample
from waltz_core.perf.histogram import LatencyHistogram

#: seconds of unmeasured writes right after the ensemble starts, so that the JVMs' JIT has compiled
#: the write path before the first round (without it, once: members 1,156 us/write in round 1, 642 in round 2)
JIT_WARMUP = 10.0


def hosts_of(zk: Any) -> list[str]:
    """One ``host:port`` per member (one kazoo connection each)."""
    return [f"127.0.0.1:{p}" for p in zk.client_ports]


def member_pids(zk: Any) -> list[int]:
    """The PIDs of the running JVMs."""
    return [pid for node in range(zk.nodes) if (pid := zk.pid(node)) is not None]


@contextmanager
def zookeeper_ensemble(workdir: str, concurrency: int, record_size: int,
                       jit_warmup: float = JIT_WARMUP) -> Iterator[Any]:
    """A 3-node ensemble with fsync on (forceSync=yes) and default JVM flags, warmed up; stopped on exit."""
    from waltz_core.testing.servers import ZooKeeperServer

    zk = ZooKeeperServer(nodes=3, workdir=workdir, force_sync=True, jvm_options=())
    zk.start()
    try:
        if jit_warmup > 0:
            print(f"ZooKeeper: {jit_warmup:g} s of unmeasured writes (JIT warm-up)", file=sys.stderr)
            zookeeper_round(hosts_of(zk), concurrency, record_size, jit_warmup, 0.0, "warm", member_pids(zk))
        yield zk
    finally:
        zk.stop()


class _Worker:
    """One closed-loop worker: a single conditional setData outstanding at a time on its znode.

    Its callbacks run on the completion thread of its kazoo client (one thread per client), so a
    worker's state is only touched by one thread at a time.
    """

    def __init__(self, run: _Run, client: Any, path: str, version: int) -> None:
        self.run = run
        self.client = client
        self.path = path
        self.version = version
        self.started = 0.0
        self.hist = LatencyHistogram()
        self.bad_versions = 0
        self.errors: Counter[str] = Counter()

    def issue(self) -> None:
        started = time.perf_counter()
        if started >= self.run.stop_at:
            self.run.finished()
            return
        self.started = started
        try:
            self.client.set_async(self.path, self.run.value, self.version).rawlink(self._on_set)
        except Exception as exc:  # noqa: BLE001 - e.g. the session closed: give up, counted
            self._give_up(exc)

    def _on_set(self, result: Any) -> None:
        done = time.perf_counter()
        try:
            exc = result.exception
            if exc is None:
                self.version = result.value.version
                if self.started >= self.run.measure_from:
                    self.hist.record(done - self.started)
                self.issue()
                return
            from kazoo.exceptions import BadVersionError

            if isinstance(exc, BadVersionError):
                self.bad_versions += 1
            else:
                self.errors[type(exc).__name__] += 1
            # Re-read the version and go on (what an application does after a failed check).
            self.client.exists_async(self.path).rawlink(self._on_reread)
        except Exception as exc:  # noqa: BLE001 - never leave the round waiting for a worker that died silently
            self._give_up(exc)

    def _on_reread(self, result: Any) -> None:
        try:
            if result.exception is None and result.value is not None:
                self.version = result.value.version
                self.issue()
            else:
                self._give_up(result.exception or LookupError(self.path))
        except Exception as exc:  # noqa: BLE001 - as in _on_set
            self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        self.errors[f"stopped: {type(exc).__name__}"] += 1
        self.run.finished()


class _Run:
    """Shared state of one round: the value, the window and the count of finished workers."""

    def __init__(self, value: bytes, workers: int) -> None:
        self.value = value
        self.measure_from = 0.0
        self.stop_at = 0.0
        self._pending = workers
        self._lock = threading.Lock()
        self.all_done = threading.Event()

    def finished(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending <= 0:
                self.all_done.set()


def zookeeper_round(hosts: list[str], concurrency: int, record_size: int, duration: float, warmup: float,
                    round_no: int | str, pids: list[int]) -> dict[str, Any]:
    """Closed loop of conditional setData against the ensemble; blocking (kazoo's own threads)."""
    from kazoo.client import KazooClient

    clients = [KazooClient(hosts=h, timeout=10.0) for h in hosts]  # one connection per member
    try:
        for c in clients:
            c.start(timeout=15)
        run = _Run(os.urandom(record_size), concurrency)
        workers = []
        for i in range(concurrency):
            client = clients[i % len(clients)]
            path = f"/bench/r{round_no}/w{i}"
            client.create(path, run.value, makepath=True)
            workers.append(_Worker(run, client, path, client.exists(path).version))
        now = time.perf_counter()
        run.measure_from = now + warmup
        run.stop_at = now + warmup + duration
        groups = {"client": [os.getpid()], "members": pids}
        cpu: list[CpuSample | None] = []

        def sample_cpu() -> None:  # at the edges of the measured window, as the Waltz driver does
            for edge in (run.measure_from, run.stop_at):
                time.sleep(max(0.0, edge - time.perf_counter()))
                cpu.append(CpuSample.take(groups))

        sampler = threading.Thread(target=sample_cpu)
        sampler.start()
        for w in workers:
            w.issue()
        sampler.join()
        hung = not run.all_done.wait(30.0)  # the last writes complete after stop_at
    finally:
        for c in clients:
            c.stop()
            c.close()
    total = LatencyHistogram()
    errors: Counter[str] = Counter()
    for w in workers:
        total.merge(w.hist)
        errors.update(w.errors)
    if hung:
        errors["round did not finish within 30 s of its end"] += 1
    per_op = (cpu[1] - cpu[0]).per_transaction_us(total.count) if len(cpu) == 2 and cpu[0] and cpu[1] else None
    return {"system": "zookeeper", "ops_per_s": total.count / duration, "latency_ms": total.summary_ms(),
            "cas_failures": sum(w.bad_versions for w in workers), "other_failures": dict(errors),
            "cpu_us_per_op": per_op}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Waltz and ZooKeeper interleaved (``compare_etcd.main`` restricted to this peer)."""
    import compare_etcd  # the sibling script; imported here, it imports this module at its top

    return await compare_etcd.main(argparse.Namespace(**{**vars(args), "peers": ["zookeeper"]}))


def cli() -> None:
    import compare_etcd

    compare_etcd.cli(peers=["zookeeper"], description=__doc__.splitlines()[0])


if __name__ == "__main__":
    cli()
