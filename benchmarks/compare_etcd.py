"""Side by side: this project's cluster against a 3-member etcd 3.4 and a 3-node ZooKeeper, same closed-loop driver.

All systems get the same load shape: ``--concurrency`` workers, each keeping exactly one
conditional write outstanding, ``--record-size`` bytes, for ``--duration`` seconds after a warm-up.
The write is the same optimistic check on every side:

* Waltz: a transaction with a write lock owned by the worker (checked against the client
  high-water mark by the server), 3 storages, write quorum 2, fdatasync before the ack
  (``waltz perf produce --local`` machinery, client library, latency submit -> on_completion);
* etcd: ``txn(compare mod_revision(key) == last, success put(key, value))`` per worker key, via
  ``pyetcd`` (etcd-sdk-python, gRPC) from a thread pool, against ``EtcdServer(nodes=3)``
  (fsync'ed raft log, the default);
* ZooKeeper: ``setData(path, value, version=last)`` per worker znode, via kazoo's async API, against
  ``ZooKeeperServer(nodes=3, force_sync=True)`` (fsync'ed transaction log, ZooKeeper's default);
  see ``compare_zookeeper.py``.

Runs are interleaved (Waltz, etcd, ZooKeeper, Waltz, etcd, ZooKeeper, ...) so a noisy neighbour
hits all; the medians of the rounds and the ratios Waltz / peer are printed. ``--peers`` picks the
peers (default both). Usage::

    python benchmarks/compare_etcd.py --rounds 3 --duration 10 --concurrency 64
    python benchmarks/compare_etcd.py --rounds 1 --duration 5 --peers etcd
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import compare_zookeeper  # the sibling script (on sys.path: this script's directory, or perf_report's insert)

from waltz_core.errors import WaltzError
from waltz_core.eventloop import event_loop_from_env, run
from waltz_core.perf.cluster import local_cluster
from waltz_core.perf.cpu import CpuSample
from waltz_core.perf.driver import ProduceOptions, produce
from waltz_core.perf.histogram import LatencyHistogram


def etcd_round(endpoints: list[tuple[str, int]], concurrency: int, record_size: int, duration: float,
               warmup: float, round_no: int, member_pids: list[int]) -> dict[str, Any]:
    """Closed loop of conditional puts against etcd; blocking (threads)."""
    import pyetcd

    value = os.urandom(record_size)
    stop_at = [0.0]
    measure_from = [0.0]
    histograms: list[LatencyHistogram] = []
    failures = [0]
    lock = threading.Lock()

    def worker(i: int) -> None:
        host, port = endpoints[i % len(endpoints)]  # spread connections over the members, as clients would
        client = pyetcd.client(host=host, port=port, timeout=10)
        hist = LatencyHistogram()
        key = f"/bench/r{round_no}/w{i}"
        try:
            revision = client.put(key, value).header.revision
            txns = client.transactions
            while True:
                started = time.perf_counter()
                if started >= stop_at[0]:
                    break
                ok, responses = client.transaction(compare=[txns.mod(key) == revision],
                                                   success=[txns.put(key, value)], failure=[])
                done = time.perf_counter()
                if not ok:
                    with lock:
                        failures[0] += 1
                    revision = client.get(key)[1].mod_revision
                    continue
                revision = responses[0].response_put.header.revision
                if started >= measure_from[0]:
                    hist.record(done - started)
        finally:
            client.close()
            with lock:
                histograms.append(hist)

    now = time.perf_counter()
    measure_from[0] = now + warmup
    stop_at[0] = now + warmup + duration
    groups = {"client": [os.getpid()], "members": member_pids}
    cpu: list[CpuSample | None] = []

    def sample_cpu() -> None:  # at the edges of the measured window, as the Waltz driver does
        for edge in (measure_from[0], stop_at[0]):
            time.sleep(max(0.0, edge - time.perf_counter()))
            cpu.append(CpuSample.take(groups))

    sampler = threading.Thread(target=sample_cpu)
    sampler.start()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    sampler.join()
    total = LatencyHistogram()
    for h in histograms:
        total.merge(h)
    per_op = (cpu[1] - cpu[0]).per_transaction_us(total.count) if len(cpu) == 2 and cpu[0] and cpu[1] else None
    return {"system": "etcd", "ops_per_s": total.count / duration, "latency_ms": total.summary_ms(),
            "cas_failures": failures[0], "cpu_us_per_op": per_op}


async def waltz_round(cluster: Any, concurrency: int, record_size: int, duration: float, warmup: float) -> dict[str, Any]:
    options = ProduceOptions(txn_size=record_size, clients=1, in_flight=concurrency, partitions=1, own_locks=True,
                             duration=duration, warmup=warmup)
    result = await produce(cluster.client_config, options, metrics_urls=cluster.metrics_urls,
                           processes={"server": cluster.server_pids, "storages": cluster.storage_pids})
    rps = result.storage.records_per_sync if result.storage else None
    return {"system": "waltz", "ops_per_s": result.txn_per_s, "latency_ms": result.latency.summary_ms(),
            "retries_per_txn": result.retries_per_txn, "lock_failures": result.lock_failures,
            "failed": result.failed, "records_per_fdatasync": rps,
            "cpu_us_per_op": result.cpu_us_per_txn}


PEERS = ("etcd", "zookeeper")
#: how each system is named in the printed lines and tables
NAMES = {"waltz": "Waltz", "etcd": "etcd", "zookeeper": "ZooKeeper"}


def failures(r: dict[str, Any]) -> str:
    """The failed conditional writes of one round (none are expected: no worker conflicts with another)."""
    if r["system"] == "waltz":
        return f"{r.get('lock_failures', 0)} lock failures, {r.get('failed', 0)} failed"
    text = f"{r['cas_failures']} CAS failures"
    for kind, count in r.get("other_failures", {}).items():
        text += f", {count} {kind}"
    return text


def _line(r: dict[str, Any]) -> str:
    lat = r["latency_ms"]
    extra = ""
    if r["system"] == "waltz" and r.get("records_per_fdatasync"):
        extra = f"  records/fdatasync {r['records_per_fdatasync']:.1f}"
    extra += f"  {failures(r)}"
    cpu = r.get("cpu_us_per_op")
    if cpu:
        extra += "  CPU us/write " + " ".join(f"{k} {v:.0f}" for k, v in cpu.items())
    return (f"  {NAMES[r['system']]:9}  {r['ops_per_s']:>9,.0f} writes/s  p50 {lat['p50']:7.2f}  p99 {lat['p99']:7.2f}  "
            f"p99.9 {lat['p99.9']:7.2f} ms{extra}")


def _median_cpu(results: list[dict[str, Any]]) -> dict[str, float] | None:
    known = [r["cpu_us_per_op"] for r in results if r.get("cpu_us_per_op")]
    if not known:
        return None
    return {k: round(statistics.median(c[k] for c in known if k in c), 1) for k in known[0]}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds of Waltz and each of ``args.peers`` (default: etcd and ZooKeeper)."""
    from waltz_core.testing.servers import EtcdServer

    peers = [p for p in PEERS if p in getattr(args, "peers", PEERS)]
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="waltz-vs-peers-") as tmp, contextlib.ExitStack() as stack:
        # Every server starts (and is stopped) outside the measured windows; they all stay up for
        # the whole run, so each round has the same idle neighbours.
        etcd = None
        if "etcd" in peers:
            etcd = EtcdServer(nodes=3, workdir=os.path.join(tmp, "etcd"))
            etcd.start()
            stack.callback(etcd.stop)
        zk = None
        if "zookeeper" in peers:
            zk = stack.enter_context(compare_zookeeper.zookeeper_ensemble(os.path.join(tmp, "zookeeper"),
                                                                          args.concurrency, args.record_size))
        async with local_cluster(1) as cluster:
            for n in range(args.rounds):
                print(f"round {n + 1}/{args.rounds}", file=sys.stderr)
                row = {"waltz": await waltz_round(cluster, args.concurrency, args.record_size, args.duration,
                                                  args.warmup)}
                print(_line(row["waltz"]), file=sys.stderr)
                if etcd is not None:
                    endpoints = [("127.0.0.1", p) for p in etcd.client_ports]
                    member_pids = [pid for node in range(3) if (pid := etcd.pid(node)) is not None]
                    row["etcd"] = await asyncio.to_thread(etcd_round, endpoints, args.concurrency, args.record_size,
                                                          args.duration, args.warmup, n, member_pids)
                    print(_line(row["etcd"]), file=sys.stderr)
                if zk is not None:
                    row["zookeeper"] = await asyncio.to_thread(
                        compare_zookeeper.zookeeper_round, compare_zookeeper.hosts_of(zk), args.concurrency,
                        args.record_size, args.duration, args.warmup, n, compare_zookeeper.member_pids(zk))
                    print(_line(row["zookeeper"]), file=sys.stderr)
                rounds.append(row)
    med = {system: {"ops_per_s": statistics.median(r[system]["ops_per_s"] for r in rounds),
                    "p50_ms": statistics.median(r[system]["latency_ms"]["p50"] for r in rounds),
                    "p99_ms": statistics.median(r[system]["latency_ms"]["p99"] for r in rounds),
                    "cpu_us_per_op": _median_cpu([r[system] for r in rounds])}
           for system in ("waltz", *peers)}
    out: dict[str, Any] = {"settings": vars(args) | {"peers": peers}, "peers": peers, "rounds": rounds, "median": med}
    for peer in peers:
        ops = med[peer]["ops_per_s"]
        out[f"ratio_waltz_over_{peer}"] = med["waltz"]["ops_per_s"] / ops if ops else float("inf")
    return out


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def peer_list(text: str) -> list[str]:
    peers = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown or not peers:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(PEERS)}, got {text!r}")
    return peers


def cli(peers: list[str] | None = None, description: str | None = None) -> None:
    """Command line; ``peers`` fixes the peers (no ``--peers`` flag), as ``compare_zookeeper.py`` does."""
    parser = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--duration", type=positive_float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=non_negative_float, default=2.0)
    parser.add_argument("--concurrency", type=positive_int, default=64, help="outstanding conditional writes")
    parser.add_argument("--record-size", type=positive_int, default=256)
    if peers is None:
        parser.add_argument("--peers", type=peer_list, default=list(PEERS),
                            help=f"comma-separated peers to compare with (default {','.join(PEERS)})")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = parser.parse_args()
    if peers is not None:
        args.peers = peers
    import logging

    logging.getLogger("waltz.client").addFilter(lambda record: "not encrypted" not in record.getMessage())
    try:
        out = run(main(args), event_loop_from_env())  # the loop of the Waltz nodes too (WALTZ_PROCESS_EVENT_LOOP)
    except WaltzError as exc:  # e.g. a Waltz round that committed nothing: no figures of zeros
        sys.exit(f"{os.path.basename(sys.argv[0])}: {exc}")
    if args.json:
        print(json.dumps(out))
        return
    med = out["median"]
    print(f"closed loop, {args.concurrency} outstanding, {args.record_size} B, {args.duration:g} s x {args.rounds} "
          "interleaved rounds (medians):")
    for system in ("waltz", *out["peers"]):
        m = med[system]
        cpu = " ".join(f"{k} {v:.0f}" for k, v in (m["cpu_us_per_op"] or {}).items()) or "unknown"
        print(f"  {NAMES[system]:9}  {m['ops_per_s']:>9,.0f} writes/s  p50 {m['p50_ms']:.2f} ms  "
              f"p99 {m['p99_ms']:.2f} ms  CPU us/write {cpu}")
    for peer in out["peers"]:
        print(f"  ratio Waltz/{NAMES[peer]}: {out[f'ratio_waltz_over_{peer}']:.2f}x")


if __name__ == "__main__":
    cli()
