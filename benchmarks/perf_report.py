"""Every figure of docs/performance.md from one run: the etcd and ZooKeeper side-by-side, then the producer
and consumer shapes of docs/performance.md on throw-away local clusters, printed as Markdown tables.

    python benchmarks/perf_report.py                 # ~5 minutes on 2 cores
    python benchmarks/perf_report.py --json out.json

Shapes (256 B, 3 storage processes, quorum 2, fdatasync, TCP, one server):

* comparison with etcd and ZooKeeper: ``compare_etcd.main`` (interleaved rounds Waltz, etcd, ZooKeeper,
  medians, ratios; the ``comparison`` key of the JSON);
* the shapes the targets compare, interleaved ``--repeat`` times, each reported as its median run:
  1 partition with 64 in flight (the maximum throughput), the same with a lock pool of 128
  (optimistic-lock retries), 4 partitions with 16 in flight each (64 outstanding as above);
* 1 partition, 1 in flight: unloaded latency;
* 1 partition, open loop (Poisson) at ``--load`` (70 %) of that maximum: latency under load;
* the disk's share of the open loop's latency, right after it (``waltz_core.perf.diskfloor``:
  the open loop's rate and records, 3 writers running a storage node's rounds on the temp
  directory's disk as often as the open loop's storages did, a commit durable on 2 of them; no
  Waltz code runs);
* the other share: the same open loop on a cluster whose files are on tmpfs (``/dev/shm``, if it
  has 1 GiB free), where an fdatasync costs nothing;
* each of these three runs ``--repeat`` times and is reported as its run of median p99.9, with
  every run's p99.9: one run's tail moves by several milliseconds from the next's on a shared
  machine. The open loops on the disk run on the cluster of the 1-partition shapes, whose node
  journals are past their first generation (a new node's growing journal writes zeros ahead of
  its rounds);
* 64 partitions with 1 in flight each, 256 with 1 each;
* consumer: feed only and feed + data over ``--populate`` transactions.

The machine's speed is measured before and after (``waltz_core.perf.machine``: a Python mix, a
process wake-up round trip, fdatasyncs/s in the temp directory the clusters use) and printed
first: absolute figures of two reports compare only if those do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from waltz_core.errors import WaltzError
from waltz_core.eventloop import event_loop_from_env, loop_name, run
from waltz_core.perf import diskfloor
from waltz_core.perf.cluster import local_cluster
from waltz_core.perf.driver import ProduceOptions, ProduceResult, consume, produce
from waltz_core.perf.machine import MachineSpeed
from waltz_core.perf.machine import measure as measure_machine
from waltz_core.protocol.wire import STORED_RECORD_OVERHEAD

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_etcd  # the sibling benchmark script (E402 allows imports after sys.path edits)


def _produce_row(name: str, r: ProduceResult) -> dict[str, Any]:
    lat = r.latency.summary_ms()
    return {"shape": name, "txn_per_s": round(r.txn_per_s, 1), "mb_per_s": round(r.mb_per_s, 3),
            "retries_per_txn": round(r.retries_per_txn, 4), "lock_failures": r.lock_failures, "latency_ms": lat,
            "records_per_fdatasync": round(r.storage.records_per_sync, 2)
            if r.storage and r.storage.records_per_sync else None, "cpu_us_per_txn": r.cpu_us_per_txn,
            "host_cpu": r.host_cpu}


#: The shapes the targets compare with each other: (name, partitions, options). They run
#: interleaved, --repeat times each, on clusters kept up side by side, and each is reported as its
#: median run: this shared machine drifts by tens of percent between runs, more than one run apart
#: can tell from a change.
COMPARED: tuple[tuple[str, int, dict[str, int]], ...] = (
    ("1 partition, 64 in flight (closed loop)", 1, {"in_flight": 64}),
    ("1 partition, 64 in flight, lock pool 128", 1, {"in_flight": 64, "lock_pool": 128}),
    ("4 partitions, 16 in flight each", 4, {"partitions": 4, "in_flight": 16}),
)


def _median_index(values: list[float]) -> int:
    """Where the median of ``values`` is (the upper one of an even count)."""
    return sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]


def _median_row(name: str, results: list[ProduceResult]) -> tuple[ProduceResult, dict[str, Any]]:
    """The run of median rate, with every run's rate and total CPU per transaction in its row."""
    median = results[_median_index([r.txn_per_s for r in results])]
    row = _produce_row(name, median)
    if len(results) > 1:
        row["shape"] += f", median of {len(results)}"
        row["runs_txn_per_s"] = [round(r.txn_per_s, 1) for r in results]
        row["runs_cpu_us_per_txn"] = [round(sum(r.cpu_us_per_txn.values()), 1) if r.cpu_us_per_txn else None
                                      for r in results]
    return median, row


def _median_tail_row(name: str, results: list[ProduceResult]) -> dict[str, Any]:
    """The run of median p99.9, with every run's p99.9 in its row (``runs_p99.9_ms``) and the
    share of the machine's CPU time stolen by the hypervisor during it (``runs_steal_percent``):
    the CPU part of the tail moves with it."""
    tails = [r.latency.summary_ms()["p99.9"] for r in results]
    row = _produce_row(name, results[_median_index(tails)])
    if len(results) > 1:
        row["shape"] += f", median of {len(results)} by p99.9"
        row["runs_p99.9_ms"] = tails
        row["runs_steal_percent"] = [r.host_cpu["steal_percent"] if r.host_cpu else None for r in results]
    return row


async def _disk_floor(args: argparse.Namespace, rate: float, open_loop: ProduceResult) -> diskfloor.DiskFloor:
    """The disk's share of the open loop's latency, right after it: its rate and records, and
    rounds as far apart as its storages' were (their records per fdatasync), without Waltz."""
    per_round = open_loop.storage.records_per_sync if open_loop.storage else None
    floor = await asyncio.to_thread(diskfloor.measure, tempfile.gettempdir(), writers=3, quorum=2, rate=rate,
                                    seconds=args.duration, record_size=256 + STORED_RECORD_OVERHEAD,
                                    round_interval=per_round / rate if per_round else 0.0)
    print(f"  the disk alone: {floor.summary()}", file=sys.stderr)
    return floor


#: Where the open loop runs again with its files in memory; see _no_tmpfs.
MEMORY_DIRECTORY = Path("/dev/shm")
#: Free bytes the in-memory run needs (a container's /dev/shm is often 64 MiB).
MEMORY_NEEDED = 1 << 30
#: How the in-memory run's shape ends (the open loop on the disk is the other "1 partition, open loop")
IN_MEMORY = ", files on tmpfs (no disk)"


def _no_tmpfs(directory: Path) -> str | None:
    """Why the in-memory open loop cannot run in ``directory``, or None if it can."""
    try:
        stat = os.statvfs(directory)
    except OSError as exc:
        return f"{directory}: {exc.strerror}"
    free = stat.f_bavail * stat.f_frsize
    if free < MEMORY_NEEDED:
        return f"{directory} has {free >> 20:,} MiB free, it needs {MEMORY_NEEDED >> 20:,}"
    return None


async def _produce_shapes(args: argparse.Namespace) -> tuple[list[dict[str, Any]], diskfloor.DiskFloor, list[float]]:
    """The producer shapes' rows; the disk alone (its median run by p99.9) and every run's p99.9."""
    rows = []

    async def measure(cluster: Any, **kw: Any) -> ProduceResult:
        options = ProduceOptions(duration=args.duration, warmup=args.warmup, seed=1, **kw)
        pids = {"server": cluster.server_pids, "storages": cluster.storage_pids}
        return await produce(cluster.client_config, options, metrics_urls=cluster.metrics_urls, processes=pids)

    def report(name: str, result: ProduceResult) -> None:
        print(f"  {name}: {result.txn_per_s:,.0f} txn/s, p50 {result.latency.summary_ms()['p50']} ms, "
              f"p99 {result.latency.summary_ms()['p99']} ms", file=sys.stderr)

    async with local_cluster(1) as one:
        runs: dict[str, list[ProduceResult]] = {name: [] for name, _, _ in COMPARED}
        async with local_cluster(4) as four:
            clusters = {1: one, 4: four}
            for i in range(args.repeat):
                for name, partitions, kw in (COMPARED if i % 2 == 0 else COMPARED[::-1]):
                    runs[name].append(result := await measure(clusters[partitions], **kw))
                    report(name, result)
        medians = {}
        for name, _, _ in COMPARED:
            medians[name], row = _median_row(name, runs[name])
            rows.append(row)
        rate = round(medians[COMPARED[0][0]].txn_per_s * args.load, -1)
        # The latency shapes run with no other cluster up: an idle cluster's processes would still
        # take the cores now and then, and the open loop's tail is what they would show.
        name = "1 partition, 1 in flight (unloaded)"
        rows.append(_produce_row(name, result := await measure(one, in_flight=1)))
        report(name, result)
        # The open loop's p99.9 moves by several milliseconds from run to run on a shared machine:
        # it runs --repeat times. On this cluster, whose closed loops took its node journals past
        # their first generation, as a node runs for most of its life: a new node's growing
        # journal writes zeros ahead of its rounds, on the same disk (docs/storage.md).
        on_disk = f"1 partition, open loop {rate:,.0f}/s ({args.load:.0%} of the maximum)"
        loops: list[ProduceResult] = []
        for _ in range(args.repeat):
            # submit() waits for a slot above max_concurrent_transactions: give the open loop room
            loops.append(result := await measure(one, rate=rate, in_flight=1024))
            report(on_disk, result)
    rows.append(_median_tail_row(on_disk, loops))
    # Its two parts, each reported as its run of median p99.9 too: the disk alone at each run's
    # rate and rounds (no cluster up), and the same open loop on a cluster whose files are in
    # memory (tmpfs: its fdatasyncs cost nothing, what is left is CPU and hand-offs).
    floors = [await _disk_floor(args, rate, loop) for loop in loops]
    floor_runs = [f.commit_ms["p99.9"] for f in floors]
    floor = floors[_median_index(floor_runs)]
    no_disk = f"1 partition, open loop {rate:,.0f}/s{IN_MEMORY}"
    if (skipped := _no_tmpfs(MEMORY_DIRECTORY)) is None:
        async with local_cluster(1, keep_dir=MEMORY_DIRECTORY) as in_memory:
            memory_runs = []
            for _ in range(args.repeat):
                memory_runs.append(result := await measure(in_memory, rate=rate, in_flight=1024))
                report(no_disk, result)
        rows.append(_median_tail_row(no_disk, memory_runs))
    else:
        print(f"  {no_disk}: not run, {skipped}", file=sys.stderr)
    # Many partitions: the same 64 transactions outstanding over 64 partitions, then 256 partitions
    # with one each (256 outstanding).
    for partitions in (64, 256):
        async with local_cluster(partitions) as cluster:
            name = f"{partitions} partitions, 1 in flight each"
            rows.append(_produce_row(name, result := await measure(cluster, partitions=partitions, in_flight=1)))
            report(name, result)
    return rows, floor, floor_runs


def _targets(report: dict[str, Any]) -> list[str]:
    """The performance issue's targets, as ratios of this run's own figures."""
    rows = report["produce"]

    def row(prefix: str) -> dict[str, Any]:
        return next(r for r in rows if r["shape"].startswith(prefix) and IN_MEMORY not in r["shape"])

    peak, locked = row("1 partition, 64 in flight (closed"), row("1 partition, 64 in flight, lock pool")
    spread, open_loop = row("4 partitions, 16"), row("1 partition, open loop")

    def ratio(of: dict[str, Any]) -> str:
        """Of the medians, then of each interleaved round's pair."""
        text = f"{of['txn_per_s'] / peak['txn_per_s']:.0%}"
        pairs = list(zip(of.get("runs_txn_per_s", []), peak.get("runs_txn_per_s", []), strict=False))
        if len(pairs) > 1:
            text += " (rounds: " + ", ".join(f"{a / b:.0%}" for a, b in pairs) + ")"
        return text

    runs_cpu = sorted(c for c in peak.get("runs_cpu_us_per_txn", []) if c is not None)
    if len(runs_cpu) > 1:
        total = f"{runs_cpu[len(runs_cpu) // 2]:.1f} µs (median; runs {', '.join(f'{c:.1f}' for c in runs_cpu)})"
    else:
        cpu = peak["cpu_us_per_txn"]
        total = f"{sum(cpu.values()):.1f} µs" if cpu else "unknown"
    comp = report["comparison"]
    in_memory = next((r for r in rows if IN_MEMORY in r["shape"]), None)
    parts = "the disk alone, at its rate and rounds: " + _tail(report["disk_floor"]["commit_ms"]["p99.9"],
                                                              report.get("disk_floor_runs_p99.9_ms", []))
    if in_memory:
        parts += "; the cluster with its files on tmpfs: " + _tail(in_memory["latency_ms"]["p99.9"],
                                                                   in_memory.get("runs_p99.9_ms", []),
                                                                   in_memory.get("runs_steal_percent"))
    out = ["| target | this run |", "|---|---|",
           f"| lock pool 128 / no locks, 64 in flight (≥ 60 %) | {ratio(locked)} |",
           f"| 4 partitions x 16 / 1 partition x 64 (≥ 100 %) | {ratio(spread)} |",
           f"| open loop at {_load_of(open_loop)}: p99.9 (≤ 10 ms) | "
           f"{_tail(open_loop['latency_ms']['p99.9'], open_loop.get('runs_p99.9_ms', []), open_loop.get('runs_steal_percent'))}"
           f" ({parts}) |",
           f"| CPU per transaction, all processes, 64 in flight (≤ 25 µs) | {total} |"]
    for peer in comp["peers"]:
        goal = "≥ 6x" if peer == "etcd" else "reported"
        out.append(f"| Waltz / {compare_etcd.NAMES[peer]} ({goal}) | {comp[f'ratio_waltz_over_{peer}']:.2f}x |")
    return out


def _tail(p999: float, runs: list[float], steals: list[float | None] | None = None) -> str:
    """A p99.9 in ms, and with several runs, that it is their median and what each gave (with
    the hypervisor's steal during each, where known)."""
    if len(runs) < 2:
        return f"{p999} ms"
    if steals is not None and len(steals) == len(runs) and all(s is not None for s in steals):
        each = [f"{r} at {s} % steal" for r, s in sorted(zip(runs, steals, strict=True))]
    else:
        each = [f"{r}" for r in sorted(runs)]
    return f"{p999} ms (median; runs {', '.join(each)})"


def _host(host: dict[str, float] | None) -> str:
    return f"{host['busy_percent']:.1f} / {host['steal_percent']:.1f}" if host else "-"


def _runs_note(runs: list[float]) -> str:
    """The end of the disk alone's sentence: which of several runs it is."""
    if len(runs) < 2:
        return "."
    return f" (the median of {len(runs)} runs by p99.9; their p99.9: {', '.join(f'{r} ms' for r in runs)})."


def _load_of(row: dict[str, Any]) -> str:
    """The load of the open-loop row, as its shape names it."""
    shape: str = row["shape"]
    return shape[shape.index("(") + 1:shape.index(" of the maximum")] if "(" in shape else "?"


async def _consume_shapes(args: argparse.Namespace) -> list[dict[str, Any]]:
    async with local_cluster(1) as cluster:
        await produce(cluster.client_config, ProduceOptions(in_flight=64, duration=None, count=args.populate, warmup=0))
        out = []
        for with_data in (False, True):
            result = await consume(cluster.client_config, 0, with_data=with_data)
            out.append(result.to_json())
            print(f"  {result.report()}", file=sys.stderr)
        return out


def _markdown(report: dict[str, Any]) -> str:
    lines = []
    comp = report["comparison"]
    settings = comp["settings"]
    peers = comp["peers"]
    names = compare_etcd.NAMES
    lines += [f"### {' vs '.join(names[s] for s in ('waltz', *peers))}, closed loop, "
              f"{settings['concurrency']} outstanding conditional writes, {settings['record_size']} B, "
              f"{settings['rounds']} x {settings['duration']:g} s interleaved", "",
              "CPU µs/write: Waltz client / server / storages; etcd and ZooKeeper client / members (sum of the 3).", "",
              "| round | system | writes/s | p50 / p99 / p99.9 ms | CPU µs/write | failed writes |",
              "|---|---|---|---|---|---|"]

    def lat(x: dict[str, float]) -> str:
        return f"{x['p50']:.2f} / {x['p99']:.2f} / {x['p99.9']:.2f}"

    def cpu(x: dict[str, float] | None) -> str:
        return " / ".join(f"{v:.0f}" for v in x.values()) if x else "unknown"

    for i, r in enumerate(comp["rounds"], 1):
        for system in ("waltz", *peers):
            x = r[system]
            lines.append(f"| {i} | {names[system]} | {x['ops_per_s']:,.0f} | {lat(x['latency_ms'])} "
                         f"| {cpu(x.get('cpu_us_per_op'))} | {compare_etcd.failures(x)} |")
    med = comp["median"]
    for system in ("waltz", *peers):
        m = med[system]
        lines.append(f"| **median** | **{names[system]}** | **{m['ops_per_s']:,.0f}** | {m['p50_ms']:.2f} / "
                     f"{m['p99_ms']:.2f} / - | {cpu(m.get('cpu_us_per_op'))} | |")
    ratios = ", ".join(f"Waltz / {names[p]}: {comp[f'ratio_waltz_over_{p}']:.2f}x" for p in peers)
    lines += ["", f"**Ratio of the medians: {ratios}**", "",
              "### `waltz perf produce` (1 client, 256 B)", "",
              "| shape | txn/s | MB/s | retries/txn | p50 | p90 | p99 | p99.9 | records/fdatasync "
              "| CPU us/txn client / server / storages | machine busy / steal % |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["produce"]:
        x = r["latency_ms"]
        runs = r.get("runs_txn_per_s")
        rate = f"{r['txn_per_s']:,.0f}" + (f" ({', '.join(f'{v:,.0f}' for v in runs)})" if runs and len(runs) > 1 else "")
        lines.append(f"| {r['shape']} | {rate} | {r['mb_per_s']:.2f} | {r['retries_per_txn']:.4f} "
                     f"| {x['p50']} | {x['p90']} | {x['p99']} | {x['p99.9']} | {r['records_per_fdatasync']} "
                     f"| {cpu(r['cpu_us_per_txn'])} | {_host(r.get('host_cpu'))} |")
    lines += ["", "### The disk's share of the open loop's latency (its rate and rounds, no Waltz code)", "",
              diskfloor.DiskFloor(**report["disk_floor"]).summary() + _runs_note(report.get("disk_floor_runs_p99.9_ms", [])),
              "", "### Against the targets (ratios of this run)", "", *_targets(report)]
    lines += ["", "### `waltz perf consume` (partition 0)", "", "| mode | transactions | rate |", "|---|---|---|"]
    for c in report["consume"]:
        unit = "headers/s" if c["mode"] == "feed" else f"transactions/s, {c['mb_per_s']} MB/s"
        lines.append(f"| {c['mode']} | {c['transactions']:,} | {c['per_s']:,.0f} {unit} |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = os.getloadavg()
    print("machine speed", file=sys.stderr)
    machine_before = measure_machine(tempfile.gettempdir())
    print("side by side: Waltz, etcd, ZooKeeper", file=sys.stderr)
    comparison = await compare_etcd.main(argparse.Namespace(rounds=args.rounds, duration=args.duration,
                                                            warmup=args.warmup, concurrency=64, record_size=256,
                                                            peers=list(compare_etcd.PEERS)))
    print("producer shapes", file=sys.stderr)
    produce_rows, floor, floor_runs = await _produce_shapes(args)
    print("consumer", file=sys.stderr)
    consume_rows = await _consume_shapes(args)
    machine_after = measure_machine(tempfile.gettempdir())
    return {"started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "cores": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
            "event_loop": loop_name(),
            "machine_before": machine_before.to_json(), "machine_after": machine_after.to_json(),
            "comparison": comparison, "produce": produce_rows, "disk_floor": floor.to_json(),
            "disk_floor_runs_p99.9_ms": floor_runs,
            "consume": consume_rows}


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=compare_etcd.positive_int, default=3,
                        help="interleaved Waltz/etcd/ZooKeeper rounds")
    parser.add_argument("--duration", type=compare_etcd.positive_float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=compare_etcd.non_negative_float, default=2.0)
    parser.add_argument("--load", type=compare_etcd.positive_float, default=0.7,
                        help="open-loop rate as a fraction of the maximum")
    parser.add_argument("--repeat", type=compare_etcd.positive_int, default=3,
                        help="interleaved runs of each shape the targets compare (median reported)")
    parser.add_argument("--populate", type=compare_etcd.positive_int, default=100_000,
                        help="transactions written before consuming")
    parser.add_argument("--json", metavar="FILE", help="also write the whole report as JSON")
    args = parser.parse_args()
    logging.getLogger("waltz.client").addFilter(lambda record: "not encrypted" not in record.getMessage())
    try:
        report = run(main(args), event_loop_from_env())  # the loop of the nodes too (WALTZ_PROCESS_EVENT_LOOP)
    except WaltzError as exc:  # e.g. a shape that committed nothing: no report of zeros
        sys.exit(f"perf_report: {exc}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"Run {report['started']} - {report['finished']}, {report['cores']} cores, load average "
          f"{report['load_before'][0]:.2f} before, {report['load_after'][0]:.2f} after, event loop "
          f"{report['event_loop']}\n")
    print(f"Machine before: {MachineSpeed(**report['machine_before']).summary()}\n")
    print(f"Machine after: {MachineSpeed(**report['machine_after']).summary()}\n")
    print(_markdown(report))


if __name__ == "__main__":
    cli()
