"""The timeline of ``waltz perf`` (waltz_core/perf/timeline.py): interval arithmetic, the tail
analysis on synthetic events, the recorder's GC, stall and fdatasync capture, and the CLI."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from waltz_core.perf.timeline import (
    Cover,
    Process,
    Recorder,
    TimelineError,
    analyse,
    covered_by_at_least,
    load,
    merge,
    process_label,
    stall_threshold_from_env,
    subtract,
    watchdog_interval_from_env,
)

MS = 1e-3


# ------------------------------------------------------------------ interval arithmetic


def _brute_overlap(intervals: list[tuple[float, float]], s: float, e: float, step: float = 0.01) -> float:
    n = 0
    t = s + step / 2
    while t < e:
        n += any(a <= t < b for a, b in intervals)
        t += step
    return n * step


def test_merge_subtract_and_cover_agree_with_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(50):
        raw = [(a, a + rng.uniform(0, 3)) for a in (rng.uniform(0, 20) for _ in range(8))]
        merged = merge(raw)
        assert all(merged[i][1] < merged[i + 1][0] for i in range(len(merged) - 1))  # disjoint, sorted
        cover = Cover(raw)
        for _ in range(5):
            s = rng.uniform(-1, 21)
            e = s + rng.uniform(0, 6)
            assert cover.overlap(s, e) == pytest.approx(_brute_overlap(merged, s, e), abs=0.03)
    assert subtract([(0.0, 10.0)], merge([(2.0, 3.0), (5.0, 6.0), (9.0, 12.0)])) == [(0.0, 2.0), (3.0, 5.0), (6.0, 9.0)]
    assert subtract([(0.0, 1.0), (4.0, 5.0)], [(0.5, 4.5)]) == [(0.0, 0.5), (4.5, 5.0)]
    assert Cover([]).overlap(0, 1) == 0.0


def test_covered_by_at_least_two_of_three() -> None:
    a, b, c = [(0.0, 4.0)], [(3.0, 6.0)], [(5.0, 8.0), (10.0, 11.0)]
    assert covered_by_at_least([a, b, c], 2) == [(3.0, 4.0), (5.0, 6.0)]
    assert covered_by_at_least([a, b, c], 3) == []
    assert covered_by_at_least([a, b, c], 1) == [(0.0, 8.0), (10.0, 11.0)]


# ------------------------------------------------------------------ analysis on synthetic events


def _proc(label: str, **events: object) -> Process:
    return Process.from_json({"label": label, "pid": 1, **events})


def _synthetic() -> list[Process]:
    """1,000 transactions of 3 ms starting every 10 ms; 4 are slow: two across a 40 ms gen-2 GC of
    the server, one across a run-queue stall of the client's loop, one across fdatasyncs of two
    storages at once. Events elsewhere overlap nothing slow (a gen-0 GC at 5 s, one slow sync of a
    single storage)."""
    txns = [[i * 10 * MS, i * 10 * MS + 3 * MS] for i in range(1000)]
    txns[100][1] = txns[100][0] + 45 * MS  # t = 1.000 s
    txns[101][1] = txns[101][0] + 36 * MS  # t = 1.010 s
    txns[300][1] = txns[300][0] + 25 * MS  # t = 3.000 s
    txns[700][1] = txns[700][0] + 20 * MS  # t = 7.000 s
    client = _proc("client", txns=txns, marks={"measure_start": 0.0, "measure_end": 10.0},
                   # due, ran, cpu, wait, previous tick: 20 ms late, 1 ms CPU, 18 ms waiting for a CPU
                   stalls=[[3.002, 3.022, 0.001, 0.018, 3.001]])
    server = _proc("server-0", gc=[[1.004, 1.044, 2, 10, 0], [5.0, 5.0005, 0, 3, 0]])
    s0 = _proc("storage-0", syncs=[[7.002, 7.018], [8.5, 8.52]])
    s1 = _proc("storage-1", syncs=[[7.004, 7.017]])
    s2 = _proc("storage-2", syncs=[[7.0, 7.001]])
    return [client, server, s0, s1, s2]


def test_analyse_attributes_each_slow_transaction_to_its_cause() -> None:
    report = analyse(_synthetic(), quantile=0.996)
    assert report.measured == 1000
    assert [round(t.latency / MS) for t in sorted(report.tail, key=lambda t: t.start)] == [45, 36, 25, 20]
    assert report.median == pytest.approx(3 * MS)
    rows = {r.key: r for r in report.rows}
    gc2 = rows["gc2 server-0"]
    assert (gc2.tail_hit, gc2.primary, gc2.control_hit) == (2, 2, 0)
    # 40 ms of GC, inside the two transactions: 1.004-1.044 ∩ 1.000-1.045 + 1.010-1.044 ∩ 1.010-1.046
    assert gc2.overlap == pytest.approx(40 * MS + 34 * MS)
    assert rows["stall-runqueue client"].primary == 1
    assert rows["fdatasync>2ms on 2 replicas"].primary == 1
    assert rows["fdatasync>2ms on 2 replicas"].overlap == pytest.approx(13 * MS)  # 7.004-7.017
    assert rows["fdatasync>2ms storage-0"].tail_hit == 1
    assert "storage-2" not in " ".join(rows)  # its only sync was 1 ms: below the threshold
    assert rows["gc0 server-0"].tail_hit == 0
    assert all(t.primary is not None for t in report.tail)
    text = "\n".join(report.lines())
    assert "gc2 server-0" in text and "(no recorded event)" in text
    assert json.loads(json.dumps(report.to_json()))["unexplained"] == 0


def test_a_cause_as_frequent_in_the_median_shows_in_the_control_column() -> None:
    procs = _synthetic()
    # a gen-0 GC in the client every 10 ms, across every transaction: the tail's and the median's alike
    client = procs[0]
    procs[0] = Process(client.label, client.pid, [(i * 10 * MS + 1 * MS, i * 10 * MS + 1.6 * MS, 0, 1, 0)
                                                  for i in range(1000)],
                       client.stalls, client.syncs, client.txns, client.marks)
    rows = {r.key: r for r in analyse(procs, quantile=0.996).rows}
    gc0 = rows["gc0 client"]
    assert gc0.tail_hit == 4 and gc0.control_hit == analyse(procs, quantile=0.996).control
    assert gc0.primary == 0  # never the largest overlap: the real causes still win


def test_stalls_are_net_of_gc_and_classified_by_what_the_thread_did() -> None:
    txns = [[i * 10 * MS, i * 10 * MS + 2 * MS] for i in range(100)]
    txns[10][1] = txns[10][0] + 30 * MS
    txns[50][1] = txns[50][0] + 30 * MS
    client = _proc("client", txns=txns,
                   gc=[[0.101, 0.125, 2, 0, 0]],
                   # the stall is the GC (20 of 24 ms): counted as gc2, not as a stall
                   stalls=[[0.102, 0.126, 0.024, 0.0, 0.101],
                           # 20 ms late, 1 ms CPU, no run-queue wait: blocked (a system call, a sleep)
                           [0.503, 0.523, 0.001, 0.0, 0.502]])
    report = analyse([client], quantile=0.98)
    keys = {r.key: r for r in report.rows}
    assert keys["gc2 client"].primary == 1
    assert "stall-busy client" not in keys
    assert keys["stall-blocked client"].primary == 1


def test_a_stall_of_every_process_at_once_is_one_cause_not_each_process_s() -> None:
    txns = [[i * 10 * MS, i * 10 * MS + 2 * MS] for i in range(200)]
    txns[100][1] = txns[100][0] + 15 * MS  # 1.000-1.015: the machine paused 1.002-1.010
    txns[150][1] = txns[150][0] + 15 * MS  # 1.500-1.515: only storage-0 blocked 1.502-1.512
    paused = [1.002, 1.010, 0.0, 0.0, 1.001]  # due, ran, no CPU, no wait: neither ran
    procs = [_proc("client", txns=txns, stalls=[paused]),
             _proc("server-0", stalls=[paused]),
             _proc("storage-0", stalls=[[1.0025, 1.0105, 0.0, 0.0, 1.0015], [1.502, 1.512, 0.0, 0.0, 1.501]])]
    report = analyse(procs, quantile=0.99)
    rows = {r.key: r for r in report.rows}
    everywhere = rows["every process stalled at once"]
    assert everywhere.primary == 1 and everywhere.overlap == pytest.approx(7.5 * MS)  # 1.0025-1.010
    assert rows["stall-blocked storage-0"].primary == 1  # its own stall at 1.5 s, and the 0.5 ms left at 1.010
    # the server's and the client's stalls were the machine's, but for the 0.5 ms before storage-0's began
    for name in ("server-0", "client"):
        assert rows[f"stall-blocked {name}"].total == pytest.approx(0.5 * MS)
        assert rows[f"stall-blocked {name}"].primary == 0


def test_analyse_refuses_runs_without_transactions_and_bad_quantiles() -> None:
    with pytest.raises(TimelineError, match="no transactions"):
        analyse([_proc("server-0", gc=[[0, 1, 2, 0, 0]])])
    with pytest.raises(TimelineError, match="between 0 and 1"):
        analyse(_synthetic(), quantile=1.5)


# ------------------------------------------------------------------ recording


def test_recorder_captures_gc_loop_stalls_and_fdatasync(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, "client", threshold=0.005)
    gc.callbacks.append(rec.gc_callback)
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        gc.callbacks.remove(rec.gc_callback)
    gens = [g for _, _, g, _, _ in rec.gc]
    assert gens[-2:] == [2, 0] and all(e >= s for s, e, *_ in rec.gc)

    async def stall() -> None:
        await asyncio.sleep(0.02)  # ticks on time
        time.sleep(0.03)  # noqa: ASYNC251 - the point: the loop blocked 30 ms, off CPU
        await asyncio.sleep(0.01)
        end = time.thread_time() + 0.03
        while time.thread_time() < end:  # busy 30 ms on the loop
            pass
        await asyncio.sleep(0.01)

    loop = asyncio.new_event_loop()
    try:
        rec.attach(loop)
        loop.run_until_complete(stall())
    finally:
        loop.close()
    big = [(ran - due, cpu, wait) for due, ran, cpu, wait, _ in rec.stalls if ran - due > 0.02]
    # the sleep: late, off CPU and not waiting for one; the busy loop: its CPU
    slept = [s for s in big if s[0] - s[2] >= 0.025 and s[1] < 0.01]
    busy = [s for s in big if s[0] >= 0.025 and s[1] >= 0.025]
    assert len(slept) == 1 and len(busy) == 1, rec.stalls
    # on a loaded host the thread may also wait for a CPU: such a stall is told apart by its
    # run-queue wait, which must then account for it
    for late, cpu, wait in big:
        if (late, cpu, wait) not in slept + busy:
            assert late - cpu - wait < 0.02, rec.stalls

    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    try:
        wrapped = rec.wrap_fdatasync(os.fdatasync)
        os.write(fd, b"x")
        wrapped(fd)
    finally:
        os.close(fd)
    assert len(rec.syncs) == 1 and rec.syncs[0][1] >= rec.syncs[0][0]

    rec.txns.extend([1.0, 1.003, 2.0, 2.05])
    rec.mark("measure_start", 0.5)
    path = rec.dump()
    assert path is not None and path.name == f"client-{os.getpid()}.json"
    (proc,) = load(tmp_path)
    assert proc.txns == [(1.0, 1.003), (2.0, 2.05)] and proc.marks == {"measure_start": 0.5}
    assert len(proc.gc) == len(rec.gc) and len(proc.stalls) == len(rec.stalls)
    assert rec.dump() is None  # once


def test_process_labels_and_settings() -> None:
    assert process_label(["-v", "server", "start", "--config", "/d/server-0.toml"]) == "server-0"
    assert process_label(["storage", "start", "-c", "/d/storage-2.toml"]) == "storage-2"
    assert process_label(["perf", "produce", "--config", "/d/client.toml", "--rate", "5"]) == "perf-produce"
    assert process_label(["up", "--data-dir", "/d", "--partitions", "1"]) == "up"
    assert stall_threshold_from_env({}) == 0.002
    assert stall_threshold_from_env({"WALTZ_TIMELINE_STALL_MS": "5"}) == 0.005
    assert watchdog_interval_from_env({}) == 0.001
    assert watchdog_interval_from_env({"WALTZ_TIMELINE_TICK_MS": "0.5"}) == 0.0005
    for bad in ("x", "0", "-1", "nan", "inf"):
        with pytest.raises(TimelineError, match="WALTZ_TIMELINE_STALL_MS"):
            stall_threshold_from_env({"WALTZ_TIMELINE_STALL_MS": bad})
        with pytest.raises(TimelineError, match="WALTZ_TIMELINE_TICK_MS"):
            watchdog_interval_from_env({"WALTZ_TIMELINE_TICK_MS": bad})


def test_load_refuses_a_directory_without_dumps(tmp_path: Path) -> None:
    with pytest.raises(TimelineError, match="no timeline dumps"):
        load(tmp_path)
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(TimelineError, match="not a timeline dump"):
        load(tmp_path)


# ------------------------------------------------------------------ command line


def _waltz(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "waltz_core.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, cwd=Path(__file__).parents[2])


def test_bad_timeline_settings_are_one_line_errors(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    done = _waltz(["--version"], env={"WALTZ_TIMELINE_DIR": str(afile / "sub")})
    assert done.returncode == 2 and done.stderr.startswith("error: timeline directory") and "Traceback" not in done.stderr
    done = _waltz(["--version"], env={"WALTZ_TIMELINE_DIR": str(tmp_path), "WALTZ_TIMELINE_STALL_MS": "soon"})
    assert done.returncode == 2 and "WALTZ_TIMELINE_STALL_MS='soon'" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "old.json").write_text("{}")
    done = _waltz(["perf", "produce", "--local", "--timeline", str(tmp_path)])
    assert done.returncode == 2 and "already holds dumps" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_produce_local_with_timeline_records_every_process(tmp_path: Path) -> None:
    out = tmp_path / "tl"
    done = _waltz(["perf", "produce", "--local", "--json", "--duration", "1.5", "--warmup", "0.5", "--rate", "500",
                   "--in-flight", "64", "--timeline", str(out)])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    names = sorted(p.name for p in load(out))
    assert names == ["client", "server-0", "storage-0", "storage-1", "storage-2"]
    tl = result["timeline"]
    assert tl["measured"] == result["committed"] > 0 and tl["tail"] >= 1
    procs = {p.name: p for p in load(out)}
    assert len(procs["client"].txns) == result["committed"]
    # every storage synced (the wrapper saw it)
    assert all(procs[f"storage-{i}"].syncs for i in range(3))
    # every process ran the stall watchdog on its loop (uvloop or asyncio: it notes schedstat on its first tick)
    dumps = [json.loads(f.read_text()) for f in out.glob("*.json")]
    assert len(dumps) == 5 and all("schedstat" in d["notes"] for d in dumps), [d["notes"] for d in dumps]
    # WALTZ_GC=freeze (the default): every process froze its start-up objects once it served
    assert all(p.gc_frozen > 10_000 for p in procs.values()), {n: p.gc_frozen for n, p in procs.items()}
    # the analysis script reads the same directory
    script = Path(__file__).parents[2] / "benchmarks" / "tail_timeline.py"
    text = subprocess.run([sys.executable, str(script), str(out), "--worst", "2", "--quantile", "0.99"], capture_output=True, text=True,
                          timeout=60, check=True).stdout
    assert "causes of the tail" in text and "the 2 slowest transactions" in text


# ------------------------------------------------------------------ GC settings of waltz processes


def test_gc_settings_parse_and_freeze_only_in_a_configured_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from waltz_core.cli import process
    from waltz_core.errors import ConfigError

    assert process.gc_mode({}) == "freeze" and process.gc_mode({"WALTZ_GC": "Default"}) == "default"
    with pytest.raises(ConfigError, match="WALTZ_GC='off': expected one of freeze, default"):
        process.gc_mode({"WALTZ_GC": "off"})
    assert process.gc_threshold({}) is None
    assert process.gc_threshold({"WALTZ_GC_THRESHOLD": "5000, 20,30"}) == (5000, 20, 30)
    for bad in ("1,2", "a,b,c", "0,10,10", "700,-1,10"):
        with pytest.raises(ConfigError, match="WALTZ_GC_THRESHOLD"):
            process.gc_threshold({"WALTZ_GC_THRESHOLD": bad})

    monkeypatch.setattr(process, "_mode", None)
    monkeypatch.setattr(process, "_frozen", False)
    gc.unfreeze()  # an earlier test of this worker may have run `waltz perf produce` in process, which freezes
    assert process.started() is False and gc.get_freeze_count() == 0  # not started by the CLI: untouched
    threshold = gc.get_threshold()
    try:
        process.configure({"WALTZ_GC": "freeze", "WALTZ_GC_THRESHOLD": "1000,10,10"})
        assert gc.get_threshold() == (1000, 10, 10)
        assert process.started() is True and gc.get_freeze_count() > 1000
        assert process.started() is False  # once
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    monkeypatch.setattr(process, "_frozen", False)
    process.configure({"WALTZ_GC": "default"})
    assert process.started() is False and gc.get_freeze_count() == 0


def test_a_bad_gc_setting_is_one_error_line() -> None:
    done = _waltz(["--version"], env={"WALTZ_GC": "sometimes"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "error: environment variable WALTZ_GC='sometimes': expected one of freeze, default"
