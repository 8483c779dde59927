"""Where a latency tail comes from: line the slowest transactions up with every process's events.

    python benchmarks/tail_timeline.py DIR                     # analyse the dumps of a run in DIR
    python benchmarks/tail_timeline.py DIR --run --rate 10000  # first run an open loop with a timeline
    python benchmarks/tail_timeline.py DIR --quantile 0.99 --worst 10 --json

``--run`` runs ``waltz perf produce --local --timeline DIR`` (1 partition, Poisson arrivals at
``--rate``, ``--in-flight`` slots, ``--duration`` s after ``--warmup`` s): the client, the server
and the 3 storages each dump their events in DIR when they exit (see waltz_core/perf/timeline.py
and docs/performance.md, "Where the tail comes from"). Without ``--run``, DIR holds the dumps of an
earlier run (``--timeline DIR``, or processes started with ``WALTZ_TIMELINE_DIR=DIR``).

Prints, per process, the GC collections, event-loop stalls and slow fdatasync calls of the measured
window, then the causes of the tail: for each, the share of tail transactions it overlapped against
the share of median transactions it overlapped (the control), the tail transactions where it was
the largest overlap (primary), and its time inside tail transactions as a share of their latency
above the median; then the slowest transactions with every event that overlapped them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from waltz_core.perf.timeline import TimelineError, analyse, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="timeline directory (written by --run, or by an earlier run)")
    parser.add_argument("--run", action="store_true", help="run an open loop on a --local cluster first")
    parser.add_argument("--rate", type=float, default=10000.0, help="--run: transactions/s (Poisson)")
    parser.add_argument("--in-flight", type=int, default=1024, help="--run: client slots")
    parser.add_argument("--duration", type=float, default=10.0, help="--run: measured seconds")
    parser.add_argument("--warmup", type=float, default=2.0, help="--run: seconds not measured")
    parser.add_argument("--quantile", type=float, default=0.999, help="the tail: transactions at or above it")
    parser.add_argument("--sync-ms", type=float, default=2.0, help="an fdatasync this long or longer is a cause")
    parser.add_argument("--worst", type=int, default=8, help="print this many slowest transactions with their events")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the text report")
    args = parser.parse_args(argv)
    for name in ("rate", "duration", "sync_ms"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.in_flight < 1 or args.worst < 0 or args.warmup < 0:
        parser.error("--in-flight must be >= 1, --worst and --warmup >= 0")
    if not 0 < args.quantile < 1:
        parser.error("--quantile must be between 0 and 1 (e.g. 0.999)")
    if args.run:
        cmd = [sys.executable, "-m", "waltz_core.cli", "perf", "produce", "--local", "--timeline", str(args.directory),
               "--rate", f"{args.rate:g}", "--in-flight", str(args.in_flight), "--duration", f"{args.duration:g}",
               "--warmup", f"{args.warmup:g}", "--tail-quantile", f"{args.quantile:g}"]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            print(done.stdout, end="")
            return done.returncode
        if not args.json:  # the run's own report (figures), then the analysis below
            print(_figures(done.stdout))
    try:
        report = analyse(load(args.directory), quantile=args.quantile, sync_threshold=args.sync_ms / 1e3)
    except TimelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print("\n".join(report.lines(worst=args.worst)))
    return 0


def _figures(stdout: str) -> str:
    """The run's figures (the produce report), without its own timeline section."""
    lines = stdout.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("timeline:")), len(lines))
    return "\n".join(lines[:end]).rstrip() + "\n"


if __name__ == "__main__":
    sys.exit(main())
