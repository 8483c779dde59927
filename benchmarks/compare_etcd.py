"""Side by side: this project's cluster against a 3-member etcd 3.4, same closed-loop driver.

Both systems get the same load shape: ``--concurrency`` workers, each keeping exactly one
conditional write outstanding, ``--record-size`` bytes, for ``--duration`` seconds after a warm-up.
The write is the same optimistic check on both sides:

* Waltz: a transaction with a write lock owned by the worker (checked against the client
  high-water mark by the server), 3 storages, write quorum 2, fdatasync before the ack
  (``waltz perf produce --local`` machinery, client library, latency submit -> on_completion);
* etcd: ``txn(compare mod_revision(key) == last, success put(key, value))`` per worker key, via
  ``pyetcd`` (etcd-sdk-python, gRPC) from a thread pool, against ``EtcdServer(nodes=3)``
  (fsync'ed raft log, the default).

Runs are interleaved (Waltz, etcd, Waltz, etcd, ...) so a noisy neighbour hits both; the medians
of the rounds and their ratio are printed. Usage::

    python benchmarks/compare_etcd.py --rounds 3 --duration 10 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
            "retries_per_txn": result.retries_per_txn, "records_per_fdatasync": rps,
            "cpu_us_per_op": result.cpu_us_per_txn}


def _line(r: dict[str, Any]) -> str:
    lat = r["latency_ms"]
    extra = ""
    if r["system"] == "waltz" and r.get("records_per_fdatasync"):
        extra = f"  records/fdatasync {r['records_per_fdatasync']:.1f}"
    if r["system"] == "etcd":
        extra = f"  cas failures {r['cas_failures']}"
    cpu = r.get("cpu_us_per_op")
    if cpu:
        extra += "  CPU us/write " + " ".join(f"{k} {v:.0f}" for k, v in cpu.items())
    return (f"  {r['system']:5}  {r['ops_per_s']:>9,.0f} writes/s  p50 {lat['p50']:7.2f}  p99 {lat['p99']:7.2f}  "
            f"p99.9 {lat['p99.9']:7.2f} ms{extra}")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from waltz_core.testing.servers import EtcdServer

    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="waltz-vs-etcd-") as tmp:
        etcd = EtcdServer(nodes=3, workdir=os.path.join(tmp, "etcd"))
        etcd.start()
        try:
            endpoints = [("127.0.0.1", p) for p in etcd.client_ports]
            async with local_cluster(1) as cluster:
                for n in range(args.rounds):
                    print(f"round {n + 1}/{args.rounds}", file=sys.stderr)
                    w = await waltz_round(cluster, args.concurrency, args.record_size, args.duration, args.warmup)
                    print(_line(w), file=sys.stderr)
                    member_pids = [pid for node in range(3) if (pid := etcd.pid(node)) is not None]
                    e = await asyncio.to_thread(etcd_round, endpoints, args.concurrency, args.record_size,
                                                args.duration, args.warmup, n, member_pids)
                    print(_line(e), file=sys.stderr)
                    rounds.append({"waltz": w, "etcd": e})
        finally:
            etcd.stop()
    med = {system: {"ops_per_s": statistics.median(r[system]["ops_per_s"] for r in rounds),
                    "p50_ms": statistics.median(r[system]["latency_ms"]["p50"] for r in rounds),
                    "p99_ms": statistics.median(r[system]["latency_ms"]["p99"] for r in rounds)}
           for system in ("waltz", "etcd")}
    ratio = med["waltz"]["ops_per_s"] / med["etcd"]["ops_per_s"] if med["etcd"]["ops_per_s"] else float("inf")
    return {"settings": vars(args), "rounds": rounds, "median": med, "ratio_waltz_over_etcd": ratio}


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=64, help="outstanding conditional writes")
    parser.add_argument("--record-size", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = parser.parse_args()
    import logging

    logging.getLogger("waltz.client").addFilter(lambda record: "not encrypted" not in record.getMessage())
    out = asyncio.run(main(args))
    if args.json:
        print(json.dumps(out))
        return
    med = out["median"]
    print(f"closed loop, {args.concurrency} outstanding, {args.record_size} B, {args.duration:g} s x {args.rounds} "
          "interleaved rounds (medians):")
    for system in ("waltz", "etcd"):
        m = med[system]
        print(f"  {system:5}  {m['ops_per_s']:>9,.0f} writes/s  p50 {m['p50_ms']:.2f} ms  p99 {m['p99_ms']:.2f} ms")
    print(f"  ratio waltz/etcd: {out['ratio_waltz_over_etcd']:.2f}x")


if __name__ == "__main__":
    cli()
