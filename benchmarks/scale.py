"""Scale in partitions: 256 partitions on 3 storage nodes and 2 servers, on this machine.

    python benchmarks/scale.py                        # about 3 minutes on 2 cores
    python benchmarks/scale.py --partitions 64 --active 16,64 --duration 5   # smaller
    python benchmarks/scale.py --json out.json

Prints, as Markdown for docs/performance.md:

* time to start: from launching the processes (a fresh cluster: bootstrap, 5 processes, every
  partition recovered) until a client can mount all partitions;
* throughput and latency with 16, 64 and 256 active partitions (closed loop, 256 B, about 256
  transactions outstanding in all: in flight per partition = 256 / active);
* memory of each server: VmRSS idle (every partition open), then VmRSS and VmHWM (peak) after a
  load that fills the cache budgets (4 KiB transactions on every partition), next to the budgets;
* time to recover after kill -9 of one server: a client commits on every partition in a loop; the
  figure is, per partition that server owned, the time from the kill to the commit of its first
  transaction submitted after it (the coordination session timeout is part of it: 3 s with the
  embedded coordination).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from waltz_core.app.local_cluster import ClusterSpec, ProcessCluster
from waltz_core.app.up import wait_served
from waltz_core.client import AsyncWaltzClient, TransactionBuilder, TransactionContext
from waltz_core.coordination import open_coordination
from waltz_core.coordination.recipes import read_assignment
from waltz_core.errors import WaltzError
from waltz_core.perf.driver import ProduceOptions, produce, start_client
from waltz_core.timeouts import wait_for

MIB = 1024 * 1024


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes (Linux /proc)."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) * 1024
    return out


class _Tick(TransactionContext):
    def __init__(self, partition: int, done: asyncio.Future[bool]) -> None:
        super().__init__()
        self.partition, self.done = partition, done

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data(b"tick")
        return True

    def on_completion(self, result: bool) -> None:
        if not self.done.done():
            self.done.set_result(result)


async def recovery_after_kill(spec: ClusterSpec, cluster: ProcessCluster, partitions: int) -> dict[str, Any]:
    """Kill -9 the server owning partition 0 under a commit loop on every partition."""
    assert spec.coordination is not None
    backend = open_coordination(spec.coordination, spec.runtime.registries)
    await backend.start()
    try:
        assignment, _ = await read_assignment(backend, spec.coordination.root)
    finally:
        await backend.close()
    owner = next(p.endpoint for p in assignment.partitions if p.partition_id == 0)
    victim = next(i for i, node in enumerate(spec.servers) if node.address == owner)
    owned = sorted(p.partition_id for p in assignment.partitions if p.endpoint == owner)
    client: AsyncWaltzClient = await start_client(spec.client_config(), range(partitions), in_flight=1)
    last: dict[int, float] = {}
    first_after: dict[int, float] = {}
    killed_at: float | None = None
    stop = asyncio.Event()

    async def loop(pid: int) -> None:
        while not stop.is_set():
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            submitted = time.monotonic()
            await client.submit(_Tick(pid, done))
            if await done:
                now = time.monotonic()
                last[pid] = now
                # Only a transaction submitted after the kill counts: one the dead server had
                # already committed may still be confirmed by feed bytes that were on the wire.
                if killed_at is not None and submitted > killed_at and pid not in first_after:
                    first_after[pid] = now

    tasks = [asyncio.ensure_future(loop(p)) for p in range(partitions)]
    try:
        await asyncio.sleep(3)
        killed_at = time.monotonic()
        cluster.kill_server(victim, signal.SIGKILL)
        deadline = killed_at + 120
        while not all(p in first_after for p in owned) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        await client.close()
    waits = sorted(first_after[p] - killed_at for p in owned if p in first_after)
    return {"server": f"server-{victim}", "partitions_moved": len(owned), "recovered": len(waits),
            "first_s": round(waits[0], 2) if waits else None,
            "median_s": round(statistics.median(waits), 2) if waits else None,
            "last_s": round(waits[-1], 2) if waits else None}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="waltz-scale-"))
    budgets = {"feed_cache_budget": args.feed_budget * MIB, "data_cache_budget": args.data_budget * MIB,
               "replication_buffer_budget": args.replication_budget * MIB}
    spec = ClusterSpec(directory, num_partitions=args.partitions, num_storages=3, num_servers=2, http=True,
                       server_overrides=budgets)
    cluster = ProcessCluster(spec)
    report: dict[str, Any] = {"partitions": args.partitions, "storages": 3, "servers": 2,
                              "budgets_mib": {k: v // MIB for k, v in budgets.items()}}
    try:
        began = time.monotonic()
        await cluster.start()
        await wait_served(spec.client_config(), args.partitions, 300)
        report["start_s"] = round(time.monotonic() - began, 2)
        print(f"started: {report['start_s']} s", file=sys.stderr)
        servers = {f"server-{i}": p.pid for i, p in cluster.servers.items()}
        report["rss_idle_mib"] = {name: round(memory(pid)["VmRSS"] / MIB, 1) for name, pid in servers.items()}
        pids = {"server": list(servers.values()), "storages": [p.pid for p in cluster.storages.values()]}
        rows = []
        for active in args.active:
            in_flight = max(1, args.outstanding // active)
            result = await produce(spec.client_config(), ProduceOptions(
                partitions=active, in_flight=in_flight, duration=args.duration, warmup=1.0, seed=1),
                processes=pids)
            lat = result.latency.summary_ms()
            rows.append({"active": active, "in_flight_per_partition": in_flight,
                         "txn_per_s": round(result.txn_per_s, 1), "p50_ms": lat["p50"], "p99_ms": lat["p99"],
                         "cpu_us_per_txn": result.cpu_us_per_txn,
                         "server_rss_mib": [round(memory(pid)["VmRSS"] / MIB, 1) for pid in servers.values()]})
            print(f"{active} active: {result.txn_per_s:,.0f} txn/s p50 {lat['p50']} p99 {lat['p99']} ms, "
                  f"server RSS {rows[-1]['server_rss_mib']} MiB", file=sys.stderr)
        report["throughput"] = rows
        # Fill the cache budgets: 4 KiB transactions on every partition.
        await produce(spec.client_config(), ProduceOptions(partitions=args.partitions, in_flight=1, txn_size=4096,
                                                           duration=args.fill_duration, warmup=0.0, seed=2))
        report["memory_after_fill_mib"] = {
            name: {k: round(v / MIB, 1) for k, v in memory(pid).items()} for name, pid in servers.items()}
        print(f"memory: {report['rss_idle_mib']} -> {report['memory_after_fill_mib']}", file=sys.stderr)
        report["recovery_after_server_kill"] = await recovery_after_kill(spec, cluster, args.partitions)
        print(f"recovery: {report['recovery_after_server_kill']}", file=sys.stderr)
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return report


def markdown(report: dict[str, Any]) -> str:
    b = report["budgets_mib"]
    lines = [f"{report['partitions']} partitions, 3 storage nodes, 2 servers (one machine, 2 cores, embedded "
             f"coordination); server budgets: feed {b['feed_cache_budget']} MiB, data {b['data_cache_budget']} MiB, "
             f"replication {b['replication_buffer_budget']} MiB", "",
             f"- time to start (launch to every partition mountable): **{report['start_s']} s**", ""]
    rec = report.get("recovery_after_server_kill")
    if rec:
        lines += [f"- kill -9 of {rec['server']} ({rec['partitions_moved']} partitions): every one committed again "
                  f"after {rec['first_s']} / {rec['median_s']} / **{rec['last_s']} s** (first / median / last; "
                  f"{rec['recovered']} of {rec['partitions_moved']} recovered)", ""]
    lines += ["| active partitions | in flight each | txn/s | p50 ms | p99 ms | CPU us/txn (client / server / storages) "
              "| servers' VmRSS after |",
              "|---|---|---|---|---|---|---|"]
    for r in report["throughput"]:
        cpu = r["cpu_us_per_txn"] or {}
        lines.append(f"| {r['active']} | {r['in_flight_per_partition']} | {r['txn_per_s']:,.0f} | {r['p50_ms']} | "
                     f"{r['p99_ms']} | {' / '.join(f'{v:.0f}' for v in cpu.values())} | "
                     f"{' / '.join(f'{v} MiB' for v in r['server_rss_mib'])} |")
    lines += ["", "| server | VmRSS idle (all partitions open) | VmRSS after filling the budgets | VmHWM (peak) |",
              "|---|---|---|---|"]
    for name, idle in report["rss_idle_mib"].items():
        after = report["memory_after_fill_mib"][name]
        lines.append(f"| {name} | {idle} MiB | {after['VmRSS']} MiB | {after['VmHWM']} MiB |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--partitions", type=int, default=256)
    parser.add_argument("--active", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256],
                        help="comma-separated numbers of active partitions (default 16,64,256)")
    parser.add_argument("--outstanding", type=int, default=256, help="transactions in flight in all")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per throughput run")
    parser.add_argument("--fill-duration", type=float, default=20.0, help="seconds of 4 KiB load to fill the caches")
    parser.add_argument("--feed-budget", type=int, default=16, help="server.feed_cache_budget, MiB")
    parser.add_argument("--data-budget", type=int, default=64, help="server.data_cache_budget, MiB")
    parser.add_argument("--replication-budget", type=int, default=16, help="server.replication_buffer_budget, MiB")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.partitions < 1 or any(a < 1 or a > args.partitions for a in args.active):
        parser.error("--active values must be between 1 and --partitions")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    try:
        figures = asyncio.run(main(arguments))
    except WaltzError as exc:  # e.g. a shape that committed nothing: no figures of zeros
        sys.exit(f"scale.py: {exc}")
    print(markdown(figures))
    if arguments.json:
        arguments.json.write_text(json.dumps(figures, indent=2))
