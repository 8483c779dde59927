"""The latency a disk allows a replicated commit, measured without Waltz.

A storage node makes a round's records durable with one write and one ``fdatasync``: a round
takes every record that arrived before it starts, and the next round starts once it ends and a
record waits (docs/storage.md). A record that reaches a node while a round's ``fdatasync`` is
under way waits for that round, then for its own. A commit needs ``quorum`` replicas to have it.
So part of a commit's latency under a load is the disk's: how long its flushes take at that
load, and how much longer when several nodes flush the same disk (the replicas of a
``--local`` cluster do).

:func:`measure` plays exactly that, with no Waltz code: commits arrive at ``rate`` per second
(Poisson arrivals, as ``waltz perf produce --rate``), and one writer per replica runs the node's
rounds over them on the disk of a directory, each round one write of its records (over zeros
written first, as a node's journal writes over zeros written ahead, so no flush carries a
metadata change) and one ``fdatasync``. :func:`commit_latencies` then takes, for each commit,
the moment the ``quorum``-th writer made it durable.

With ``round_interval`` set to the time between a cluster's rounds (its records per fdatasync
over its commits per second), the writers flush as often as that cluster's nodes did, and the
result is the disk's share of its latency: the cluster adds its CPU and the hand-offs between
its processes. Without it, rounds start back to back and flush far more often than a node whose
CPU spaces its rounds; on a disk several writers share, that can be slower than the cluster
itself (docs/performance.md). The writers are threads: ``os.pwrite`` and ``os.fdatasync``
release the interpreter's lock.
"""

from __future__ import annotations

import bisect
import math
import os
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from ..storage.journal import ENTRY_HEAD_SIZE
from .histogram import LatencyHistogram

#: Bytes of zeros each writer writes over (then wraps): its flushes never extend the file.
FILE_BYTES = 16 * 1024 * 1024
#: Bytes a round's write adds to its records (a journal entry's head).
ROUND_HEAD_BYTES = ENTRY_HEAD_SIZE
#: A round writes at most this much (a burst of arrivals beyond it still makes one round).
MAX_ROUND_BYTES = 1024 * 1024
#: Commits one measurement replays at most (rate x seconds): each is a float per writer, and the
#: replay is Python, so ten million take a few seconds and a few hundred MB.
MAX_ARRIVALS = 10_000_000


def _check_quorum(quorum: int, writers: int) -> None:
    if not 1 <= quorum <= writers:
        raise ValueError(f"the quorum must be 1 to {writers} (the writers), got {quorum}")


def poisson_arrivals(rate: float, seconds: float, seed: int = 1) -> list[float]:
    """Arrival offsets in seconds from 0, ``rate`` per second on average, up to ``seconds``."""
    if not rate > 0 or not seconds > 0:
        raise ValueError("rate and seconds must be positive")
    if rate * seconds > MAX_ARRIVALS:
        raise ValueError(f"{rate:g} commits/s for {seconds:g} s are {rate * seconds:,.0f} commits; at most "
                         f"{MAX_ARRIVALS:,} are measured at once: lower the rate or the duration")
    rng = random.Random(seed)
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        out.append(t)
    return out


def commit_latencies(arrivals: Sequence[float], durable: Sequence[Sequence[float]], quorum: int) -> list[float]:
    """Seconds from each arrival until ``quorum`` writers made it durable.

    ``durable[w][i]`` is when writer ``w`` made arrival ``i`` durable (NaN: not before the end);
    an arrival fewer than ``quorum`` writers made durable is left out.
    """
    _check_quorum(quorum, len(durable))
    out = []
    for i, arrived in enumerate(arrivals):
        done = sorted(d for writer in durable if not math.isnan(d := writer[i]))
        if len(done) >= quorum:
            out.append(done[quorum - 1] - arrived)
    return out


@attrs.frozen(slots=True)
class Recording:
    """What the writers did: the arrivals, when each writer made each durable, each round's span."""

    arrivals: list[float]
    durable: list[list[float]]
    rounds: list[list[tuple[float, float]]]  #: per writer, (start, end) of each round


def record(directory: str | os.PathLike[str], writers: int, rate: float, seconds: float,
           record_size: int = 300, seed: int = 1, round_interval: float = 0.0) -> Recording:
    """Run ``writers`` writers over Poisson arrivals for ``seconds`` in scratch files of
    ``directory`` (removed after). Times are seconds from the start of the arrivals.

    ``round_interval``: the least time from one round's start to the next one's (0: the next
    starts as soon as a round ends and a commit waits). A node's own CPU per round spaces its
    rounds so; given the interval a cluster's nodes kept (its rounds per second), the writers
    flush the disk as often as they did, with as many records a round."""
    if writers < 1 or not 1 <= record_size <= MAX_ROUND_BYTES or not round_interval >= 0:
        raise ValueError(f"writers must be at least 1, record_size 1 to {MAX_ROUND_BYTES} bytes and round_interval "
                         "not negative")
    arrivals = poisson_arrivals(rate, seconds, seed)
    base = Path(directory)
    if not base.is_dir():
        raise FileNotFoundError(f"no such directory: {base}")
    paths = [base / f".waltz-disk-floor-{os.getpid()}-{i}" for i in range(writers)]
    created: list[Path] = []  #: removed after; a file of the same name made by someone else is not
    durable = [[math.nan] * len(arrivals) for _ in range(writers)]
    rounds: list[list[tuple[float, float]]] = [[] for _ in range(writers)]
    errors: list[BaseException] = []
    origin = [0.0]  #: the arrivals' time 0 on the monotonic clock: when every writer is ready
    ready = threading.Barrier(writers, action=lambda: origin.__setitem__(0, time.monotonic()))
    block = b"\x5a" * MAX_ROUND_BYTES

    def write(i: int) -> None:
        try:
            fd = os.open(paths[i], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created.append(paths[i])
        except OSError as exc:
            errors.append(exc)
            ready.abort()
            return
        try:
            os.pwrite(fd, bytes(FILE_BYTES), 0)
            os.fsync(fd)
            ready.wait()  # every file is written and synced: the arrivals start now
            start0 = origin[0]
            mine, spans = durable[i], rounds[i]
            monotonic, sleep, pwrite, fdatasync = time.monotonic, time.sleep, os.pwrite, os.fdatasync
            taken, offset, total, due = 0, 0, len(arrivals), 0.0
            while taken < total:
                now = monotonic() - start0
                wake = max(arrivals[taken], due)  # idle: the next round starts with the next record
                if wake > now:
                    sleep(wake - now)
                    now = monotonic() - start0
                due = now + round_interval
                upto = bisect.bisect_right(arrivals, now, taken)
                size = min(MAX_ROUND_BYTES, (upto - taken) * record_size + ROUND_HEAD_BYTES)
                if offset + size > FILE_BYTES:
                    offset = 0
                pwrite(fd, memoryview(block)[:size], offset)
                fdatasync(fd)
                end = monotonic() - start0
                offset += size
                for k in range(taken, upto):
                    mine[k] = end
                spans.append((now, end))
                taken = upto
        except (OSError, threading.BrokenBarrierError) as exc:  # raised by the caller, once every thread ended
            errors.append(exc)
            ready.abort()
        finally:
            os.close(fd)

    threads = [threading.Thread(target=write, args=(i,), name=f"disk-floor-{i}") for i in range(writers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for path in created:
            path.unlink(missing_ok=True)
    if errors:  # the writer that failed first, not the others it stopped at the barrier
        raise next((exc for exc in errors if not isinstance(exc, threading.BrokenBarrierError)), errors[0])
    return Recording(arrivals, durable, rounds)


@attrs.frozen(slots=True)
class DiskFloor:
    """What :func:`measure` found: the writers' rounds, their latency, and a commit's latency."""

    directory: str
    writers: int
    quorum: int
    rate: float  #: commits offered per second
    record_size: int
    seconds: float
    round_interval: float  #: the least seconds from one round's start to the next one's
    rounds_per_s: float  #: per writer
    records_per_round: float
    flush_ms: dict[str, float]  #: one round (its write and its fdatasync)
    commit_ms: dict[str, float]  #: from arrival until a quorum of writers made it durable

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)

    def summary(self) -> str:
        c, f = self.commit_ms, self.flush_ms
        who = f"{self.writers} writers" if self.writers != 1 else "1 writer"
        spaced = f", rounds {self.round_interval * 1e3:.2f} ms apart at least" if self.round_interval else ""
        return (f"{self.rate:,.0f} commits/s of {self.record_size:,} B, {who}{spaced}, durable on {self.quorum} of "
                f"{self.writers}: p50 {c['p50']} ms, p99 {c['p99']} ms, p99.9 {c['p99.9']} ms, max {c['max']} ms "
                f"(a round: p50 {f['p50']} ms, p99.9 {f['p99.9']} ms, max {f['max']} ms; {self.rounds_per_s:,.0f} "
                f"rounds/s per writer, {self.records_per_round:.1f} records each)")


def measure(directory: str | os.PathLike[str], writers: int = 3, quorum: int = 2, rate: float = 5000.0,
            seconds: float = 8.0, record_size: int = 300, seed: int = 1, round_interval: float = 0.0) -> DiskFloor:
    """Record ``writers`` writers at ``rate`` for ``seconds``; the latency of a commit on ``quorum`` of them."""
    _check_quorum(quorum, writers)  # before the recording, which takes seconds
    rec = record(directory, writers, rate, seconds, record_size, seed, round_interval)
    commits = LatencyHistogram()
    for latency in commit_latencies(rec.arrivals, rec.durable, quorum):
        commits.record(latency)
    if not commits.count:
        raise RuntimeError(f"no commit became durable on {quorum} writers in {seconds:g} s: the disk is stalled "
                           "or the rate too low")
    flushes = LatencyHistogram()
    for spans in rec.rounds:
        for start, end in spans:
            flushes.record(end - start)
    return DiskFloor(str(directory), writers, quorum, rate, record_size, seconds, round_interval,
                     flushes.count / seconds / writers,
                     len(rec.arrivals) * writers / flushes.count, flushes.summary_ms(), commits.summary_ms())
