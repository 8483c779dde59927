"""A timeline of what every process of a benchmark did, to explain a latency tail with evidence.

When enabled (``WALTZ_TIMELINE_DIR=DIR`` in the environment of a ``waltz`` process, or
``waltz perf produce --timeline DIR``, which sets it for the processes of a ``--local`` cluster
too), each process records cheap timestamped events in memory and writes them to
``DIR/<label>-<pid>.json`` when it exits:

* **GC collections** (``gc.callbacks``): start, end, generation, objects collected;
* **event-loop stalls**: a watchdog callback runs every ``interval`` (1 ms) on every event loop
  the main thread creates; when it runs more than ``threshold`` (2 ms) late, the lateness is
  recorded with what the loop's thread did meanwhile, from ``/proc/thread-self/schedstat``:
  CPU time (the loop was busy: synchronous work or a GC), run-queue wait (it was runnable but
  another process had the CPU) and the rest (blocked in a system call, or sleeping);
* **fdatasync calls** (``os.fdatasync`` wrapped at start; storages sync on their loop by default,
  ``io_threads = 0``, or in their I/O threads);
* in the client (:mod:`waltz_core.perf.driver`), each measured transaction's start (submit, or
  the open loop's scheduled arrival) and completion, and the measured window.

All timestamps are ``time.perf_counter()``: ``CLOCK_MONOTONIC`` on Linux, one clock for every
process of the machine, so events of different processes line up.

Disabled (the variable unset), nothing is installed: :func:`install_from_env` is one environment
look-up at process start, and no code path has a timeline branch per transaction (the driver picks
a recording subclass of its run once, at the start of a run).

:func:`analyse` then lines up the slowest transactions (the tail beyond a quantile, p99.9 by
default) with the events that overlapped them in every process and says which cause explains how
much of the tail, against a control group of median transactions (a cause that overlaps the tail
no more often than the median explains nothing). ``benchmarks/tail_timeline.py DIR`` prints it.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import gc
import json
import math
import os
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..eventloop import on_main_loop

ENV_DIR = "WALTZ_TIMELINE_DIR"
#: watchdog period and reporting threshold, seconds (``WALTZ_TIMELINE_STALL_MS`` overrides the threshold)
ENV_STALL_MS = "WALTZ_TIMELINE_STALL_MS"
ENV_TICK_MS = "WALTZ_TIMELINE_TICK_MS"  #: the watchdog's period (each tick is a wake-up of an idle loop)
WATCHDOG_INTERVAL = 0.001
STALL_THRESHOLD = 0.002
#: at most this many events of each kind are kept per process (the rest are counted as dropped)
MAX_EVENTS = 2_000_000


class TimelineError(ValueError):
    """A bad timeline setting or directory (reported as one line, no traceback)."""


# ================================================================================ recording


class Recorder:
    """The events of one process (lists of tuples; appends only, on the threads that see them)."""

    def __init__(self, directory: Path, label: str, *, interval: float = WATCHDOG_INTERVAL,
                 threshold: float = STALL_THRESHOLD) -> None:
        self.directory = directory
        self.label = label
        self.interval = interval
        self.threshold = threshold
        self.pid = os.getpid()
        self.gc: list[tuple[float, float, int, int, float]] = []  # start, end, generation, collected, CPU s
        #: due, ran, loop-thread CPU s, run-queue wait s (both since the previous tick), previous tick
        self.stalls: list[tuple[float, float, float, float, float]] = []
        self.syncs: list[tuple[float, float]] = []  # fdatasync start, end
        #: client: start, completion, start, completion, ... (a flat array: no object per transaction
        #: for the client's own GC to traverse)
        self.txns = array("d")
        self.marks: dict[str, float] = {}
        self.notes: dict[str, Any] = {}
        self.dropped = 0
        self._gc_start = self._gc_cpu = 0.0
        self.started = time.perf_counter()
        self._schedstat_fd: int | None = None
        self._dumped = False

    # ---------------------------------------------------------------- GC

    def gc_callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_cpu = time.thread_time()
            self._gc_start = time.perf_counter()
            return
        end = time.perf_counter()
        if len(self.gc) < MAX_EVENTS:
            # wall time (what a transaction waits) and the thread's CPU time (a pause longer than its
            # CPU was preempted: the machine's other processes had the cores)
            self.gc.append((self._gc_start, end, info["generation"], info["collected"], time.thread_time() - self._gc_cpu))
        else:
            self.dropped += 1

    # ---------------------------------------------------------------- fdatasync

    def wrap_fdatasync(self, real: Callable[[Any], None]) -> Callable[[Any], None]:
        syncs, clock = self.syncs, time.perf_counter

        def fdatasync(fd: Any) -> None:
            t0 = clock()
            try:
                real(fd)
            finally:
                if len(syncs) < MAX_EVENTS:
                    syncs.append((t0, clock()))

        fdatasync.__wrapped__ = real  # type: ignore[attr-defined]
        return fdatasync

    # ---------------------------------------------------------------- event-loop watchdog

    def _sched(self) -> tuple[float, float]:
        """(CPU s, run-queue wait s) of the calling thread so far."""
        fd = self._schedstat_fd
        if fd is not None:
            try:
                run_ns, wait_ns, _ = os.pread(fd, 128, 0).split(None, 2)
                return int(run_ns) / 1e9, int(wait_ns) / 1e9
            except (OSError, ValueError):
                pass
        return time.thread_time(), 0.0

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the stall watchdog on ``loop`` (from its first iteration on)."""
        loop.call_soon(self._start_watchdog, loop)

    def _start_watchdog(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._schedstat_fd is None:
            try:
                # the loop's thread: this callback runs on it
                self._schedstat_fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
                self.notes["schedstat"] = True
            except OSError:
                self.notes["schedstat"] = False
        interval, threshold, stalls, clock, sched = self.interval, self.threshold, self.stalls, time.perf_counter, \
            self._sched
        state = [clock(), *sched()]  # previous tick's time, CPU, wait

        def tick() -> None:
            now = clock()
            due = state[0] + interval
            cpu, wait = sched()
            if now - due > threshold and len(stalls) < MAX_EVENTS:
                stalls.append((due, now, cpu - state[1], wait - state[2], state[0]))
            state[0], state[1], state[2] = now, cpu, wait
            if not loop.is_closed():
                loop.call_at(loop.time() + interval, tick)

        loop.call_at(loop.time() + interval, tick)

    # ---------------------------------------------------------------- client

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks[name] = time.perf_counter() if at is None else at

    # ---------------------------------------------------------------- output

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "pid": self.pid, "clock": "perf_counter",
                "started": self.started, "ended": time.perf_counter(),
                "wall_minus_clock": time.time() - time.perf_counter(),
                "gc_threshold": list(gc.get_threshold()), "gc_frozen": gc.get_freeze_count(),
                "gc_tracked": [len(gc.get_objects(g)) for g in range(3)],
                "watchdog_interval": self.interval, "stall_threshold": self.threshold,
                "gc": self.gc, "stalls": self.stalls, "syncs": self.syncs,
                "txns": [self.txns[i:i + 2].tolist() for i in range(0, len(self.txns), 2)],
                "marks": self.marks, "notes": self.notes, "dropped": self.dropped}

    def dump(self) -> Path | None:
        """Write ``<label>-<pid>.json`` (once; at exit). None if the directory is not writable."""
        if self._dumped:
            return None
        self._dumped = True
        path = self.directory / f"{self.label}-{self.pid}.json"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.to_json(), separators=(",", ":")))
            tmp.replace(path)
        except OSError as exc:
            print(f"waltz timeline: cannot write {path}: {exc}", file=sys.stderr)
            return None
        return path


_current: Recorder | None = None


def current() -> Recorder | None:
    """The recorder of this process, if the timeline is enabled."""
    return _current


class _RecordingPolicy(asyncio.DefaultEventLoopPolicy):
    """The default policy, plus the watchdog on every loop the main thread creates (``asyncio.run``)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        loop = super().new_event_loop()
        if threading.current_thread() is threading.main_thread():
            self.recorder.attach(loop)
        return loop


def _ms_from_env(name: str, default: float, environ: dict[str, str] | os._Environ[str]) -> float:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise TimelineError(f"{name}={raw!r}: give a number of milliseconds > 0 (e.g. {default * 1e3:g})")
    return value / 1e3


def stall_threshold_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """``WALTZ_TIMELINE_STALL_MS`` in seconds (default 2 ms)."""
    return _ms_from_env(ENV_STALL_MS, STALL_THRESHOLD, environ)


def watchdog_interval_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """``WALTZ_TIMELINE_TICK_MS`` in seconds (default 1 ms)."""
    return _ms_from_env(ENV_TICK_MS, WATCHDOG_INTERVAL, environ)


def check_directory(directory: str | Path) -> Path:
    """``directory`` made and writable, or :class:`TimelineError` saying why not."""
    path = Path(directory)
    if str(directory) == "":
        raise TimelineError(f"{ENV_DIR} is empty: give a directory, or unset it")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TimelineError(f"timeline directory {path}: {exc.strerror or exc}") from None
    if not path.is_dir() or not os.access(path, os.W_OK):
        raise TimelineError(f"timeline directory {path}: not a writable directory")
    return path


def install(directory: str | Path, label: str, *, interval: float | None = None,
            threshold: float | None = None) -> Recorder:
    """Start recording in this process (idempotent): GC callback, fdatasync wrapper, the watchdog
    on the main thread's next event loops (call before ``asyncio.run``), and a dump at exit."""
    global _current
    if _current is not None:
        return _current
    path = check_directory(directory)
    recorder = Recorder(path, label, interval=WATCHDOG_INTERVAL if interval is None else interval,
                        threshold=STALL_THRESHOLD if threshold is None else threshold)
    gc.callbacks.append(recorder.gc_callback)
    os.fdatasync = recorder.wrap_fdatasync(os.fdatasync)  # type: ignore[assignment]
    asyncio.set_event_loop_policy(_RecordingPolicy(recorder))  # asyncio.run
    on_main_loop(recorder.attach)  # eventloop.run (servers, storage nodes, waltz perf): asyncio or uvloop
    atexit.register(recorder.dump)
    _current = recorder
    return recorder


def process_label(argv: Sequence[str]) -> str:
    """``server-0`` / ``storage-1`` for ``... start --config .../server-0.toml``, else the command
    words (``perf-produce``)."""
    words: list[str] = []
    config: str | None = None
    options = False  # command words come before the command's options ("-v" is the group's)
    it = iter(argv)
    for arg in it:
        if arg in ("-c", "--config"):
            config = next(it, None)
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            options = options or bool(words)
        elif not options and len(words) < 2:
            words.append(arg)
    if config and words and words[-1] == "start":
        return Path(config).stem
    return "-".join(words) or "waltz"


def install_from_env(argv: Sequence[str] | None = None) -> Recorder | None:
    """At process start: install the recorder when ``WALTZ_TIMELINE_DIR`` is set (else nothing)."""
    directory = os.environ.get(ENV_DIR)
    if directory is None:
        return None
    return install(directory, process_label(sys.argv[1:] if argv is None else argv),
                   interval=watchdog_interval_from_env(), threshold=stall_threshold_from_env())


# ================================================================================ analysis


Interval = tuple[float, float]


@attrs.frozen
class Process:
    """The recorded events of one process (as loaded from its dump)."""

    label: str
    pid: int
    gc: list[tuple[float, float, int, int, float]]  # start, end, generation, collected, CPU s
    stalls: list[tuple[float, float, float, float, float]]
    syncs: list[tuple[float, float]]
    txns: list[tuple[float, float]]
    marks: dict[str, float]
    gc_threshold: tuple[int, ...] = ()
    gc_frozen: int = 0
    interval: float = WATCHDOG_INTERVAL
    alive: Interval = (-math.inf, math.inf)  #: from the recorder's start to the dump

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Process:
        return cls(label=str(data["label"]), pid=int(data["pid"]),
                   gc=[tuple(e) for e in data.get("gc", [])],
                   stalls=[tuple(e) for e in data.get("stalls", [])],
                   syncs=[tuple(e) for e in data.get("syncs", [])],
                   txns=[tuple(e) for e in data.get("txns", [])],
                   marks={str(k): float(v) for k, v in data.get("marks", {}).items()},
                   gc_threshold=tuple(data.get("gc_threshold", ())), gc_frozen=int(data.get("gc_frozen", 0)),
                   interval=float(data.get("watchdog_interval", WATCHDOG_INTERVAL)),
                   alive=(float(data.get("started", -math.inf)), float(data.get("ended", math.inf))))

    @property
    def name(self) -> str:
        return "client" if self.label.startswith("perf-") else self.label  # `waltz perf produce` run with the variable


def load(directory: str | Path) -> list[Process]:
    """Every process dump in ``directory`` (:class:`TimelineError` if there is none)."""
    path = Path(directory)
    if not path.is_dir():
        raise TimelineError(f"{path}: not a directory")
    out = []
    for f in sorted(path.glob("*.json")):
        try:
            out.append(Process.from_json(json.loads(f.read_text())))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TimelineError(f"{f}: not a timeline dump ({exc})") from None
    if not out:
        raise TimelineError(f"{path}: no timeline dumps (*.json); was {ENV_DIR} set for the run?")
    return out


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of ``intervals``."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def subtract(base: Sequence[Interval], cut: Sequence[Interval]) -> list[Interval]:
    """``base`` minus ``cut`` (both merged)."""
    out: list[Interval] = []
    j = 0
    for s, e in base:
        while j < len(cut) and cut[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(cut) and cut[k][0] < e:
            if cut[k][0] > cur:
                out.append((cur, cut[k][0]))
            cur = max(cur, cut[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def covered_by_at_least(sets: Sequence[Sequence[Interval]], n: int) -> list[Interval]:
    """Where at least ``n`` of the merged interval lists overlap (e.g. 2 of 3 replicas syncing slowly)."""
    points: list[tuple[float, int]] = []
    for intervals in sets:
        for s, e in intervals:
            points.append((s, 1))
            points.append((e, -1))
    points.sort(key=lambda p: (p[0], p[1]))
    out: list[Interval] = []
    depth, start = 0, 0.0
    for t, d in points:
        before = depth
        depth += d
        if before < n <= depth:
            start = t
        elif depth < n <= before and t > start:
            out.append((start, t))
    return merge(out)


class Cover:
    """A merged interval list with the overlap of any [s, e] in O(log n)."""

    def __init__(self, intervals: Iterable[Interval]) -> None:
        self.intervals = merge(intervals)
        self.starts = [s for s, _ in self.intervals]
        self.prefix = [0.0]
        for s, e in self.intervals:
            self.prefix.append(self.prefix[-1] + (e - s))

    def overlap(self, s: float, e: float) -> float:
        iv = self.intervals
        if not iv or e <= s:
            return 0.0
        i = max(0, bisect.bisect_right(self.starts, s) - 1)
        j = bisect.bisect_left(self.starts, e)  # intervals i..j-1 may overlap
        if j <= i:
            return 0.0
        total = self.prefix[j] - self.prefix[i]
        total -= max(0.0, min(s, iv[i][1]) - iv[i][0])  # the part of the first before s
        total -= max(0.0, iv[j - 1][1] - max(e, iv[j - 1][0]))  # the part of the last after e
        return max(0.0, total)


@attrs.frozen
class Cause:
    """One kind of event in one process (``gc2 server-0``), as intervals."""

    key: str
    process: str
    kind: str  # gc0/gc1/gc2, stall-busy, stall-runqueue, stall-blocked, fdatasync, fdatasync-quorum
    cover: Cover = attrs.field(eq=False, repr=False)
    count: int = 0
    total: float = 0.0
    longest: float = 0.0
    #: False for one replica's slow fdatasync: with a quorum of 2 it delays no commit by itself
    #: (the "on 2 replicas" cause does); shown, never the primary cause
    may_be_primary: bool = True
    cpu: float | None = None  #: GC: CPU time of the collecting thread (less than the total: preempted)


def _gc_causes(p: Process, lo: float, hi: float) -> tuple[list[Cause], list[Interval]]:
    out, every = [], []
    for gen in (0, 1, 2):
        events = [(s, e, cpu) for s, e, g, _, cpu in p.gc if g == gen and e >= lo and s <= hi]
        iv = [(s, e) for s, e, _ in events]
        every.extend(iv)
        if iv:
            durations = [e - s for s, e in iv]
            out.append(Cause(f"gc{gen} {p.name}", p.name, f"gc{gen}", Cover(iv), len(iv), sum(durations),
                             max(durations), cpu=sum(c for _, _, c in events)))
    return out, merge(every)


def _stall_intervals(p: Process, lo: float, hi: float, gc_cover: list[Interval]) -> dict[str, list[Interval]]:
    """Stalls minus their GC part, each classified by what its thread did since the tick before:
    busy (CPU), run queue (waiting for a CPU) or blocked (neither: a system call, a sleep, the
    GIL held by another thread, or the whole machine paused)."""
    kinds: dict[str, list[Interval]] = {"stall-busy": [], "stall-runqueue": [], "stall-blocked": []}
    gcs = Cover(gc_cover)
    for due, ran, cpu, wait, prev in p.stalls:
        if ran < lo or due > hi:
            continue
        rest = subtract([(due, ran)], gc_cover)
        if sum(e - s for s, e in rest) < 0.5 * (ran - due):
            continue  # mostly a GC pause: counted as the GC
        span = max(ran - prev, 1e-9)
        gc_time = gcs.overlap(prev, ran)
        busy = max(0.0, cpu - gc_time)
        blocked = max(0.0, span - cpu - wait)
        kind = max((busy, "stall-busy"), (wait, "stall-runqueue"), (blocked, "stall-blocked"))[1]
        kinds[kind].extend(rest)
    return {k: merge(v) for k, v in kinds.items()}


def _cause(key: str, process: str, kind: str, intervals: list[Interval], **kw: Any) -> Cause | None:
    if not intervals:
        return None
    d = [e - s for s, e in intervals]
    return Cause(key, process, kind, Cover(intervals), len(intervals), sum(d), max(d), **kw)


@attrs.frozen
class CauseRow:
    key: str
    tail_hit: int  #: tail transactions it overlapped
    control_hit: int  #: control (median) transactions it overlapped
    primary: int  #: tail transactions where it overlapped the most
    overlap: float  #: seconds of overlap summed over the tail transactions
    events: int
    total: float
    longest: float


@attrs.frozen
class TailTxn:
    start: float
    end: float
    overlaps: dict[str, float]  # cause key -> seconds
    primary: str | None  #: the cause that may be primary with the largest overlap

    @property
    def latency(self) -> float:
        return self.end - self.start


@attrs.define
class TailReport:
    quantile: float
    threshold: float  #: the tail's lower latency bound (the quantile), seconds
    median: float
    measured: int
    window: Interval
    tail: list[TailTxn]
    control: int
    rows: list[CauseRow]
    processes: list[Process]
    causes: list[Cause]
    sync_threshold: float

    def lines(self, worst: int = 5) -> list[str]:
        n = len(self.tail)
        lo, hi = self.window
        q = f"p{self.quantile * 100:g}"
        excess = sum(t.latency - self.median for t in self.tail)
        out = [f"timeline: {self.measured} transactions measured over {hi - lo:.2f} s; median "
               f"{self.median * 1e3:.2f} ms; tail = the {n} slowest (>= {q} = {self.threshold * 1e3:.2f} ms); "
               f"control = {self.control} median transactions",
               "",
               "events in the measured window, per process:"]
        for p in self.processes:
            if p.alive[1] < lo or p.alive[0] > hi:
                continue  # e.g. the `waltz up` that launched the cluster
            if p.txns:
                label = f"  {p.name} (client, gc threshold {list(p.gc_threshold)}, frozen {p.gc_frozen})"
            else:
                label = f"  {p.name} (gc threshold {list(p.gc_threshold)}, frozen {p.gc_frozen})"
            parts = [f"{c.kind} {c.count} x, {c.total * 1e3:.1f} ms in all"
                     + (f" (CPU {c.cpu * 1e3:.1f} ms)" if c.cpu is not None else "")
                     + f", longest {c.longest * 1e3:.2f} ms" for c in self.causes if c.process == p.name]
            out.append(label + (": " + "; ".join(parts) if parts else ": nothing recorded"))
        out += ["",
                f"causes of the tail ({n} transactions, {excess * 1e3:.1f} ms above the median in all). "
                "tail% / median%: transactions it overlapped; primary: transactions where it overlapped most; "
                "overlap: its time inside tail transactions, as a share of their excess over the median",
                f"  {'cause':<34} {'tail%':>6} {'median%':>8} {'primary':>8} {'overlap ms':>11} {'of excess':>9}"]
        quiet = [r for r in self.rows if not r.tail_hit]
        for r in self.rows:
            if not r.tail_hit:
                continue
            out.append(f"  {r.key:<34} {100 * r.tail_hit / n:6.1f} {100 * r.control_hit / max(1, self.control):8.1f} "
                       f"{r.primary:8d} {r.overlap * 1e3:11.1f} {100 * r.overlap / excess if excess > 0 else 0:8.1f}%")
        unexplained = sum(1 for t in self.tail if t.primary is None)
        out.append(f"  {'(no recorded event)':<34} {100 * unexplained / n:6.1f} {'':>8} {unexplained:8d}")
        if quiet:
            out.append("  overlapping no tail transaction: " + ", ".join(
                f"{r.key} ({100 * r.control_hit / max(1, self.control):.1f}% of median)" for r in quiet))
        if worst:
            out += ["", f"the {min(worst, n)} slowest transactions (ms from the transaction's start; events "
                        "overlapping it):"]
            for t in sorted(self.tail, key=lambda t: -t.latency)[:worst]:
                out.append(f"  {t.latency * 1e3:.2f} ms at +{(t.start - lo):.3f} s: " + (
                    ", ".join(self._events_in(t)) or "no recorded event"))
        return out

    def _events_in(self, t: TailTxn) -> list[str]:
        found = []
        for c in self.causes:
            for s, e in c.cover.intervals[max(0, bisect.bisect_right(c.cover.starts, t.start) - 1):]:
                if s >= t.end:
                    break
                if e > t.start:
                    found.append((s, f"{c.key} {(s - t.start) * 1e3:+.1f}..{(e - t.start) * 1e3:+.1f}"))
        found.sort()
        return [f for _, f in found]

    def to_json(self) -> dict[str, Any]:
        n = len(self.tail)
        return {"quantile": self.quantile, "threshold_ms": self.threshold * 1e3, "median_ms": self.median * 1e3,
                "measured": self.measured, "tail": n, "control": self.control,
                "causes": [{"cause": r.key, "tail_pct": 100 * r.tail_hit / n,
                            "median_pct": 100 * r.control_hit / max(1, self.control), "primary": r.primary,
                            "overlap_ms": r.overlap * 1e3, "events": r.events, "total_ms": r.total * 1e3,
                            "longest_ms": r.longest * 1e3} for r in self.rows],
                "unexplained": sum(1 for t in self.tail if t.primary is None)}


def analyse(processes: Sequence[Process], *, quantile: float = 0.999, sync_threshold: float = 0.002,
            min_overlap: float = 0.0005) -> TailReport:
    """Line the tail (transactions at or above ``quantile``) up with every process's events.

    Causes: GC collections per generation; loop stalls net of GC, by what the loop thread did;
    fdatasync calls longer than ``sync_threshold`` per storage, and where 2 storages were in such a
    call at once (with quorum 2 of 3, one slow replica is hidden, two are not). An event counts
    for a transaction when it overlaps it by ``min_overlap`` or more."""
    if not 0 < quantile < 1:
        raise TimelineError(f"quantile {quantile}: give a number between 0 and 1 (e.g. 0.999)")
    clients = [p for p in processes if p.txns]
    if not clients:
        raise TimelineError("no transactions recorded: the timeline needs the client of a `waltz perf produce` run")
    txns = sorted((t for p in clients for t in p.txns), key=lambda t: t[1] - t[0])
    lo = min(p.marks.get("measure_start", min(s for s, _ in p.txns)) for p in clients)
    hi = max(p.marks.get("measure_end", max(e for _, e in p.txns)) for p in clients)
    n = len(txns)
    cut = min(n - 1, math.floor(quantile * n))
    tail_raw = txns[cut:]
    median = txns[n // 2][1] - txns[n // 2][0]
    ctl_lo, ctl_hi = int(0.45 * n), max(int(0.45 * n) + 1, int(0.55 * n))
    step = max(1, (ctl_hi - ctl_lo) // 2000)
    control = txns[ctl_lo:ctl_hi:step]

    margin = 0.0  # measured transactions start and end inside the window (an event may straddle it)
    causes: list[Cause] = []
    slow_syncs: list[list[Interval]] = []
    stalls: dict[str, dict[str, list[Interval]]] = {}
    for p in processes:
        gcs, gc_cover = _gc_causes(p, lo - margin, hi + margin)
        causes += gcs
        stalls[p.name] = _stall_intervals(p, lo - margin, hi + margin, gc_cover)
        slow = [(s, e) for s, e in p.syncs if e - s >= sync_threshold and e >= lo - margin and s <= hi + margin]
        c = _cause(f"fdatasync>{sync_threshold * 1e3:g}ms {p.name}", p.name, "fdatasync", merge(slow),
                   may_be_primary=False)
        if c is not None:
            causes.append(c)
            slow_syncs.append(c.cover.intervals)
    # Every process's loop late at once: none of them ran, whatever its own state. On this kind of
    # machine (a VM) that is the hypervisor pausing it (steal time in /proc/stat), or other
    # programs holding every core. Counted once, as its own cause, not as each process's stall.
    everywhere: list[Interval] = []
    live = [p.name for p in processes if p.alive[0] <= lo and p.alive[1] >= hi]  # not `waltz up`'s parent
    if len(live) >= 3:
        everywhere = covered_by_at_least([merge(iv for ivs in stalls[name].values() for iv in ivs)
                                          for name in live], len(live))
        c = _cause("every process stalled at once", "all", "stall-all", everywhere)
        if c is not None:
            causes.append(c)
    for name, kinds in stalls.items():
        for kind, intervals in kinds.items():
            c = _cause(f"{kind} {name}", name, kind, subtract(intervals, everywhere))
            if c is not None:
                causes.append(c)
    if len(slow_syncs) >= 2:
        c = _cause(f"fdatasync>{sync_threshold * 1e3:g}ms on 2 replicas", "storages", "fdatasync-quorum",
                   covered_by_at_least(slow_syncs, 2))
        if c is not None:
            causes.append(c)

    eligible = {c.key for c in causes if c.may_be_primary}
    tail = []
    for s, e in tail_raw:
        overlaps = {c.key: ov for c in causes if (ov := c.cover.overlap(s, e)) >= min_overlap}
        best = max(((ov, k) for k, ov in overlaps.items() if k in eligible), default=None)
        tail.append(TailTxn(s, e, overlaps, best[1] if best is not None else None))
    rows = []
    for c in causes:
        hits = [t.overlaps[c.key] for t in tail if c.key in t.overlaps]
        ctl = sum(1 for s, e in control if c.cover.overlap(s, e) >= min_overlap)
        rows.append(CauseRow(c.key, len(hits), ctl, sum(1 for t in tail if t.primary == c.key), sum(hits),
                             c.count, c.total, c.longest))
    rows.sort(key=lambda r: (-r.primary, -r.tail_hit, r.key))
    return TailReport(quantile, tail_raw[0][1] - tail_raw[0][0], median, n, (lo, hi), tail, len(control), rows,
                      list(processes), causes, sync_threshold)
